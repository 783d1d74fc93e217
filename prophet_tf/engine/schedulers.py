"""Gradient schedulers: which ready partitions to send next, grouped how.

A scheduler sees sizes, priorities and times, never tensors, and never reads a
clock: every time is an argument (ns of the clock of ``ReadyItem.ready_ns``,
i.e. ``time.monotonic_ns()`` in the engine, or virtual time in a simulator).
So the same code runs in the engine, in tests and in a discrete-event
simulator. Schedulers are not thread-safe.

Engine contract:

1. ``s = make_scheduler(name, **options)``; cut every variable into
   partitions of at most ``s.partition_bytes or DEFAULT_PARTITION_BYTES``
   bytes (whole rows; ``sharding.plan(specs, num_ps, that)``). The PS tasks
   must be started with the same ``max_partition_bytes``.
2. Hold one lock around every call to ``s``.
3. When the gradient of variable ``key`` for training step ``step`` is ready,
   call :meth:`Scheduler.add` once per partition (partition order), all of
   them before the next ``next_block``; then drain: ``while block :=
   s.next_block(now_ns): sender[block[0].ps_index].put(block)``.
4. Each sender pushes its blocks in the order received, each block as one
   PushRequest. Around the RPC it takes ``start_ns`` (just before) and
   ``end_ns`` (just after it returned), then, under the lock, calls
   ``s.on_sent(block, start_ns, end_ns)`` with the block it was given and
   drains as in 3.
5. To flush (end of training, evaluation, checkpoint): ``s.flush()``, drain,
   then wait for the senders; Prophet may otherwise hold gradients back for
   a step that a partial iteration will never complete.
6. ``s.plan()`` at any time: a JSON-serializable dict for the timeline.

A block is a non-empty list of items of ONE link (``ps_index``), sent as one
transfer, of at most :data:`MAX_BLOCK_BYTES` unless it is a single partition.
"""
from __future__ import annotations

import abc
import collections
import dataclasses
import heapq
import logging
import numbers
from typing import ClassVar, Sequence

from prophet_tf.engine import profiler

__all__ = ["ReadyItem", "urgency", "Scheduler", "FifoScheduler", "P3Scheduler", "ByteScheduler",
           "ProphetScheduler", "SCHEDULERS", "DEFAULT_PARTITION_BYTES", "MAX_BLOCK_BYTES",
           "make_scheduler", "validate_scheduler", "parse_scheduler"]

logger = logging.getLogger(__name__)

#: Partition size when a scheduler has no preference; equals
#: ``prophet_tf.ps.sharding.DEFAULT_MAX_PARTITION_BYTES`` (why 4 MiB: see there).
DEFAULT_PARTITION_BYTES = 4 * 1024 * 1024

#: Largest block of several items: half the PS message limit (64 MiB), which
#: leaves ample room for the per-chunk headers (< 64 bytes each).
MAX_BLOCK_BYTES = 32 * 1024 * 1024


@dataclasses.dataclass(frozen=True, slots=True)
class ReadyItem:
    """One partition of one gradient, ready to send.

    Partitions of one gradient share ``key``, ``step``, ``priority`` and
    ``ready_ns``; ``(key, partition, step)`` identifies an item.

    Attributes:
      key: the variable's PS key.
      partition: index of the row range (``sharding.Partition.partition``).
      ps_index: the PS task, i.e. the link the item goes over.
      step: the training step (iteration) the gradient belongs to.
      priority: forward position of the variable; 0 is the most urgent.
      nbytes: size of this partition.
      ready_ns: when the gradient became ready.
    """

    key: int
    partition: int
    ps_index: int
    step: int
    priority: int
    nbytes: int
    ready_ns: int


def urgency(item: ReadyItem) -> tuple[int, int, int, int]:
    """The order priority schedulers send in: older step, then lower priority
    (forward position), then key and partition (a total order)."""
    return item.step, item.priority, item.key, item.partition


