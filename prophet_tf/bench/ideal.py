"""The ideal step time of a run: a lower bound no scheduler can beat.

For W workers and P PS tasks on links of bandwidth B (bytes/s, each
direction), one-way latency L, and a model profile (per variable: bytes,
forward time, backward readiness)::

    ideal = max(C, D / B, F + B_1 + 2·W·b_1 / B + 2·L)

- C: compute time of one step (forward + backward) on a worker.
- D: bytes per step through the busiest link in one direction. Each worker
  pushes the whole gradient M and pulls the whole model M, so a worker link
  carries M each way; PS task p owns M_p bytes (the sharding plan) and
  receives W·M_p and sends W·M_p. D = max(M, W·max_p M_p).
- The first layer's critical path: its forward pass cannot start before its
  new parameters are back, which needs the whole forward F, the backward up
  to its gradient B_1 (the end of backprop, as the first layer's gradient is
  the last), then its push and pull of b_1 bytes, which cross the PS's link
  with the other W-1 workers' copies (W·b_1/B each way), plus a one-way
  latency each way.

Each term assumes the others away (full overlap, no per-message cost, no
PS apply time), so the bound is optimistic; a scheduler within 15% of it
leaves little on the table.
"""
from __future__ import annotations

import types

from prophet_tf.ps import sharding

__all__ = ["busiest_link_bytes", "ideal_step_time"]


def _specs(profile: dict):
    return [types.SimpleNamespace(key=i, shape=v["shape"], dtype="float32")
            for i, v in enumerate(profile["variables"])]


def busiest_link_bytes(profile: dict, workers: int, num_ps: int,
                       partition_bytes: int = sharding.DEFAULT_MAX_PARTITION_BYTES) -> int:
    """D: bytes per step over the busiest link in one direction (see module doc)."""
    model_bytes = sum(v["nbytes"] for v in profile["variables"])
    per_ps = [0] * num_ps
    for p in sharding.plan(_specs(profile), num_ps, partition_bytes):
        per_ps[p.ps_index] += p.nbytes
    return max(model_bytes, workers * max(per_ps))


def ideal_step_time(profile: dict, workers: int, num_ps: int, bandwidth_mbit: float | None,
                    latency_ms: float = 0.0, compute_s: float | None = None) -> dict:
    """The ideal bound and its three terms, in seconds.

    Args:
      profile: a model profile (:func:`prophet_tf.bench.models.profile_model`).
      workers, num_ps: W and P.
      bandwidth_mbit: link bandwidth in Mbit/s; None = unlimited.
      latency_ms: one-way latency between two hosts.
      compute_s: the step's compute time C if measured otherwise (the bench
        measures it with every worker computing at once); the profile's
        forward and backward times are scaled to it. Default: the profile's.

    Returns:
      ``{"ideal_s", "compute_s", "busiest_link_s", "first_layer_s", "busiest_link_bytes"}``.
    """
    scale = 1.0 if compute_s is None else compute_s / profile["compute_s"]
    compute = profile["compute_s"] * scale
    forward = profile["forward_s"] * scale
    first = profile["variables"][0]
    bytes_per_s = None if bandwidth_mbit is None else bandwidth_mbit * 1e6 / 8
    busiest = busiest_link_bytes(profile, workers, num_ps)
    link_s = 0.0 if bytes_per_s is None else busiest / bytes_per_s
    first_bytes = sum(v["nbytes"] for v in profile["variables"][:1])
    transfer = 0.0 if bytes_per_s is None else 2 * workers * first_bytes / bytes_per_s
    first_layer = forward + first["backward_ready_s"] * scale + transfer + 2 * latency_ms / 1e3
    return {"ideal_s": max(compute, link_s, first_layer), "compute_s": compute,
            "busiest_link_s": link_s, "first_layer_s": first_layer,
            "busiest_link_bytes": busiest}
