"""tf-mwms in the simulator: tf_keras under MultiWorkerMirroredStrategy, a ring all-reduce.

    prophet-tf simulate --model resnet50 --workers 16 --schedulers prophet,tf-mwms
    prophet-tf simulate --validate benchmarks/bench-colocated-w3.json --schedulers tf-mwms

The bench's peer (``prophet_tf/bench/worker.py --framework tf-mwms``: tf_keras,
``CommunicationOptions(implementation=RING)``) takes each step as TensorFlow
2.21 runs it:

- forward, then backward; tf_keras's optimizer all-reduces the list of
  gradients in one call, and the collective all-reduce concatenates each pack
  of them into one tensor first, so a pack leaves once its last gradient is
  ready (the graph runs by data flow: TensorFlow reverses the list "so as to
  overlap calculation with communication");
- packs (:func:`packs`): the gradients, last variable first, cut into packs
  of at least ``bytes_per_pack`` bytes (``CommunicationOptions(bytes_per_pack)``);
  its default, 0, makes one pack of them all, which waits for every gradient.
  The packs are all-reduced one after another, in order (each waits for the
  strategy's ordering token), each once its gradients are ready;
- a pack's all-reduce is TensorFlow's ring over the W workers (its
  RingReducer): the pack cut into W chunks, each into S subdivisions (S = 2
  where a chunk would exceed 4 MiB, :func:`subdivisions`), and 2(W-1) steps,
  W-1 of reduce-scatter and W-1 of all-gather: in step s, chunk c goes from
  host (c + s) mod W to the next host. Every host sends one chunk and
  receives one in every step, so each link carries pack/W bytes per step and
  2(W-1)/W of the pack in all, each way (:func:`ring_steps` counts them);
- then the optimizer applies the sums (no time here, as the PS's apply in the
  PS model) and the next forward starts.

Network: every worker host has one link each way of the given bandwidth (the
PS hosts of the dedicated layout idle); a chunk crosses its sender's uplink
and its receiver's downlink. In a step every link carries the same S flows,
which the fluid model (``simulate_network.FluidSim``) shares evenly, so they
all end together: the step takes its busiest link's bytes over the link's
rate, then a one-way latency. The links' rate is the payload rate
(``ideal.payload_bytes_per_s``) times :data:`LINK_EFFICIENCY`, the one
number fitted to the bench (:func:`fit_link_efficiency`, on the runs named in
:data:`FITTED_ON`): what the ring's transfers got of it there. Every step of
every iteration being alike, one iteration is computed.
"""
from __future__ import annotations

import json
import os

from prophet_tf.bench import ideal as ideal_lib
from prophet_tf.bench import models, saved_profiles
from prophet_tf.bench.simulate import WARMUP_ITERATIONS

__all__ = ["NAME", "OPTIONS", "LINK_EFFICIENCY", "FITTED_ON", "parse_spec", "packs",
           "subdivisions", "ring_steps", "simulate_ring", "tf_mwms_runs", "load_runs",
           "fit_link_efficiency", "validate_row"]

NAME = "tf-mwms"
#: Options a ``tf-mwms`` spec takes (``tf-mwms:bytes_per_pack=4194304``).
OPTIONS = ("bytes_per_pack",)
#: TensorFlow's ring subdivides a chunk above this size, into at most
#: MAX_SUBDIVISIONS subdivisions per device.
MAX_CHUNK_BYTES = 4 * 1024 * 1024
MAX_SUBDIVISIONS = 2
#: The share of a link's payload rate the ring's transfers get: fitted by
#: :func:`fit_link_efficiency` on every cell of the committed runs in
#: FITTED_ON (tests/unit/test_simulate_ring.py fits it again).
LINK_EFFICIENCY = 0.84
FITTED_ON = ("suite-paper.json", "suite-paper-fair.json", "suite-paper-500mbit.json")


def parse_spec(spec: str) -> dict | None:
    """The options of a ``tf-mwms`` spec (``"tf-mwms"``,
    ``"tf-mwms:bytes_per_pack=N"``); None for any other scheduler's spec.

    Raises:
      ValueError: an unknown option, or a value that is not an int >= 0.
    """
    name, _, rest = spec.strip().partition(":")
    if name.strip() != NAME:
        return None
    options = {}
    for field in filter(None, (f.strip() for f in rest.split(","))):
        option, _, value = (s.strip() for s in field.partition("="))
        try:
            options[option] = int(value.replace("_", ""), 0)
        except ValueError:
            options[option] = -1
        if option not in OPTIONS or options[option] < 0:
            raise ValueError(f"{NAME} takes {', '.join(OPTIONS)}=int >= 0, e.g. "
                             f"'{NAME}:bytes_per_pack=4194304'. Received: {spec!r}")
    return options


def packs(profile: dict, bytes_per_pack: int = 0) -> list[list[int]]:
    """The packs of the profile's gradients, each a list of variable indices,
    in the order they are all-reduced: the variables last first, a new pack
    begun once the current one holds more than ``bytes_per_pack`` bytes (so
    each but the last holds at least that much); 0: one pack."""
    order = list(reversed(range(len(profile["variables"]))))
    if not bytes_per_pack:
        return [order]
    grouped: list[list[int]] = []
    size = 0
    for i in order:
        if not grouped or size > bytes_per_pack:
            grouped.append([])
            size = 0
        grouped[-1].append(i)
        size += profile["variables"][i]["nbytes"]
    return grouped