class Scheduler(abc.ABC):
    """Decides the order and grouping of gradient transfers (see the module
    docstring for when the engine calls what)."""

    name: ClassVar[str] = ""
    #: Valid options and their defaults.
    OPTIONS: ClassVar[dict[str, int]] = {}

    @property
    def partition_bytes(self) -> int | None:
        """Partition size this scheduler wants; None means the default."""
        return None

    @abc.abstractmethod
    def add(self, item: ReadyItem) -> None:
        """A partition became ready."""

    @abc.abstractmethod
    def next_block(self, now_ns: int) -> list[ReadyItem]:
        """The next transfer to start at ``now_ns``, or [] when none should.

        The returned items count as in flight until :meth:`on_sent`.
        """

    def on_sent(self, block: Sequence[ReadyItem], start_ns: int, end_ns: int) -> None:
        """A block returned by :meth:`next_block` was sent, from start to end."""

    def flush(self) -> None:
        """Send everything that is ready, without waiting for a plan's moment."""

    @property
    @abc.abstractmethod
    def pending(self) -> int:
        """Items added and not yet returned by :meth:`next_block`."""

    def plan(self) -> dict:
        """The current plan, JSON-serializable (for the timeline)."""
        return {"scheduler": self.name}


class FifoScheduler(Scheduler):
    """A plain parameter server: each gradient in the order it became ready.

    All partitions of one gradient on one link form one block (split at
    :data:`MAX_BLOCK_BYTES`); every block is released at once, with no
    window, so a link sends them back to back in readiness order.
    """

    name = "fifo"

    def __init__(self):
        self._groups: collections.deque[list[ReadyItem]] = collections.deque()
        self._open: dict[tuple[int, int, int], list[ReadyItem]] = {}
        self._pending = 0

    def add(self, item: ReadyItem) -> None:
        gid = (item.step, item.key, item.ps_index)
        group = self._open.get(gid)
        if group is None:
            group = self._open[gid] = []
            self._groups.append(group)
        group.append(item)
        self._pending += 1

    def next_block(self, now_ns: int) -> list[ReadyItem]:
        if not self._groups:
            return []
        group = self._groups.popleft()
        first = group[0]
        gid = (first.step, first.key, first.ps_index)
        if self._open.get(gid) is group:
            del self._open[gid]
        total, cut = 0, 0
        for cut, item in enumerate(group):
            total += item.nbytes
            if total > MAX_BLOCK_BYTES and cut:
                self._groups.appendleft(group[cut:])
                group = group[:cut]
                break
        self._pending -= len(group)
        return group

    @property
    def pending(self) -> int:
        return self._pending


class _PriorityScheduler(Scheduler):
    """Per-link heaps of ready items in :func:`urgency` order, and what each
    link has in flight."""

    def __init__(self):
        self._ready: dict[int, list] = {}
        self._inflight: dict[int, int] = {}  # bytes
        self._blocks: dict[int, int] = {}  # transfers
        self._pending = 0

    def add(self, item: ReadyItem) -> None:
        heap = self._ready.get(item.ps_index)
        if heap is None:
            heap = self._ready[item.ps_index] = []
            self._inflight[item.ps_index] = self._blocks[item.ps_index] = 0
        heapq.heappush(heap, (item.step, item.priority, item.key, item.partition, item))
        self._pending += 1

    def _start(self, link: int, block: list[ReadyItem], nbytes: int) -> list[ReadyItem]:
        self._inflight[link] += nbytes
        self._blocks[link] += 1
        self._pending -= len(block)
        return block

    def on_sent(self, block: Sequence[ReadyItem], start_ns: int, end_ns: int) -> None:
        if block:
            link = block[0].ps_index
            self._inflight[link] -= sum(item.nbytes for item in block)
            self._blocks[link] -= 1

    @property
    def pending(self) -> int:
        return self._pending


