"""Prophet: blocks sized to the predicted idle gaps between bursts of gradients."""
from __future__ import annotations

import dataclasses
import heapq
import logging
from typing import Sequence

from prophet_tf.engine.schedulers import profiler
from prophet_tf.engine.schedulers.base import DEFAULT_PARTITION_BYTES, PriorityScheduler, ReadyItem

__all__ = ["ProphetScheduler"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Plan:
    version: int
    reason: str
    bursts: list[profiler.Burst]
    bandwidth: dict[int, float]  # link -> bytes per ns
    burst_of_key: dict[int, int]
    parts_per_burst: list[int]
    final_key: int
    final_key_parts: int
    span_ns: int  # predicted time from the first burst's arrival to the last's


class ProphetScheduler(PriorityScheduler):
    """Prophet (Zhang et al., ICPP 2021): blocks sized to the predicted idle gaps.

    Profile: iterations are told apart by ``ReadyItem.iteration`` (the training
    iteration); an iteration ends when the first gradient of a later one arrives.
    The first :attr:`WARMUP_ITERATIONS` = 2 are skipped (the first runs
    tf.function tracing, the second still warms allocators and caches); the
    next :attr:`PROFILE_ITERATIONS` = 5 are profiled (an odd count, so the
    medians are observed values and one outlier cannot move them).
    :func:`profiler.find_bursts` turns them into bursts with their gaps Δt_j,
    and the plan takes each link's bandwidth B from its
    :class:`profiler.BandwidthEstimator`. Nothing depends on the model.

    Until the first plan exists, the scheduler sends by priority (as below in
    the last burst): ByteScheduler-like, without its knobs.

    With a plan, in each iteration:

    - Burst j has *arrived* when all partitions of all its keys are ready (a
      later burst arriving first counts too). Its deadline is its arrival's
      readiness time plus Δt_j: when burst j+1 is predicted to arrive.
    - While burst j is the latest arrived, a link may start a block of its
      ready-and-unsent items in urgency order: the longest prefix whose bytes
      fit B·(deadline - now) minus what the link has in flight (at most
      :attr:`BLOCK_BYTES`). At burst j's arrival that is B·Δt_j, and at
      least one item goes, so the scheduler never stalls; later in the gap
      (after a block finished early, or as more items become ready) further
      blocks go only if they fit the time left, except that an idle link
      always takes the most urgent item alone (ours: a link never idles while
      an item waits for it; idling cannot make the item end sooner). Before
      the first burst of an iteration has arrived, an idle link likewise
      takes the most urgent ready item.
    - Last burst (the last burst arrived, or the most urgent gradient of the
      plan - priority 0 - is fully ready), a plan of a single burst,
      gradients of older iterations, and after :meth:`flush`: strictly by
      urgency, blocks of at most
      :attr:`BLOCK_BYTES` that fit the window (the link never waits for the
      scheduler, and the PS can apply the first layers while the rest follow).

    Window: :attr:`BLOCKS_IN_FLIGHT` = 2 blocks and as many BLOCK_BYTES per
    link, one block from :attr:`SHARED_LINK_WORKERS` workers when the PS
    tasks have hosts of their own (option ``blocks_in_flight``); a gap block
    must also fit its gap budget, which counts the bytes already in flight.
    A block holds its place in the window until the PS has answered, so a
    link stays busy only if the window covers what it carries during one
    answer's delay (the PS's work, the answer queued behind the other
    direction's traffic): on a fast link more blocks in flight pay; on a
    slow one they gain little, and an urgent block may wait behind every
    byte in flight (measured in the README, "The in-flight window").

    Priority rule: every block is a prefix of its link's ready-and-unsent
    items in :func:`urgency` order. So, once a burst has arrived, no transfer
    of a less urgent gradient starts while a more urgent one is ready and
    unsent on that link; the only exception is a more urgent gradient that
    becomes ready while the block planned for the current idle gap is in
    flight: it waits for that block, which was sized to end when it arrives.

    Drift (ours; no knobs): each iteration's burst arrivals are compared with
    the plan. If the median over the last 3 iterations of the time from the
    first burst's arrival to the last's differs by more than 20% (and 1 ms)
    from the plan's, the next 5 iterations are profiled again (the old plan
    stays in use meanwhile) and a new plan is made. If a link's bandwidth
    estimate differs by more than 20% from the plan's at the end of an
    iteration, the plan is remade at once with the new bandwidths. Every new
    plan is logged at INFO.
    """

    name = "prophet"
    #: Largest block (ours). A block is one RPC, and the PS can apply and send
    #: back none of it before all of it has arrived, so bounded blocks let the
    #: pull of the first parts overlap the push of the rest. 512 KiB was the
    #: best bound across the simulated models (`prophet-tf simulate`: the
    #: bench CNN, ResNet-50, VGG16, InceptionV3); 4 MiB blocks left the bench
    #: CNN at FIFO's speed.
    BLOCK_BYTES = 512 * 1024
    #: Smallest partition (ours): P3's slice. A PS answers a pull in one
    #: stream, a partition at a time, so an urgent parameter waits behind at
    #: most one partition on the wire; with 512 KiB partitions the bench CNN's
    #: last parameter arrived 16-25 ms after its last push, against 2-5 ms for
    #: P3's 200 KB slices. Measured (`prophet-tf bench`, 3 runs each, CNN, 2
    #: workers, 200 Mbit/s): 230.2 -> 220.0 ms with real compute, 222.1 ->
    #: 205.4 ms with emulated compute (40 ms); blocks keep their 512 KiB bound.
    PARTITION_BYTES = 200_000
    #: Partitions per PS task's share of the model, when the model is large
    #: enough: every message has a fixed cost at its ends, so a larger model
    #: gets larger partitions rather than more of them, while each partition
    #: stays a fortieth of what a PS link carries per step (the wait an urgent
    #: pull may have behind one, relative to the step). Simulated on ResNet-50
    #: (docs/records/2026-12-06-partition-size-by-share.md): 200 KB
    #: partitions cost 1.31-1.61x the ideal bound with one PS task from 2.5
    #: Gbit/s; a fortieth of the share (2.5 MB), 1.01-1.23x.
    PARTITIONS_PER_PS = 40
    WARMUP_ITERATIONS = 2
    PROFILE_ITERATIONS = 5
    #: Iterations before the first plan is in force (warm-up, profile, the one
    #: that plans): what the bench and the simulator leave out of step times.
    ITERATIONS_BEFORE_PLAN = WARMUP_ITERATIONS + PROFILE_ITERATIONS + 1
    DRIFT_WINDOW = 3
    DRIFT_FLOOR_NS = 1_000_000
    #: The default window: two blocks in flight per link (one on the wire, one
    #: queued behind it), of at most BLOCK_BYTES each unless one item is larger.
    BLOCKS_IN_FLIGHT = 2
    #: From this many workers, with the PS tasks on hosts of their own, one
    #: block in flight per link by default: every worker pushes to every PS
    #: link, the others' blocks keep it busy while one worker's answer is on
    #: its way back, and a second block of each only queues ahead of the
    #: others' more urgent ones. Simulated on ResNet-50
    #: (docs/records/2026-12-06-window-by-workers.md): dedicated PS hosts, 128
    #: workers 1.29-1.31x the ideal bound with two blocks, 1.17-1.18x with
    #: one, 16-64 workers 0.00-0.07 closer, up to 8 the same; a PS task on
    #: every worker host, one block was 0.02-0.08 slower at 64 workers at 1, 5
    #: and 10 Gbit/s, so there two blocks stay.
    SHARED_LINK_WORKERS = 16
    #: ``partition_bytes``: the partition size the workers declare (None: a
    #: fortieth of a PS task's share, from 200 KB to 4 MiB). ``blocks_in_flight``
    #: (None: BLOCKS_IN_FLIGHT, one from SHARED_LINK_WORKERS workers on hosts
    #: without a PS task).
    OPTIONS = {"partition_bytes": None, "blocks_in_flight": None}

    def __init__(self, partition_bytes: int | None = None,
                 blocks_in_flight: int | None = None):
        super().__init__()
        self._partition_bytes = partition_bytes
        self._blocks_option = blocks_in_flight
        # The window (base class) in blocks and bytes, until size_window.
        self._set_window(blocks_in_flight or self.BLOCKS_IN_FLIGHT)
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

    # A new iteration (and with it a new plan), a burst's arrival and the final
    # burst change every link's answer: each wakes every link.

    def add(self, item: ReadyItem) -> None:
        if self._iter is None or item.iteration > self._iter:
            self._new_iteration(item.iteration)
        super().add(item)
        if item.iteration != self._iter:
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
        j = plan.burst_of_key.get(key)
        if j is not None:
            self._remaining[j] -= 1
            if self._remaining[j] == 0:
                self._arrive(j, item.ready_ns)
        if key == plan.final_key:
            self._final_left -= 1
            if self._final_left == 0:
                self._final = True
                self._active.wake_all()

    def _arrive(self, j: int, ready_ns: int) -> None:
        self._arrivals[j] = ready_ns
        if j > self._arrived:
            self._arrived = j
            self._deadline = ready_ns + self._plan.bursts[j].gap_ns
            self._arrival_sent.clear()
            if j == len(self._plan.bursts) - 1:
                self._final = True
            self._active.wake_all()

    def _reset_iteration(self) -> None:
        plan = self._plan
        self._arrived = -1
        self._deadline = 0
        self._arrival_sent: set[int] = set()
        self._final = False
        self._remaining = list(plan.parts_per_burst) if plan else []
        self._arrivals: list[int | None] = [None] * len(self._remaining)
        self._final_left = plan.final_key_parts if plan else 0

    def _new_iteration(self, iteration: int) -> None:
        if self._iter is not None:
            self._close_iteration()
        self._iter = iteration
        self._times, self._parts, self._bytes = {}, {}, {}
        self._reset_iteration()
        self._active.wake_all()

    def _close_iteration(self) -> None:
        index = self._iters_closed
        self._iters_closed += 1
        self._key_parts.update(self._parts)
        self._key_bytes.update(self._bytes)
        if self._profile is not None:
            if index >= self._profile_from and self._times:
                self._profile.append(self._times)
                if len(self._profile) == self.PROFILE_ITERATIONS:
                    bursts = profiler.find_bursts(self._profile, self._key_bytes)
                    self._profile = None
                    self._make_plan(self._profile_reason, bursts)
                    return
        elif self._plan is not None and all(a is not None for a in self._arrivals):
            span = self._arrivals[-1] - self._arrivals[0]
            if self._compute_drift.observe(span):
                self._profile, self._profile_from = [], self._iters_closed
                self._profile_reason = (f"compute drift: bursts took {span / 1e6:.3g} ms, "
                                        f"plan {self._plan.span_ns / 1e6:.3g} ms")
        plan = self._plan
        if plan is not None:
            for link, estimator in self._bw.items():
                now = estimator.bytes_per_ns
                ref = plan.bandwidth.get(link)
                if now is not None and (ref is None or profiler.drifted(now, ref)):
                    was = "unknown" if ref is None else f"{ref * 1e3:.4g}"
                    self._make_plan(f"bandwidth drift: link {link} {was} -> "
                                    f"{now * 1e3:.4g} MB/s", plan.bursts)
                    return

    def _make_plan(self, reason: str, bursts: list[profiler.Burst]) -> None:
        parts = self._key_parts
        burst_of_key = {k: j for j, b in enumerate(bursts) for k in b.keys}
        final_key = min(burst_of_key, key=lambda k: (self._priority_of.get(k, 0), k))
        bandwidth = {link: b for link, e in self._bw.items() if (b := e.bytes_per_ns)}
        self._plan = _Plan(
            version=(self._plan.version + 1) if self._plan else 1, reason=reason, bursts=bursts,
            bandwidth=bandwidth, burst_of_key=burst_of_key,
            parts_per_burst=[sum(parts.get(k, 1) for k in b.keys) for b in bursts],
            final_key=final_key, final_key_parts=parts.get(final_key, 1),
            span_ns=sum(b.gap_ns for b in bursts))
        self._compute_drift = profiler.DriftDetector(
            self._plan.span_ns, window=self.DRIFT_WINDOW, floor=self.DRIFT_FLOOR_NS)
        logger.info("prophet plan %d (%s): %d bursts, gaps [%s] ms, bandwidth {%s} MB/s, "
                    "gap budgets {%s} bytes", self._plan.version, reason, len(bursts),
                    ", ".join(f"{b.gap_ns / 1e6:.3g}" for b in bursts),
                    ", ".join(f"{link}: {b * 1e3:.4g}" for link, b in sorted(bandwidth.items())),
                    ", ".join(f"{link}: {[int(bw * b.gap_ns) for b in bursts[:-1]]}"
                              for link, bw in sorted(bandwidth.items())))

    # -- sending ----------------------------------------------------------------------

    def _select(self, now_ns: int) -> list[ReadyItem]:
        plan, windows, active = self._plan, self.windows, self._active
        for link in active:
            heap = self._ready[link]
            if not heap or not windows[link].open:
                active.sleep(link)  # nothing to send until an add or a sent block
                continue
            by_urgency = (plan is None or self._final or self._flushing
                          or len(plan.bursts) == 1 or heap[0][-1].iteration < self._iter)
            if by_urgency:
                block = self._urgent_block(link, heap)
            elif self._arrived >= 0:
                block = self._gap_block(link, heap, now_ns)
            elif not self.windows[link].blocks:
                block = self._idle_link_block(heap)  # before the first burst
            else:
                block = None
            if block:
                return block
            # No block: none until an add or a sent block of this link, a burst's
            # arrival, a new iteration or plan (each wakes every link), or a flush.
            # Time alone changes nothing: a gap budget only shrinks as time passes.
            active.sleep(link)
        if self._flushing and not self._pending:
            self._flushing = False
            active.wake_all()
        return []

    @property
    def partition_bytes(self) -> int | None:
        """The partition size given as an option; None: by the model's size."""
        return self._partition_bytes

    def _set_window(self, blocks: int) -> None:
        self.blocks_in_flight = self.window_blocks = blocks
        self.window_bytes = blocks * self.BLOCK_BYTES

    def size_window(self, num_workers: int, ps_on_host: bool = True) -> None:
        """The option, else :data:`BLOCKS_IN_FLIGHT` blocks, one from
        :data:`SHARED_LINK_WORKERS` workers on a host without a PS task."""
        if self._blocks_option is None:
            one = num_workers >= self.SHARED_LINK_WORKERS and not ps_on_host
            self._set_window(1 if one else self.BLOCKS_IN_FLIGHT)

    def partition_bytes_for(self, model_bytes: int, num_ps: int) -> int:
        """The option, else a :data:`PARTITIONS_PER_PS`-th of a PS task's share,
        at least :data:`PARTITION_BYTES` and at most the default partition size."""
        if self._partition_bytes is not None:
            return self._partition_bytes
        share = model_bytes // (num_ps * self.PARTITIONS_PER_PS)
        return min(max(share, self.PARTITION_BYTES), DEFAULT_PARTITION_BYTES)

    def _urgent_block(self, link: int, heap: list) -> list[ReadyItem] | None:
        window = self.windows[link]
        first = heap[0][-1]
        if not window.fits(first.nbytes):
            return None
        limit = min(self.BLOCK_BYTES, window.room_bytes) if window.blocks else self.BLOCK_BYTES
        # With a plan in force, only older iterations' leftovers go this way.
        older_only = self._plan is not None and not self._final and not self._flushing
        heapq.heappop(heap)
        block, total = [first], first.nbytes
        while heap:
            item = heap[0][-1]
            if total + item.nbytes > limit or (older_only and item.iteration >= self._iter):
                break
            heapq.heappop(heap)
            block.append(item)
            total += item.nbytes
        return self._start(block)

    def _gap_block(self, link: int, heap: list, now_ns: int) -> list[ReadyItem] | None:
        # The gap budget is the plan's, on top of the window: bytes that end by
        # the deadline, counting what the link already has in flight.
        window = self.windows[link]
        inflight = window.nbytes
        bandwidth = self._plan.bandwidth.get(link)
        budget = 0.0 if bandwidth is None else min(
            bandwidth * (self._deadline - now_ns) - inflight, self.BLOCK_BYTES,
            window.room_bytes if window.blocks else self.BLOCK_BYTES)
        block, total = [], 0
        while heap and total + heap[0][-1].nbytes <= budget:
            item = heapq.heappop(heap)[-1]
            block.append(item)
            total += item.nbytes
        if not block:
            # Alone, one item may overrun the budget: at the burst's arrival (so
            # nothing stalls), and on an idle link (an idle link gains nothing
            # from waiting: the item would only start later).
            arrival = link not in self._arrival_sent
            if not arrival and inflight:
                return None
            if not window.fits(heap[0][-1].nbytes):
                return None
            block = [heapq.heappop(heap)[-1]]
        self._arrival_sent.add(link)
        return self._start(block)

    def _idle_link_block(self, heap: list) -> list[ReadyItem]:
        """The most urgent ready item, alone: a link is never left idle while
        items wait, not even before the first burst has fully arrived."""
        return self._start([heapq.heappop(heap)[-1]])

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
        self._active.wake_all()

    # -- introspection ----------------------------------------------------------------

    def plan(self) -> dict:
        """The plan for the timeline. Its keys are the timeline's format, read
        by ``prophet-tf plot``: "bursts" lists the bursts and "current.burst" is
        the latest arrived burst (-1: none yet)."""
        plan = self._plan
        state = {"scheduler": self.name, "iteration": self._iter,
                 "profiling": self._profile is not None,
                 "warmup_iterations": self.WARMUP_ITERATIONS,
                 "profile_iterations": self.PROFILE_ITERATIONS}
        if plan is None:
            return {**state, "version": 0, "bursts": []}
        return {
            **state, "version": plan.version, "reason": plan.reason,
            "bandwidth_bytes_per_s": {str(link): b * 1e9 for link, b in plan.bandwidth.items()},
            "bursts": [{"keys": sorted(b.keys), "start_ns": b.start_ns, "arrive_ns": b.arrive_ns,
                        "gap_ns": b.gap_ns, "nbytes": b.nbytes,
                        "budget_bytes": {str(link): int(bw * b.gap_ns)
                                         for link, bw in plan.bandwidth.items()}}
                       for b in plan.bursts],
            "current": {"burst": self._arrived, "final": self._final,
                        "deadline_ns": self._deadline if self._arrived >= 0 else None},
        }
