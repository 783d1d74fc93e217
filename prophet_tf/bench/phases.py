"""How far apart a bench run's workers step, read from their timelines.

Synchronous workers out of phase load their hosts' links in turns, so each
link idles while the other is busy and the step is longer. A run can change
between the two: the bench's FIFO workers step together for a while, then
one runs tens of ms ahead for a while, then together again
(``docs/records/2026-12-07-fifo-together-and-apart.md``). A step's spread is
the latest worker's start of backprop minus the earliest's (as the
simulator's ``phase_spread_s``, of its iterations' starts).

- :func:`phase_offsets`: each worker's start of backprop minus worker 0's.
- :func:`phase_modes`: the measured steps split by their spread, with the
  median step time of each part.
"""
from __future__ import annotations

import statistics

from prophet_tf.bench.breakdown import backward_starts, worker_events
from prophet_tf.bench.results import WARMUP_STEPS

__all__ = ["phase_offsets", "phase_modes", "APART_MS"]

#: A step whose workers started backprop further apart than this ran apart:
#: a fifth of the default bench's step, and every step of its P3,
#: ByteScheduler and Prophet runs is within it (the record above).
APART_MS = 40.0


def phase_offsets(directory: str, warmup: int = WARMUP_STEPS) -> dict:
    """Worker w -> (median, min, max) over the measured steps of its start of
    backprop minus worker 0's, in ms."""
    starts = [backward_starts(events) for events in worker_events(directory)]
    out = {}
    for w in range(1, len(starts)):
        offsets = [(starts[w][k] - t) / 1e3 for k, t in starts[0].items()
                   if k >= warmup and k in starts[w]]
        if offsets:
            out[w] = (statistics.median(offsets), min(offsets), max(offsets))
    return out


def phase_modes(directory: str, warmup: int = WARMUP_STEPS, apart_ms: float = APART_MS) -> dict:
    """The measured steps (from ``warmup`` on) whose next step started too,
    split by their spread: ``{"together": part, "apart": part, "apart_ms"}``,
    each part ``{"steps", "step_ms", "spread_ms"}`` (its count, and the median
    of its steps' times, worker 0's start of backprop to the next one, and
    spreads; None when it has no step)."""
    if not apart_ms > 0:
        raise ValueError(f"apart_ms must be positive. Received: apart_ms={apart_ms!r}")
    starts = [backward_starts(events) for events in worker_events(directory)]
    parts: dict[str, list] = {"together": [], "apart": []}
    for k, t in sorted(starts[0].items()):
        if k < warmup or k + 1 not in starts[0] or any(k not in s for s in starts):
            continue
        spread = (max(s[k] for s in starts) - min(s[k] for s in starts)) / 1e3
        parts["apart" if spread > apart_ms else "together"].append(
            ((starts[0][k + 1] - t) / 1e3, spread))
    out: dict = {"apart_ms": apart_ms}
    for name, steps in parts.items():
        out[name] = {"steps": len(steps),
                     "step_ms": statistics.median(s for s, _ in steps) if steps else None,
                     "spread_ms": statistics.median(d for _, d in steps) if steps else None}
    return out