class P3Scheduler(_PriorityScheduler):
    """P3: small fixed slices, always the most urgent ready slice next.

    Each block is one slice (one partition: the engine cuts variables into
    slices of ``slice_bytes``). Default 200,000 bytes: P3 (Jayarajan et al.,
    "Priority-based Parameter Propagation for Distributed DNN Training",
    SysML 2019) used slices of 50,000 parameters, i.e. 200,000 bytes of
    float32. At most :attr:`SLICES_IN_FLIGHT` = 2 slices are in flight per
    link: one on the wire and one queued behind it, so the link does not idle
    between RPCs (P3's ZeroMQ sends were asynchronous too), while a newly
    ready urgent slice waits behind at most two slices.

    Args:
      slice_bytes: slice size in bytes.
    """

    name = "p3"
    OPTIONS = {"slice_bytes": 200_000}
    SLICES_IN_FLIGHT = 2

    def __init__(self, slice_bytes: int = 200_000):
        super().__init__()
        self.slice_bytes = slice_bytes

    @property
    def partition_bytes(self) -> int:
        return self.slice_bytes

    def next_block(self, now_ns: int) -> list[ReadyItem]:
        for link, heap in self._ready.items():
            if heap and self._blocks[link] < self.SLICES_IN_FLIGHT:
                item = heapq.heappop(heap)[-1]
                return self._start(link, [item], item.nbytes)
        return []

    def plan(self) -> dict:
        return {"scheduler": self.name, "slice_bytes": self.slice_bytes,
                "slices_in_flight": self.SLICES_IN_FLIGHT}


class ByteScheduler(_PriorityScheduler):
    """ByteScheduler: partitions in priority order under a credit window.

    Each block is one partition, the most urgent ready one, started when the
    link's bytes in flight plus the partition fit in ``credit_bytes`` (or the
    link is idle, so a partition larger than the credit still goes).
    Preemption happens only between partitions.

    Defaults (Peng et al., "A Generic Communication Scheduler for Distributed
    DNN Training Acceleration", SOSP 2019; bytescheduler/common/bytecore.py):
    ``partition_bytes`` = 4,096,000 (BytePS's ``BYTEPS_PARTITION_BYTES``;
    ByteScheduler's own default was 1,000,000 float32 parameters = 4,000,000
    bytes), and ``credit_bytes`` = 4 partitions, ByteScheduler's default
    ``BYTESCHEDULER_CREDIT`` (4,000,000 parameters = 4 of its partitions).
    ByteScheduler then auto-tunes the credit by Bayesian optimisation; here it
    stays fixed (a knob). Differences: the credit is per link (ByteScheduler's
    is per worker; with one PS they agree), and a partition starts only if it
    fits the remaining credit (ByteScheduler starts one while any credit is
    left, so may overshoot by up to a partition).

    Args:
      partition_bytes: partition size in bytes.
      credit_bytes: bytes in flight per link; default 4 * partition_bytes.
    """

    name = "bytescheduler"
    OPTIONS = {"partition_bytes": 4_096_000, "credit_bytes": 4 * 4_096_000}
    CREDIT_PARTITIONS = 4

    def __init__(self, partition_bytes: int = 4_096_000, credit_bytes: int | None = None):
        super().__init__()
        self._partition_bytes = partition_bytes
        self.credit_bytes = (credit_bytes if credit_bytes is not None
                             else self.CREDIT_PARTITIONS * partition_bytes)

    @property
    def partition_bytes(self) -> int:
        return self._partition_bytes

    def next_block(self, now_ns: int) -> list[ReadyItem]:
        for link, heap in self._ready.items():
            if heap:
                inflight = self._inflight[link]
                item = heap[0][-1]
                if inflight == 0 or inflight + item.nbytes <= self.credit_bytes:
                    heapq.heappop(heap)
                    return self._start(link, [item], item.nbytes)
        return []

    def plan(self) -> dict:
        return {"scheduler": self.name, "partition_bytes": self._partition_bytes,
                "credit_bytes": self.credit_bytes}


@dataclasses.dataclass
class _Plan:
    version: int
    reason: str
    steps: list[profiler.Step]
    bandwidth: dict[int, float]  # link -> bytes per ns
    step_of_key: dict[int, int]
    parts_per_step: list[int]
    final_key: int
    final_key_parts: int
    span_ns: int  # predicted time from the first step's arrival to the last's


