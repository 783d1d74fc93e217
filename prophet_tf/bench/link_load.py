"""How busy an emulated cluster's links were, from its hosts' byte counters.

The bench reads each emulated host's interface counters every
``training_run.SAMPLE_PERIOD_S`` (``netns.interface_bytes``). A sample is
``(time.monotonic(), {host: (received, sent) or None})``; None where the
host's process is gone. A link's load over a span is the bytes its interface
counted over what the link's payload rate (the ideal bound's B) carries in
that span: about 1.0 is a link busy all the time; headers counted per packet
can take it up to ``ideal.TCP_FRAMING``.

- :func:`link_loads`: each host's load over the measured steps;
- :func:`link_phases`: each host's load in each equal part of its worker's
  step, averaged over the measured steps (where in the step a link idles);
- :class:`Counter`: a host's counter at any time, and :func:`step_ends`: a
  worker's steps, for readers that place the load beside other events
  (bench/breakdown.py).
"""
from __future__ import annotations

import bisect
import itertools
import statistics

#: Parts of the step over which a run's link loads are also given (``link_phases``).
PHASE_BINS = 10
#: The two directions: index into a sample's (received, sent), by JSON name.
SIDES = (("sent", 1), ("received", 0))

__all__ = ["PHASE_BINS", "SIDES", "Counter", "busiest_load", "link_loads", "link_phases",
           "median_loads", "step_ends"]


class Counter:
    """One host's counter in one direction, interpolated between samples."""

    def __init__(self, samples: list, host, side: int):
        known = [(t, c[host][side]) for t, c in samples if c.get(host) is not None]
        self._times = [t for t, _ in known]
        self._values = [v for _, v in known]

    def at(self, t: float) -> float | None:
        """The counter at ``t``; None outside the sampled span."""
        times = self._times
        if not times or t < times[0] or t > times[-1]:
            return None
        i = bisect.bisect_left(times, t)
        if times[i] == t:
            return self._values[i]
        t0, t1, v0, v1 = times[i - 1], times[i], self._values[i - 1], self._values[i]
        return v0 + (v1 - v0) * (t - t0) / (t1 - t0)


def step_ends(report: dict) -> list[float]:
    """A worker's batch ends, after the start of its first batch (monotonic s)."""
    return list(itertools.accumulate(report["step_times_s"], initial=report["train_window"][0]))


def _per_host(samples: list, load) -> dict:
    """Per direction and host (sorted), ``load(counter, host)``."""
    return {name: [load(Counter(samples, h, side), h) for h in sorted(samples[0][1])]
            for name, side in SIDES}


def link_loads(samples: list, window: tuple[float, float],
               payload_bytes_per_s: float) -> dict | None:
    """Each host's link load over ``window``, one list per direction (``sent``:
    its uplink, ``received``: its downlink), by host. None where a host was not
    sampled over the whole window."""
    begin, end = window
    if end <= begin or not samples:
        return None

    def load(counter, _host):
        a, b = counter.at(begin), counter.at(end)
        return None if a is None or b is None else (b - a) / ((end - begin) * payload_bytes_per_s)
    return _per_host(samples, load)


def link_phases(samples: list, reports: list[dict], host_worker: dict, warmup: int,
                payload_bytes_per_s: float, bins: int = PHASE_BINS) -> dict | None:
    """Where in the step each host's link is busy: per direction and host,
    ``bins`` loads, one per equal part of the step, averaged over the measured
    steps. A host's steps are its own worker's (``host_worker``; a step ends
    when its batch ends), or worker 0's on a host without one. None where a
    host was not sampled over a step."""
    if not samples:
        return None

    def loads(counter, host):
        ends = step_ends(reports[host_worker.get(host, 0)])
        sums, steps = [0.0] * bins, 0
        for begin, end in zip(ends[warmup:], ends[warmup + 1:]):
            counts = [counter.at(begin + (end - begin) * k / bins) for k in range(bins + 1)]
            if end <= begin or None in counts:
                continue
            part_bytes = (end - begin) / bins * payload_bytes_per_s
            for k in range(bins):
                sums[k] += (counts[k + 1] - counts[k]) / part_bytes
            steps += 1
        return [x / steps for x in sums] if steps else None
    return _per_host(samples, loads)


def median_loads(runs: list[dict | None]) -> dict | None:
    """Runs' ``link_loads`` or ``link_phases`` combined: per direction and
    host, the median (elementwise, for phases) over the runs that measured it."""
    known = [x for x in runs if x]
    if not known:
        return None
    out = {}
    for side in known[0]:
        out[side] = []
        for h in range(len(known[0][side])):
            values = [x[side][h] for x in known if x[side][h] is not None]
            if not values:
                out[side].append(None)
            elif isinstance(values[0], list):
                out[side].append([statistics.median(v) for v in zip(*values)])
            else:
                out[side].append(statistics.median(values))
    return out


def busiest_load(loads: dict | None) -> float | None:
    """The highest link load of a run, over hosts and directions (None: not measured)."""
    values = [v for side in (loads or {}).values() for v in side if v is not None]
    return max(values) if values else None
