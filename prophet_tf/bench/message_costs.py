"""What one message costs at its ends, measured from a bench run's timelines.

A push's time from the start of its serialisation to the PS's answer is, when
no link is crossed, all cost at the ends: serialising, copying, gRPC and
Python on both sides, the PS's checks and sum, and waiting for the CPU that
the run's other processes share. In the colocated layout every worker pushes
to the PS task on its own host, so each run measures these costs under its
own load. A push's time also holds its wait behind the other messages in
flight, which the simulator models itself; so the pushes are grouped by size
(powers of two), each group gives its lower-quartile push, and a least-squares
line through those gives a cost per message and a cost per byte, which
``prophet-tf simulate`` adds to each message before its bytes cross a link
(``rpc_overhead_s`` and ``rpc_per_byte_s`` of ``simulate.simulate``).

The dedicated layout has no push that crosses no link, so its runs measure
nothing here; the simulator then uses its default per-message cost.
"""
from __future__ import annotations

import glob
import json
import os
import statistics

__all__ = ["measure", "combine", "MIN_MESSAGES", "QUANTILE"]

#: Fewer local pushes than this measure nothing.
MIN_MESSAGES = 20
#: Each size group's push at this quantile of time: one that hardly waited.
QUANTILE = 0.25
_MIN_GROUP = 3
_PUSH_TRACK = 100  # prophet_tf.engine.timeline: push to PS i is track 100 + i


def measure(directory: str, workers: int, num_ps: int, layout: str,
            warmup_steps: int) -> dict | None:
    """The per-message and per-byte cost of a run's pushes that crossed no
    link (``directory``: its ``worker-<i>.json`` timelines).

    Returns:
      ``{"overhead_s", "per_byte_s", "messages"}``, or None when the layout
      has no local PS or too few local pushes were recorded.
    """
    if layout != "colocated":
        return None
    sizes, times = [], []
    for path in sorted(glob.glob(os.path.join(directory, "worker-*.json"))):
        worker = int(os.path.basename(path)[len("worker-"):-len(".json")])
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        for e in events:
            if e.get("cat") != "push" or e["args"]["step"] < warmup_steps:
                continue
            ps = e["tid"] - _PUSH_TRACK
            if 0 <= ps < num_ps and ps % workers == worker:  # PS ps lives on host ps % W
                sizes.append(float(e["args"]["bytes"]))
                times.append(e["dur"] / 1e6)
    if len(sizes) < MIN_MESSAGES:
        return None
    groups: dict[int, list[tuple[float, float]]] = {}
    for size, seconds in zip(sizes, times):
        groups.setdefault(int(size).bit_length(), []).append((seconds, size))
    chosen = []
    for pushes in groups.values():
        if len(pushes) >= _MIN_GROUP:
            pushes.sort()
            chosen.append(pushes[int(QUANTILE * (len(pushes) - 1))])
    if not chosen:
        return None
    overhead, per_byte = _line([size for _, size in chosen], [t for t, _ in chosen])
    return {"overhead_s": overhead, "per_byte_s": per_byte, "messages": len(sizes)}


def _line(x: list[float], y: list[float]) -> tuple[float, float]:
    """Least-squares y = a + b x with a, b >= 0."""
    if len(x) < 2:
        return max(0.0, y[0]), 0.0
    mx, my = statistics.fmean(x), statistics.fmean(y)
    sxx = sum((v - mx) ** 2 for v in x)
    b = sum((u - mx) * (v - my) for u, v in zip(x, y)) / sxx if sxx > 0 else 0.0
    if b <= 0:
        return max(0.0, statistics.median(y)), 0.0
    a = my - b * mx
    if a < 0:  # through the origin
        return 0.0, sum(u * v for u, v in zip(x, y)) / sum(u * u for u in x)
    return a, b


def combine(costs: list[dict | None]) -> dict | None:
    """One scheduler's costs over its runs: the median of each."""
    costs = [c for c in costs if c]
    if not costs:
        return None
    return {"overhead_s": statistics.median(c["overhead_s"] for c in costs),
            "per_byte_s": statistics.median(c["per_byte_s"] for c in costs),
            "messages": sum(c["messages"] for c in costs)}