class ProphetScheduler(_PriorityScheduler):
    """Prophet (Zhang et al., ICPP 2021): blocks sized to the predicted idle gaps.

    Profile: iterations (``ReadyItem.step``) are told apart by their step
    number; an iteration ends when the first gradient of a later one arrives.
    The first :attr:`WARMUP_ITERATIONS` = 2 are skipped (the first runs
    tf.function tracing, the second still warms allocators and caches); the
    next :attr:`PROFILE_ITERATIONS` = 5 are profiled (an odd count, so the
    medians are observed values and one outlier cannot move them).
    :func:`profiler.find_steps` turns them into steps with their gaps Δt_j,
    and the plan takes each link's bandwidth B from its
    :class:`profiler.BandwidthEstimator`. Nothing depends on the model.

    Until the first plan exists, the scheduler sends by priority (as below in
    the last step): ByteScheduler-like, without its knobs.

    With a plan, in each iteration:

    - Step j has *arrived* when all partitions of all its keys are ready (a
      later step arriving first counts too). Its deadline is its arrival's
      readiness time plus Δt_j: when step j+1 is predicted to arrive.
    - While step j is the latest arrived, a link may start a block of its
      ready-and-unsent items in urgency order: the longest prefix whose bytes
      fit B·(deadline - now) minus what the link has in flight (at most
      :attr:`BLOCK_BYTES`). At step j's arrival that is B·Δt_j, and at
      least one item goes, so the scheduler never stalls; later in the gap
      (after a block finished early, or as more items become ready) further
      blocks go only if they fit the time left, except that an idle link
      takes the next item alone when at least half of it fits (ours: its end
      is then nearer the next step's arrival than the link's idling would be;
      without it, the ResNet-50 of benchmarks/bench_scheduler.py at 3 Gbit/s
      left its link idle 38 ms per iteration, 323 ms instead of 295 ms).
    - Last step (the last step arrived, or the most urgent gradient of the
      plan - priority 0 - is fully ready), gradients of older iterations, and
      after :meth:`flush`: strictly by urgency, blocks of at most
      :attr:`BLOCK_BYTES`, at most two blocks' bytes in flight per
      link (one on the wire, one queued: the link never waits for the
      scheduler, and the PS can apply the first layers while the rest follow).

    Priority rule: every block is a prefix of its link's ready-and-unsent
    items in :func:`urgency` order. So, once a step has arrived, no transfer
    of a less urgent gradient starts while a more urgent one is ready and
    unsent on that link; the only exception is a more urgent gradient that
    becomes ready while the block planned for the current idle gap is in
    flight: it waits for that block, which was sized to end when it arrives.

    Drift (ours; no knobs): each iteration's step arrivals are compared with
    the plan. If the median over the last 3 iterations of the time from the
    first step's arrival to the last's differs by more than 20% (and 1 ms)
    from the plan's, the next 5 iterations are profiled again (the old plan
    stays in use meanwhile) and a new plan is made. If a link's bandwidth
    estimate differs by more than 20% from the plan's at the end of an
    iteration, the plan is remade at once with the new bandwidths. Every new
    plan is logged at INFO.
    """

    name = "prophet"
    #: Partition size and largest block (ours). A block is one RPC, and the PS
    #: can apply and send back none of it before all of it has arrived, so
    #: bounded blocks let the pull of the first parts overlap the push of the
    #: rest. 512 KiB was the best bound across the simulated models
    #: (`prophet-tf simulate`: the bench CNN, ResNet-50, VGG16, InceptionV3);
    #: 4 MiB blocks left the bench CNN at FIFO's speed.
    BLOCK_BYTES = 512 * 1024
    WARMUP_ITERATIONS = 2
    PROFILE_ITERATIONS = 5
    DRIFT_WINDOW = 3
    DRIFT_FLOOR_NS = 1_000_000
    BLOCKS_IN_FLIGHT = 2

    def __init__(self):
        super().__init__()
        self._bw: dict[int, profiler.BandwidthEstimator] = {}
        self._priority_of: dict[int, int] = {}
        self._iter: int | None = None
        self._iters_closed = 0
        self._times: dict[int, int] = {}
        self._parts: dict[int, int] = {}
        self._bytes: dict[int, int] = {}
        self._key_parts: dict[int, int] = {}  # latest complete iteration's, per key
        self._key_bytes: dict[int, int] = {}
        self._profile: list[dict[int, int]] | None = []
        self._profile_from = self.WARMUP_ITERATIONS
        self._profile_reason = "initial profile"
        self._plan: _Plan | None = None
        self._compute_drift: profiler.DriftDetector | None = None
        self._flushing = False
        self._reset_iteration()

    # -- readiness and profiling ------------------------------------------------------

    def add(self, item: ReadyItem) -> None:
        if self._iter is None or item.step > self._iter:
            self._new_iteration(item.step)
        super().add(item)
        if item.step != self._iter:
            return  # a straggler of an older iteration: sent by urgency
        key = item.key
        if key in self._parts:
            self._parts[key] += 1
            self._bytes[key] += item.nbytes
        else:
            self._times[key] = item.ready_ns
            self._parts[key] = 1
            self._bytes[key] = item.nbytes
            self._priority_of.setdefault(key, item.priority)
        plan = self._plan
        if plan is None:
            return
        j = plan.step_of_key.get(key)
        if j is not None:
            self._remaining[j] -= 1
            if self._remaining[j] == 0:
                self._arrive(j, item.ready_ns)
        if key == plan.final_key:
            self._final_left -= 1
            if self._final_left == 0:
                self._final = True

    def _arrive(self, j: int, ready_ns: int) -> None:
        self._arrivals[j] = ready_ns
        if j > self._arrived:
            self._arrived = j
            self._deadline = ready_ns + self._plan.steps[j].gap_ns
            self._arrival_sent.clear()
            if j == len(self._plan.steps) - 1:
                self._final = True

    def _reset_iteration(self) -> None:
        plan = self._plan
        self._arrived = -1
        self._deadline = 0
        self._arrival_sent: set[int] = set()
        self._final = False
        self._remaining = list(plan.parts_per_step) if plan else []
        self._arrivals: list[int | None] = [None] * len(self._remaining)
        self._final_left = plan.final_key_parts if plan else 0

    def _new_iteration(self, step: int) -> None:
        if self._iter is not None:
            self._close_iteration()
        self._iter = step
        self._times, self._parts, self._bytes = {}, {}, {}
        self._reset_iteration()

    def _close_iteration(self) -> None:
        index = self._iters_closed
        self._iters_closed += 1
        self._key_parts.update(self._parts)
        self._key_bytes.update(self._bytes)
        if self._profile is not None:
            if index >= self._profile_from and self._times:
                self._profile.append(self._times)
                if len(self._profile) == self.PROFILE_ITERATIONS:
                    steps = profiler.find_steps(self._profile, self._key_bytes)
                    self._profile = None
                    self._make_plan(self._profile_reason, steps)
                    return
        elif self._plan is not None and all(a is not None for a in self._arrivals):
            span = self._arrivals[-1] - self._arrivals[0]
            if self._compute_drift.observe(span):
                self._profile, self._profile_from = [], self._iters_closed
                self._profile_reason = (f"compute drift: steps took {span / 1e6:.3g} ms, "
                                        f"plan {self._plan.span_ns / 1e6:.3g} ms")
        plan = self._plan
        if plan is not None:
            for link, estimator in self._bw.items():
                now = estimator.bytes_per_ns
                ref = plan.bandwidth.get(link)
                if now is not None and (ref is None or profiler.drifted(now, ref)):
                    was = "unknown" if ref is None else f"{ref * 1e3:.4g}"
                    self._make_plan(f"bandwidth drift: link {link} {was} -> "
                                    f"{now * 1e3:.4g} MB/s", plan.steps)
                    return

    def _make_plan(self, reason: str, steps: list[profiler.Step]) -> None:
        parts = self._key_parts
        step_of_key = {k: j for j, s in enumerate(steps) for k in s.keys}
        final_key = min(step_of_key, key=lambda k: (self._priority_of.get(k, 0), k))
        bandwidth = {link: b for link, e in self._bw.items() if (b := e.bytes_per_ns)}
        self._plan = _Plan(
            version=(self._plan.version + 1) if self._plan else 1, reason=reason, steps=steps,
            bandwidth=bandwidth, step_of_key=step_of_key,
            parts_per_step=[sum(parts.get(k, 1) for k in s.keys) for s in steps],
            final_key=final_key, final_key_parts=parts.get(final_key, 1),
            span_ns=sum(s.gap_ns for s in steps))
        self._compute_drift = profiler.DriftDetector(
            self._plan.span_ns, window=self.DRIFT_WINDOW, floor=self.DRIFT_FLOOR_NS)
        logger.info("prophet plan %d (%s): %d steps, gaps [%s] ms, bandwidth {%s} MB/s, "
                    "gap budgets {%s} bytes", self._plan.version, reason, len(steps),
                    ", ".join(f"{s.gap_ns / 1e6:.3g}" for s in steps),
                    ", ".join(f"{link}: {b * 1e3:.4g}" for link, b in sorted(bandwidth.items())),
                    ", ".join(f"{link}: {[int(b * s.gap_ns) for s in steps[:-1]]}"
                              for link, b in sorted(bandwidth.items())))

    # -- sending ----------------------------------------------------------------------

    def next_block(self, now_ns: int) -> list[ReadyItem]:
        plan = self._plan
        for link, heap in self._ready.items():
            if not heap:
                continue
            by_urgency = (plan is None or self._final or self._flushing
                          or heap[0][-1].step < self._iter)
            if by_urgency:
                block = self._urgent_block(link, heap)
            elif self._arrived >= 0:
                block = self._gap_block(link, heap, now_ns)
            else:
                continue
            if block:
                return block
        if self._flushing and not self._pending:
            self._flushing = False
        return []

    @property
    def partition_bytes(self) -> int:
        return self.BLOCK_BYTES

    def _urgent_block(self, link: int, heap: list) -> list[ReadyItem] | None:
        inflight = self._inflight[link]
        room = self.BLOCKS_IN_FLIGHT * self.BLOCK_BYTES - inflight
        first = heap[0][-1]
        if inflight and first.nbytes > room:
            return None
        limit = min(self.BLOCK_BYTES, room) if inflight else self.BLOCK_BYTES
        # With a plan in force, only older iterations' leftovers go this way.
        older_only = self._plan is not None and not self._final and not self._flushing
        heapq.heappop(heap)
        block, total = [first], first.nbytes
        while heap:
            item = heap[0][-1]
            if total + item.nbytes > limit or (older_only and item.step >= self._iter):
                break
            heapq.heappop(heap)
            block.append(item)
            total += item.nbytes
        return self._start(link, block, total)

    def _gap_block(self, link: int, heap: list, now_ns: int) -> list[ReadyItem] | None:
        bandwidth = self._plan.bandwidth.get(link)
        budget = 0.0 if bandwidth is None else min(
            bandwidth * (self._deadline - now_ns) - self._inflight[link], self.BLOCK_BYTES)
        block, total = [], 0
        while heap and total + heap[0][-1].nbytes <= budget:
            item = heapq.heappop(heap)[-1]
            block.append(item)
            total += item.nbytes
        if not block:
            # Alone, one item may overrun the budget: at the step's arrival (so
            # nothing stalls), and on an idle link when at least half of it fits
            # (its end is then nearer the deadline than leaving the link idle).
            arrival = link not in self._arrival_sent
            if not arrival and (self._inflight[link] or heap[0][-1].nbytes > 2 * budget):
                return None
            item = heapq.heappop(heap)[-1]
            block, total = [item], item.nbytes
        self._arrival_sent.add(link)
        return self._start(link, block, total)

    def on_sent(self, block: Sequence[ReadyItem], start_ns: int, end_ns: int) -> None:
        if not block:
            return
        super().on_sent(block, start_ns, end_ns)
        link = block[0].ps_index
        estimator = self._bw.get(link)
        if estimator is None:
            estimator = self._bw[link] = profiler.BandwidthEstimator()
        estimator.add(sum(item.nbytes for item in block), start_ns, end_ns)

    def flush(self) -> None:
        self._flushing = self._pending > 0

    # -- introspection ----------------------------------------------------------------

    @property
    def current_plan(self) -> _Plan | None:
        """The plan in force (None while first profiling)."""
        return self._plan

    def budget(self, link: int, now_ns: int) -> float | None:
        """Bytes a gap block on ``link`` may carry at ``now_ns``, or None when
        no step of the current iteration has arrived or the last step has."""
        plan = self._plan
        if plan is None or self._final or self._arrived < 0 or link not in plan.bandwidth:
            return None
        return plan.bandwidth[link] * (self._deadline - now_ns) - self._inflight.get(link, 0)

    def plan(self) -> dict:
        plan = self._plan
        state = {"scheduler": self.name, "iteration": self._iter,
                 "profiling": self._profile is not None,
                 "warmup_iterations": self.WARMUP_ITERATIONS,
                 "profile_iterations": self.PROFILE_ITERATIONS}
        if plan is None:
            return {**state, "version": 0, "steps": []}
        return {
            **state, "version": plan.version, "reason": plan.reason,
            "bandwidth_bytes_per_s": {str(link): b * 1e9 for link, b in plan.bandwidth.items()},
            "steps": [{"keys": sorted(s.keys), "start_ns": s.start_ns, "arrive_ns": s.arrive_ns,
                       "gap_ns": s.gap_ns, "nbytes": s.nbytes,
                       "budget_bytes": {str(link): int(b * s.gap_ns)
                                        for link, b in plan.bandwidth.items()}}
                      for s in plan.steps],
            "current": {"step": self._arrived, "final": self._final,
                        "deadline_ns": self._deadline if self._arrived >= 0 else None},
        }


