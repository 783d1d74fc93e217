"""The ideal step time of a run: a lower bound no scheduler can beat.

For W workers and P PS tasks on links of bandwidth B (bytes/s, each
direction), one-way latency L, and a model profile (per variable i: bytes
b_i, forward time f_i, backward readiness R_i after the forward ends)::

    ideal = max(C, F + max_i R_i, D(all) / B, max_i chain_i)
    chain_i = F - F_<i + min_{j<=i} R_j + D(S_i) / B + 2·L

- C: compute time of one step on a worker; at least the forward F (the
  profile's) plus the last gradient's readiness. The f_i are F shared out
  in the proportions of the profile's per-variable medians
  (``models.variable_forward_s``), as the emulated model runs them.
- D(S): the fewest bytes the busiest link must carry in one direction per
  step for a set of variables S of b(S) bytes, under the best placement
  (every variable cut as finely as wanted and spread evenly):
  - dedicated layout (PS tasks on hosts of their own): every worker pushes
    and pulls b(S) over its own link, and the P PS links share W·b(S):
    D(S) = max(1, W/P)·b(S);
  - colocated layout (PS tasks on the worker hosts): of b(S), the share
    held on a worker's own host never crosses its NIC; every host's NIC
    carries the pushes of the remote share and its PS tasks' answers to the
    W-1 other workers: 2·(W-1)·b(S) over W uplinks, so
    D(S) = 2·(W-1)/W·b(S).
- chain_i: the critical chain of variable i. Next step's forward needs the
  new values of variables 0..i (S_i) by F_<i (the forward time before
  variable i) after the step starts; none of their gradients exists before
  min_{j<=i} R_j after this step's forward ends; in between, S_i's bytes
  must cross the busiest link (pushes and pulls pipelined, partition by
  partition, so each direction is counted once), plus a one-way latency each
  way. For the last variable this is the whole model's link time plus the
  last forward, so chain dominates D(all)/B; for the first it is the
  classic "first layer waits for the whole backprop" path.

B is the payload bandwidth: a link of R bits/s carries R / 8 / f bytes of
messages, where f = :data:`TCP_FRAMING` = 1514 / 1448 for TCP over Ethernet
with a 1500-byte MTU (each segment of 1448 payload bytes, with TCP
timestamps, goes out with 66 bytes of TCP, IP and Ethernet headers, which a
shaper such as ``tc tbf`` counts). ACKs of the reverse direction's data are
left out (receive offloads make them fewer), so the bound stays a bound.

Each term assumes the others away (full overlap, no per-message cost, no
PS apply time, partitions as small as wanted), so the bound holds for any
scheduler, any partition size and any placement; a run within 15% of it
leaves little on the table. In the colocated layout it bounds an all-reduce
as well: a bandwidth-optimal all-reduce (the ring) also sends and receives
2·(W-1)/W·b(S) per worker link (Patarasuk and Yuan, JPDC 2009), so no
exchange of the same bytes, PS or all-reduce, beats it.
"""
from __future__ import annotations

from prophet_tf.bench import models

LAYOUTS = ("colocated", "dedicated")
#: Wire bytes per payload byte of TCP over Ethernet, MTU 1500 (module doc).
TCP_FRAMING = 1514 / 1448

__all__ = ["LAYOUTS", "TCP_FRAMING", "link_bytes", "payload_bytes_per_s", "ideal_step_time"]


def payload_bytes_per_s(bandwidth_mbit: float | None, framing: float = TCP_FRAMING):
    """Message bytes per second through a link of ``bandwidth_mbit`` (None: unlimited)."""
    return None if bandwidth_mbit is None else bandwidth_mbit * 1e6 / 8 / framing


def link_bytes(nbytes: float, workers: int, num_ps: int, layout: str) -> float:
    """D(S): busiest-link bytes per step, one direction, for ``nbytes`` of
    variables under the best placement (see module doc)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}. Received: layout={layout!r}")
    if layout == "colocated":
        return 2 * (workers - 1) / workers * nbytes
    return max(1.0, workers / num_ps) * nbytes


def ideal_step_time(profile: dict, workers: int, num_ps: int, bandwidth_mbit: float | None,
                    latency_ms: float = 0.0, compute_s: float | None = None,
                    layout: str = "dedicated", framing: float = TCP_FRAMING) -> dict:
    """The ideal bound and its terms, in seconds.

    Args:
      profile: a model profile (:func:`prophet_tf.bench.models.profile_model`).
      workers, num_ps: W and P.
      bandwidth_mbit: link bandwidth in Mbit/s; None = unlimited.
      latency_ms: one-way latency between two hosts.
      compute_s: the step's compute time C if measured otherwise (the bench
        measures it with every worker computing at once); the profile's
        forward and backward times are scaled to it. Default: the profile's.
      layout: "dedicated" or "colocated".
      framing: wire bytes per message byte (1.0 where the shaper counts
        message bytes, as the transport's token bucket does).

    Returns:
      ``{"ideal_s", "compute_s", "busiest_link_s", "chain_s", "chain_variable",
      "busiest_link_bytes", "layout"}``: ``chain_s`` is the longest critical
      chain, of variable ``chain_variable``.
    """
    scale = 1.0 if compute_s is None else compute_s / profile["compute_s"]
    compute = profile["compute_s"] * scale
    variables = profile["variables"]
    forward_s = [f * scale for f in models.variable_forward_s(profile)]
    forward = sum(forward_s)
    bytes_per_s = payload_bytes_per_s(bandwidth_mbit, framing)

    def link_s(nbytes: float) -> float:
        if bytes_per_s is None:
            return 0.0
        return link_bytes(nbytes, workers, num_ps, layout) / bytes_per_s

    model_bytes = sum(v["nbytes"] for v in variables)
    # A one-way latency each way, unless no message leaves the host.
    remote = layout == "dedicated" or workers > 1
    latency = 2 * latency_ms / 1e3 if remote else 0.0
    chain, chain_variable = 0.0, 0
    forward_before, earliest_ready, prefix_bytes = 0.0, float("inf"), 0
    for i, v in enumerate(variables):
        earliest_ready = min(earliest_ready, v["backward_ready_s"] * scale)
        prefix_bytes += v["nbytes"]
        t = forward - forward_before + earliest_ready + link_s(prefix_bytes) + latency

        if t > chain:
            chain, chain_variable = t, i
        forward_before += forward_s[i]
    busiest = link_bytes(model_bytes, workers, num_ps, layout)
    compute = max(compute, forward + max(v["backward_ready_s"] for v in variables) * scale)
    return {"ideal_s": max(compute, link_s(model_bytes), chain), "compute_s": compute,
            "busiest_link_s": link_s(model_bytes), "chain_s": chain,
            "chain_variable": chain_variable, "busiest_link_bytes": busiest, "layout": layout,
            "framing": framing}