def subdivisions(pack_bytes: int, workers: int) -> int:
    """S: the fewest subdivisions (up to MAX_SUBDIVISIONS) that keep a chunk
    of the pack, pack / (W * S), within MAX_CHUNK_BYTES."""
    s = 1
    while pack_bytes // (workers * s) > MAX_CHUNK_BYTES and s < MAX_SUBDIVISIONS:
        s += 1
    return s


def ring_steps(pack_bytes: int, workers: int) -> list[list[tuple[int, int, int]]]:
    """The ring's steps for one pack: per step, its transfers ``(sender,
    receiver, bytes)``, one per chunk and subdivision. The pack's 4-byte
    elements are shared out as evenly as they go over the W * S fields."""
    if workers < 2:
        return []
    s = subdivisions(pack_bytes, workers)
    fields = workers * s
    base, extra = divmod(pack_bytes // 4, fields)
    size = [4 * (base + (f < extra)) for f in range(fields)]
    steps = []
    for step in range(2 * (workers - 1)):
        transfers = []
        for chunk in range(workers):
            sender = (chunk + step) % workers
            for sub in range(s):
                transfers.append((sender, (sender + 1) % workers, size[chunk * s + sub]))
        steps.append(transfers)
    return steps


def simulate_ring(profile: dict, workers: int, num_ps: int, bandwidth_mbit: float | None, *,
                  latency_ms: float = 0.0, iterations: int | None = None,
                  warmup: int = WARMUP_ITERATIONS, compute_s: float | None = None,
                  layout: str = "dedicated", framing: float = ideal_lib.TCP_FRAMING,
                  bytes_per_pack: int = 0,
                  link_efficiency: float = LINK_EFFICIENCY) -> dict:
    """Simulates tf-mwms training; returns its step time and the layout's ideal bound.

    Args:
      profile: a model profile (``models.profile_model``).
      workers: W >= 1, the hosts of the ring.
      num_ps, layout: the PS layout of the rows beside it; only the ideal
        bound depends on them (with PS hosts of their own, the bound counts
        the PS links' bytes, which the ring does not send).
      bandwidth_mbit: every link's bandwidth each way (Mbit/s); None = unlimited.
      latency_ms: one-way latency between two hosts, paid once per step.
      iterations, warmup: as ``simulate.simulate`` (every iteration is alike).
      compute_s: scale the profile's compute to this compute time per iteration.
      framing: wire bytes per message byte (``ideal.TCP_FRAMING``).
      bytes_per_pack: ``CommunicationOptions(bytes_per_pack)``; 0 = one pack.
      link_efficiency: the share of the payload rate the ring's transfers get.

    Returns:
      ``simulate.simulate``'s keys (``scheduler`` ``"tf-mwms"``, ``step_time_s``,
      ``step_times_s``, ``ideal_step_time_s``, ``ideal``, ...) and
      ``gradients_ready_s`` (the last gradient, from the step's start),
      ``packs`` (each one's variables, bytes, start, subdivisions and steps),
      ``timeline`` (each ring step's pack, start and end in the step) and
      ``link_bytes_per_step`` (per host, bytes ``sent`` and ``received``).

    Raises:
      ValueError: bad arguments, naming what was received.
    """
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an int >= 1. Received: workers={workers!r}")
    if bandwidth_mbit is not None and not bandwidth_mbit > 0:
        raise ValueError(f"bandwidth_mbit must be positive or None. "
                         f"Received: bandwidth_mbit={bandwidth_mbit!r}")
    if layout not in ideal_lib.LAYOUTS:
        raise ValueError(f"layout must be one of {ideal_lib.LAYOUTS}. Received: layout={layout!r}")
    if not 0 < link_efficiency <= 1:
        raise ValueError(f"link_efficiency must be in (0, 1]. "
                         f"Received: link_efficiency={link_efficiency!r}")
    if not isinstance(bytes_per_pack, int) or bytes_per_pack < 0:
        raise ValueError(f"bytes_per_pack must be an int >= 0. "
                         f"Received: bytes_per_pack={bytes_per_pack!r}")
    iterations = warmup + 8 if iterations is None else iterations
    if iterations <= warmup:
        raise ValueError(f"iterations must exceed warmup. Received: iterations={iterations}, "
                         f"warmup={warmup}")
    scale = 1.0 if compute_s is None else compute_s / profile["compute_s"]
    variables = profile["variables"]
    forward = sum(models.variable_forward_s(profile))
    ready_at = [(forward + v["backward_ready_s"]) * scale for v in variables]
    ready = max(ready_at)
    rate = ideal_lib.payload_bytes_per_s(bandwidth_mbit, framing)
    rate = None if rate is None else rate * link_efficiency
    sent, received = [0] * workers, [0] * workers
    now, timeline, made = 0.0, [], []
    for index, pack in enumerate(packs(profile, bytes_per_pack)):
        pack_bytes = sum(variables[i]["nbytes"] for i in pack)
        now = max(now, max(ready_at[i] for i in pack))  # its gradients, and the pack before
        steps = ring_steps(pack_bytes, workers)
        made.append({"variables": len(pack), "bytes": pack_bytes, "start_s": now,
                     "subdivisions": subdivisions(pack_bytes, workers), "steps": len(steps)})
        for transfers in steps:
            up, down = [0] * workers, [0] * workers
            for sender, receiver, nbytes in transfers:
                up[sender] += nbytes
                down[receiver] += nbytes
            busiest = max(up + down)
            end = now + (busiest / rate if rate else 0.0) + latency_ms / 1e3
            timeline.append({"pack": index, "start_s": now, "end_s": end})
            now = end
            sent = [a + b for a, b in zip(sent, up)]
            received = [a + b for a, b in zip(received, down)]
    bound = ideal_lib.ideal_step_time(profile, workers, num_ps, bandwidth_mbit, latency_ms,
                                      compute_s, layout=layout, framing=framing)
    return {"scheduler": NAME, "scheduler_class": f"{__name__}.simulate_ring",
            "step_time_s": now, "step_times_s": [now] * iterations,
            "ideal_step_time_s": bound["ideal_s"], "ideal": bound,
            "pushed_bytes_per_step": max(sent), "phase_spread_s": [0.0] * (iterations + 1),
            "gradients_ready_s": ready, "packs": made, "timeline": timeline,
            "link_bytes_per_step": {"sent": sent, "received": received},
            "link_efficiency": link_efficiency}


def tf_mwms_runs(data: dict) -> list[tuple[dict, dict]]:
    """``(config, tf-mwms result)`` of a bench JSON, or of every cell of a suite's."""
    benches = data["cells"] if isinstance(data.get("cells"), list) else [data]
    return [(b["config"], r) for b in benches for r in b["results"]
            if r["scheduler"].partition(":")[0] == NAME]


def _predict(config: dict, spec: str, profile: dict | None, link_efficiency: float) -> float:
    """The simulated step time of a bench run's tf-mwms, on its links and profile."""
    if "profile" in config:  # what the bench ran: measured in it, or a shipped one
        profile = saved_profiles.resolve(config["profile"])
    if profile is None:
        raise ValueError("the bench JSON names no profile; give one (--model)")
    # The pack size the run used: its spec's, else the one the bench chose
    # (config "tf_mwms", since 2026-12-05), else TensorFlow's default.
    options = {**(config.get("tf_mwms") or {}), **(parse_spec(spec) or {})}
    return simulate_ring(
        profile, config["workers"], config["ps"], config.get("link_mbit", config["bandwidth_mbit"]),
        latency_ms=config.get("link_latency_ms", config.get("latency_ms", 0.0)),
        layout=config.get("layout", "dedicated"),
        framing=config.get("ideal", {}).get("framing", 1.0),
        link_efficiency=link_efficiency, **options)["step_time_s"]


def fit_link_efficiency(runs: list[tuple[dict, dict]], profile: dict | None = None) -> float:
    """The link efficiency that predicts ``runs`` (``tf_mwms_runs``) best: the
    least squares of the relative errors. The step time is a + b / efficiency
    (compute, then the ring's bytes over the rate), so the fit is closed-form.

    Raises:
      ValueError: no runs, or none slower than its compute.
    """
    if not runs:
        raise ValueError("fitting the link efficiency needs tf-mwms runs. Received none")
    # x = 1 / efficiency minimises the sum of ((a + b x) / measured - 1)^2 at num / den.
    num = den = 0.0
    for config, result in runs:
        full = _predict(config, result["scheduler"], profile, 1.0)
        wire = _predict(config, result["scheduler"], profile, 0.5) - full  # b
        measured = result["step_time_s"]
        num += wire / measured * (1 - (full - wire) / measured)
        den += (wire / measured) ** 2
    if num <= 0:
        raise ValueError(f"no run is slower than its compute alone: nothing to fit. "
                         f"Received: {len(runs)} runs")
    return den / num


def validate_row(config: dict, result: dict, profile: dict | None = None,
                 link_efficiency: float = LINK_EFFICIENCY) -> dict:
    """A ``--validate`` row for a bench run's tf-mwms result: predicted
    against measured, as ``simulate_cli.validate``'s rows."""
    step = _predict(config, result["scheduler"], profile, link_efficiency)
    return {"scheduler": result["scheduler"], "measured_s": result["step_time_s"],
            "predicted_s": step, "predicted_range_s": [step, step], "share_sigma": 0.0,
            "error": step / result["step_time_s"] - 1, "predicted_phase_spread_s": 0.0,
            "message_costs": None, "costs": "ring", "link_efficiency": link_efficiency}


def load_runs(paths) -> list[tuple[dict, dict]]:
    """The tf-mwms runs of bench JSON files (:func:`tf_mwms_runs` of each)."""
    runs = []
    for path in paths:
        with open(os.fspath(path)) as f:
            runs += tf_mwms_runs(json.load(f))
    return runs