SCHEDULERS: dict[str, type[Scheduler]] = {
    cls.name: cls for cls in (FifoScheduler, P3Scheduler, ByteScheduler, ProphetScheduler)}


def validate_scheduler(name: str, **options) -> str:
    """Checks a scheduler name and its options.

    Args:
      name: one of :data:`SCHEDULERS`.
      **options: the scheduler's options (see each class); positive ints, or
        None for the default.

    Returns:
      ``name``.

    Raises:
      ValueError: unknown name or option, or a value that is not a positive
        int; the message lists the valid names or options.
    """
    if not isinstance(name, str) or name not in SCHEDULERS:
        raise ValueError(f"Unknown scheduler; valid schedulers: {', '.join(SCHEDULERS)}. "
                         f"Received: scheduler={name!r}")
    valid = SCHEDULERS[name].OPTIONS
    for option, value in options.items():
        if option not in valid:
            listed = ", ".join(valid) if valid else "none"
            raise ValueError(f"Unknown option for scheduler {name!r}; valid options: {listed}. "
                             f"Received: {option}={value!r}")
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(f"Option {option} of scheduler {name!r} must be an int (bytes). "
                             f"Received: {option}={value!r}")
        if value <= 0:
            raise ValueError(f"Option {option} of scheduler {name!r} must be positive. "
                             f"Received: {option}={value!r}")
    return name


def make_scheduler(name: str, **options) -> Scheduler:
    """A new scheduler ``name`` with ``options`` (validated as in
    :func:`validate_scheduler`; None means the default)."""
    validate_scheduler(name, **options)
    return SCHEDULERS[name](**{k: int(v) for k, v in options.items() if v is not None})


def parse_scheduler(spec: str) -> tuple[str, dict[str, int]]:
    """Parses ``"name"`` or ``"name:option=value,option=value"`` (e.g. the
    value of PROPHET_TF_SCHEDULER) and validates it.

    Raises:
      ValueError: malformed, or as :func:`validate_scheduler`.
    """
    name, _, rest = spec.strip().partition(":")
    options = {}
    for field in filter(None, (f.strip() for f in rest.split(","))):
        option, sep, value = field.partition("=")
        try:
            if not sep:
                raise ValueError
            options[option.strip()] = int(value.strip().replace("_", ""), 0)
        except ValueError:
            raise ValueError(f"Scheduler options must read option=int, e.g. "
                             f"'bytescheduler:credit_bytes=8000000'. Received: {spec!r}") from None
    validate_scheduler(name.strip(), **options)
    return name.strip(), options
