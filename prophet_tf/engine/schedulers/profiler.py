"""What the Prophet scheduler learns from a run: bursts, bandwidth and drift.

Pure functions and small classes, with every time passed in (nanoseconds of
one clock, virtual or real); nothing here reads a clock or imports TensorFlow,
so a simulator can drive it exactly as the engine does.

- :func:`split_bursts` cuts one readiness trace into bursts (Prophet's rule: a
  gap of more than twice the mean gap starts a new burst).
- :func:`find_bursts` turns the readiness times of several profiled iterations
  into :class:`Burst`\\ s: the keys that arrive together and the predicted time
  from one burst's arrival to the next (medians over the iterations).
- :class:`BandwidthEstimator` is one link's achieved throughput over its
  recent transfers.
- :func:`drifted` / :class:`DriftDetector` tell when a measurement has moved
  by more than a threshold (20%) away from the plan's value.
"""
from __future__ import annotations

import collections
import dataclasses
import statistics
from typing import Mapping, Sequence

__all__ = ["Burst", "split_bursts", "find_bursts", "BandwidthEstimator", "drifted",
           "DriftDetector", "DRIFT_THRESHOLD"]

#: Relative change of bandwidth or compute time that invalidates a plan (ours).
DRIFT_THRESHOLD = 0.2


@dataclasses.dataclass(frozen=True)
class Burst:
    """Gradients that become ready together, and the pause after them.

    Times are medians over the profiled iterations, in ns since the first
    gradient of the iteration became ready.

    Attributes:
      keys: the gradients (variable keys) of the burst.
      start_ns: when its first gradient becomes ready.
      arrive_ns: when its last gradient becomes ready: the burst has arrived.
      gap_ns: Δt, the predicted time from this burst's arrival to the next
        burst's arrival (0 for the last burst). A block started when this burst
        arrives may keep its link busy this long without delaying the next
        burst's (more urgent) gradients.
      nbytes: total size of the burst's gradients.
    """

    keys: frozenset
    start_ns: int
    arrive_ns: int
    gap_ns: int
    nbytes: int


def split_bursts(times: Sequence[float]) -> list[list[int]]:
    """Groups readiness times into bursts.

    Sorted by time, with gaps g_i = t_i - t_(i-1) and their mean m, a gap
    larger than 2·m starts a new burst (Prophet's rule). Equal times never
    split, so a trace of identical times, or of one time, is one burst.

    Args:
      times: readiness times, in any order and unit.

    Returns:
      Lists of indices into ``times``, each in time order, bursts in time order;
      [] for no times.
    """
    order = sorted(range(len(times)), key=times.__getitem__)
    if len(order) < 2:
        return [order] if order else []
    mean_gap = (times[order[-1]] - times[order[0]]) / (len(order) - 1)
    bursts = [[order[0]]]
    for prev, cur in zip(order, order[1:]):
        if times[cur] - times[prev] > 2 * mean_gap:
            bursts.append([])
        bursts[-1].append(cur)
    return bursts


def find_bursts(iterations: Sequence[Mapping[int, int]],
               nbytes: Mapping[int, int]) -> list[Burst]:
    """Finds the bursts of the profiled iterations.

    Each key's readiness time relative to its iteration's first gradient is
    reduced to its median over the iterations; :func:`split_bursts` on those
    medians gives the bursts (so one noisy iteration cannot reorder them). The
    gap after burst k is then the median over the iterations of the time
    between burst k's and burst k+1's arrivals (the readiness of their last key
    in that iteration).

    Args:
      iterations: per profiled iteration, ``{key: ready_ns}`` (any origin). A
        key missing from some iterations is placed by the others.
      nbytes: size of each key's gradient in bytes.

    Returns:
      The bursts in arrival order; the last one has ``gap_ns == 0``.

    Raises:
      ValueError: no iteration has a key, or a key has no size.
    """
    relative = []
    for times in iterations:
        if times:
            origin = min(times.values())
            relative.append({k: t - origin for k, t in times.items()})
    if not relative:
        raise ValueError("find_bursts needs at least one profiled iteration with a gradient. "
                         f"Received: {len(iterations)} iterations, all empty")
    per_key: dict[int, list[int]] = {}
    for times in relative:
        for k, t in times.items():
            per_key.setdefault(k, []).append(t)
    missing = [k for k in per_key if k not in nbytes]
    if missing:
        raise ValueError(f"find_bursts needs the size of every key. Received: no size for "
                         f"keys={sorted(missing)[:10]}")
    keys = sorted(per_key)
    median = [statistics.median(per_key[k]) for k in keys]
    groups = [[keys[i] for i in burst] for burst in split_bursts(median)]
    median_of = dict(zip(keys, median))

    def arrival(times, group):
        present = [times[k] for k in group if k in times]
        return max(present) if present else None

    bursts = []
    for j, group in enumerate(groups):
        gap = 0
        if j + 1 < len(groups):
            deltas = []
            for times in relative:
                a, b = arrival(times, group), arrival(times, groups[j + 1])
                if a is not None and b is not None:
                    deltas.append(b - a)
            gap = max(0, int(statistics.median(deltas)) if deltas else int(
                max(median_of[k] for k in groups[j + 1]) - max(median_of[k] for k in group)))
        bursts.append(Burst(keys=frozenset(group), start_ns=int(min(median_of[k] for k in group)),
                          arrive_ns=int(max(median_of[k] for k in group)), gap_ns=gap,
                          nbytes=sum(nbytes[k] for k in group)))
    return bursts


class BandwidthEstimator:
    """Achieved throughput of one link over its recent transfers.

    The estimate is the bytes of the last ``window`` transfers divided by the
    time the link was busy with them (the union of their [start, end)
    intervals, so transfers that overlap are not counted twice). A byte-weighted
    ratio rather than a mean of per-transfer rates: a tiny transfer, dominated
    by per-message latency, barely moves it. The Prophet prototype used the
    best throughput seen while profiling; a windowed ratio also follows a link
    whose bandwidth changes (ours).

    Args:
      window: how many recent transfers count (32: about two to four
        iterations of a ResNet-sized model, so a change shows within a few
        iterations while one slow transfer moves the estimate by ~3%).
    """

    def __init__(self, window: int = 32):
        if window < 1:
            raise ValueError(f"window must be >= 1. Received: window={window!r}")
        # (start_ns, end_ns, nbytes) of the last ``window`` transfers, in the
        # order they finished (not started: a later push may end first).
        self._samples: collections.deque[tuple[int, int, int]] = collections.deque(maxlen=window)

    def add(self, nbytes: int, start_ns: int, end_ns: int) -> None:
        """Records a finished transfer of ``nbytes`` that ran from start to end."""
        self._samples.append((start_ns, end_ns if end_ns > start_ns else start_ns, nbytes))

    @property
    def samples(self) -> int:
        """How many transfers the estimate is based on (at most ``window``)."""
        return len(self._samples)

    @property
    def bytes_per_ns(self) -> float | None:
        """The estimate in bytes per ns (= GB/s), or None before any busy time."""
        busy, covered_to = 0, None
        for start, end, _ in sorted(self._samples):
            if covered_to is None or start >= covered_to:
                busy += end - start
                covered_to = end
            elif end > covered_to:
                busy += end - covered_to
                covered_to = end
        nbytes = sum(n for _, _, n in self._samples)
        if busy <= 0 or nbytes <= 0:
            return None
        return nbytes / busy


def drifted(value: float, reference: float, threshold: float = DRIFT_THRESHOLD,
            floor: float = 0.0) -> bool:
    """True when ``value`` differs from ``reference`` by more than
    ``threshold``·|reference| and by more than ``floor`` (an absolute
    tolerance for references near zero, e.g. timer jitter)."""
    diff = abs(value - reference)
    return diff > threshold * abs(reference) and diff > floor


class DriftDetector:
    """Flags when the median of the last ``window`` observations drifts.

    The median over a few iterations ignores a single outlier (a garbage
    collection, a checkpoint) but follows a lasting change within ``window``
    iterations.

    Args:
      reference: the plan's value.
      threshold: relative tolerance (default 20%).
      window: observations the median is taken over.
      floor: absolute tolerance, as in :func:`drifted`.
    """

    def __init__(self, reference: float, threshold: float = DRIFT_THRESHOLD, window: int = 3,
                 floor: float = 0.0):
        if window < 1:
            raise ValueError(f"window must be >= 1. Received: window={window!r}")
        self.reference = reference
        self.threshold = threshold
        self.floor = floor
        self._recent: collections.deque[float] = collections.deque(maxlen=window)

    def observe(self, value: float) -> bool:
        """Records one observation; True once the window is full and its
        median has drifted from the reference."""
        self._recent.append(value)
        if len(self._recent) < self._recent.maxlen:
            return False
        return drifted(statistics.median(self._recent), self.reference, self.threshold,
                       self.floor)
