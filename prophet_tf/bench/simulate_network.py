"""The simulator's network: virtual time, and links shared by fluid flows.

- :class:`FluidSim`: the event queue of :mod:`prophet_tf.bench.simulate`,
  and the flows crossing its links. The two are one object because a flow's
  end is an event that moves whenever another flow starts or ends on a link
  it shares.
- :func:`fluid_sim`: a ``FluidSim``, or with a rate lag its compiled equal
  (:mod:`prophet_tf.bench.simulate_compiled`, the same results to the bit).
- the max-min fair rates of its flows: :mod:`prophet_tf.bench.simulate_max_min`;
  the links of a cluster layout: :mod:`prophet_tf.bench.simulate_links`; the
  queue's order of events: :mod:`prophet_tf.bench.simulate_events`.

What keeps it fast at many workers: a colocated run with one PS per host
has about 1.5 W² flows in flight (nearly every sender and receiver pair has
one) and a flow start or end every few microseconds of virtual time, and
each recomputation of the max-min rates is a progressive filling over the
W² pairs. Following every change at once (``rate_lag_s=0``), the results
are the same to the last bit as recomputing every flow's rate at every start
and end (the tests compare the two paths):

- The flows' bytes left and rates are numpy arrays: advancing time, the next
  flow end and the flows done are a few array operations, the same float
  operations per flow as a loop over them.
- Flows of one path and weight (with even sharing: of one sender and
  receiver) form a class: max-min fairness gives them one rate, so the
  progressive filling goes over classes, not flows.
- The rates are recomputed lazily: a flow's start or end only marks them
  stale, and they are brought up to date before virtual time moves on (or
  before an event that a flow's end at this very instant would precede), so
  the flows that start and end at one instant cost one recomputation. The
  flow-end event keeps the place in the queue it had when it was computed at
  each change (its sequence number is taken then), so events run in the
  same order as with an eager recomputation.

That still costs a filling per instant with a change: at 8 workers half the
run, at 16 workers 255 s for four schedulers. So the rates may follow the
changes late, by up to ``rate_lag_s`` (``simulate.DEFAULT_RATE_LAG_S``,
0.2 ms): an approximation, as TCP takes round trips to settle on a new
share, not an instant. A start or end recomputes the rates at once (after
the last event of its instant) if they are at least ``rate_lag_s`` old, else
``rate_lag_s`` after they were computed, so there is at most one filling per
lag, and a network with a change now and then is computed as without a lag.
In between:

- the flows in flight keep their rates; their ends were put in order when
  the rates were computed (only those due before the next computation), so
  a flow's end costs no array operation;
- a computation fills links, not classes (:mod:`prophet_tf.bench.simulate_rate_lag`):
  per pair of links the weight of the flows crossing both, a round of array
  operations per distinct level (at 64 colocated workers 0.7 ms instead of
  2.5 ms over 4,000 classes), the same rates but for float rounding;
- a new flow takes what its links have spare (the capacity of flows ended
  since; none: it waits for the next computation), so no link ever carries
  more than its capacity, and a flow on idle links runs at full rate at once;
- what the lag costs is capacity left idle after a flow ends (until the next
  computation): the predictions move by 0.5% at most on the validation runs
  (bench-colocated-2026-12-05, -w3, -100mbit: 2 and 3 hosts at 100-200
  Mbit/s, answers-first and host-queue runs of 4 hosts at 3 Gbit/s), and
  resnet50 on 8 hosts at 2 Gbit/s predicts 0.2-0.6% slower with a 0.1 ms
  lag, 0.5-0.7% with 0.2 ms, 0.9-1.5% with 0.3 ms, 1.3-2.6% with 1 ms.

Fitting ``share_sigma`` to measured links is
:mod:`prophet_tf.bench.simulate_flow_share`.
"""
from __future__ import annotations

import functools
import heapq
import logging
import math
import random
from typing import Callable

import numpy as np

from prophet_tf.bench import simulate_max_min as max_min
from prophet_tf.bench.simulate_events import EventQueue
from prophet_tf.bench.simulate_rate_lag import RateLag, finite_ids, weight_and_route

__all__ = ["FluidSim", "fluid_sim"]

logger = logging.getLogger(__name__)

#: A flow with at most this many bytes left is done (float rounding).
_DONE_BYTES = 1e-3


class _Class:
    """The flows in flight of one path (link ids) and weight: one rate for all."""

    __slots__ = ("links", "weight", "key", "index", "count", "generation")

    def __init__(self, links: tuple, weight: float, key, index: int):
        self.links, self.weight, self.key, self.index = links, weight, key, index
        self.count = 0
        self.generation = 0  # the rate computation that fixed its rate


class _Flow:
    """A flow in flight; its bytes left and rate live in the simulator's arrays."""

    __slots__ = ("sim", "slot", "seq", "links", "ids", "done", "weight", "cls")

    def __init__(self, sim: "FluidSim", slot: int, seq: int, links: tuple, ids: tuple,
                 done: Callable[[], None], weight: float):
        self.sim, self.slot, self.seq, self.links, self.ids = sim, slot, seq, links, ids
        self.done, self.weight = done, weight
        self.cls = None  # its class, without a rate lag

    @property
    def rate(self) -> float:
        return float(self.sim._rate[self.slot])

    @property
    def remaining(self) -> float:
        return float(self.sim._remaining[self.slot])


def fluid_sim(capacity: dict, share_sigma: float = 0.0, seed: int = 0,
              rate_lag_s: float = 0.0, compiled: bool = True):
    """A :class:`FluidSim`; with a rate lag and ``compiled``, its compiled
    equal (:mod:`prophet_tf.bench.simulate_compiled`: the same results to the
    bit), or where that was not built (no Python headers at install) the
    Python path, with a warning once."""
    compiled_type = _compiled_type() if compiled and rate_lag_s else None
    if compiled_type is not None:
        return compiled_type(capacity, share_sigma, seed, rate_lag_s)
    return FluidSim(capacity, share_sigma, seed, rate_lag_s=rate_lag_s)


@functools.cache  # once per process: a sweep makes many networks
def _compiled_type():
    """``CompiledFluidSim``, or None (warned) where it was not built."""
    try:
        from prophet_tf.bench.simulate_compiled import CompiledFluidSim
    except ImportError as e:
        logger.warning("%s; simulating with the Python path (the same results, slower)", e)
        return None
    return CompiledFluidSim


class FluidSim(EventQueue, RateLag):
    """Event queue plus a fluid network of weighted max-min fair flows.

    Each flow's weight is 1, or with ``share_sigma`` > 0 drawn from a
    log-normal distribution (median 1, that sigma of its log) when it
    starts: TCP connections through a shaped link take turns rather than
    share it evenly (``benchmarks/flow_share.py`` measures how unevenly).

    ``classes=False`` gives every flow a class of its own and recomputes the
    rates at every flow's start and end: the straightforward path, which the
    tests compare the default with.

    ``rate_lag_s`` > 0: the rates react to flows' starts and ends up to that
    late (see the module docstring; :mod:`prophet_tf.bench.simulate_rate_lag`),
    and a path crosses at most two links that limit it (a sender's and a
    receiver's); 0 recomputes them at every instant something changed.
    """

    def __init__(self, capacity: dict, share_sigma: float = 0.0, seed: int = 0,
                 classes: bool = True, rate_lag_s: float = 0.0):
        if not (isinstance(rate_lag_s, (int, float)) and 0 <= rate_lag_s < math.inf):
            raise ValueError(f"rate_lag_s must be a finite number >= 0. "
                             f"Received: rate_lag_s={rate_lag_s!r}")
        if rate_lag_s and not classes:
            raise ValueError("classes=False is the straightforward path, every rate "
                             "recomputed at every change: it takes no rate_lag_s")
        super().__init__()
        self.share_sigma = share_sigma
        self.rate_lag_s = rate_lag_s
        self._random = random.Random(seed)
        self.capacity = capacity  # link -> bytes/s (math.inf = unlimited)
        self._grouped = classes
        # Links by id: the rates are computed over lists, not dicts. Id 0 is
        # no link (the second of a path with one, with a rate lag).
        self._link_id: dict = {}
        self._link_capacity: list[float] = [math.inf]
        self._link_flows: list[list] = [[]]  # per link, heap of (start, place in path, flow)
        self._on_link: list[dict] = [{}]  # per link, its classes in flight in start order
        self._link_count: list[int] = [0]  # per link, its flows in flight
        self._generation = 0
        self._path_ids: dict[tuple, tuple | None] = {}  # None: no finite link on it
        self._max_capacity = 0.0  # the fastest finite link: no flow is faster
        self._classes: dict = {}  # key -> _Class with flows in flight, in start order
        self._class_free: list[int] = []
        self._class_rate = [1.0]  # by class index; 0 is no class's
        # Per flow slot: bytes left and rate (a free slot: inf bytes at rate
        # 1, or 0 with a rate lag: never done and never next), its class (or
        # with a rate lag its weight, 0 when free, and its links) and flow.
        self._remaining = np.full(0, math.inf)
        self._rate = np.ones(0)
        self._class_of = np.zeros(0, dtype=np.intp)
        self._weight = np.zeros(0)
        self._first = self._second = np.zeros(0, dtype=np.int64)  # max_min.rates' links
        self._flow_at: list = []
        self._free: list[int] = []
        self._slots_used = 0  # past the last slot in use (rate lag), or more
        self._flow_seq = 0
        self._last = 0.0
        self._epoch = 0
        self._stale = False  # the rates are not those of the flows in flight
        self._end_seq = 0  # the queue place of the flow-end event of the latest change
        self._soon = False  # a flow may end at this instant (few bytes left)
        # Rate lag: the bytes left are of _last, the time of the latest rate
        # computation; a flow started since runs at the capacity its links had
        # spare, and ends in _late; the others end in _ends.
        self._refill_at = None  # when the rates are due (None: up to date)
        self._spare: list[float] = [math.inf]  # per link: capacity no flow had at _last
        self._capacity_array = np.zeros(0)  # _link_capacity, as of the latest computation
        # The flows in flight at _last that end before the next computation
        # (or the first to end), by end: times, slots, the next one's place.
        self._end_times: list[float] = []
        self._end_slots: list[int] = []
        self._end_next = 0
        self._late: list[tuple] = []  # heap of (end, seq, slot) of flows started since
        # The pending flow-end event (rate lag): its unclamped time, and its
        # time and place in the queue; it is not in the queue (see RateLag).
        self._end_at = math.inf
        self._end_time, self._end_place = math.inf, 0

    # -- events -------------------------------------------------------------------------

    def run(self, until: Callable[[], bool] | tuple[list, int]) -> None:
        """Runs events until ``until()`` is true, or with ``(items, count)``
        until the list ``items`` holds ``count`` items; or none are left."""
        if isinstance(until, tuple):
            items, count = until
            until = lambda: len(items) >= count  # noqa: E731
        if self.rate_lag_s:
            self._lagged_run(until)
            return
        while not until():
            if self._stale and self._due():
                self._update()
            fn = self._pop_event()
            if fn is None:
                return
            fn()

    def _due(self) -> bool:
        """Whether the rates must be brought up to date before the next event:
        time moves on, or the flow-end event may come first at this instant
        (an event queued after the change, while a flow is about to end)."""
        head = self._next_event()
        if head is None:
            return True
        t, seq = head
        return t > self.now or (seq > self._end_seq and self._soon)

    # -- flows --------------------------------------------------------------------------

    @property
    def flows(self) -> list[_Flow]:
        """The flows in flight, in the order they started, at their current rates."""
        if self._stale:
            self._update()
        return sorted((f for f in self._flow_at if f is not None), key=lambda f: f.seq)

    def route(self, links: tuple) -> tuple | None:
        """The ids of the links of a path that limit it (None: none does), for
        :meth:`start_flow`: a caller that keeps them saves looking them up."""
        ids = self._path_ids.get(links, False)
        if ids is False:
            ids = self._path_ids[links] = self._ids(links)
        return ids

    def start_flow(self, nbytes: float, links: tuple, done: Callable[[], None],
                   ids: tuple | None | bool = False) -> None:
        """A flow of ``nbytes`` over ``links`` (whose :meth:`route` is ``ids``, or
        looked up if False); ``done`` runs when its last byte is in."""
        lag = self.rate_lag_s
        if not lag:
            self._advance()
        started = weight_and_route(self, nbytes, links, done, ids)
        if started is None:
            return
        weight, ids = started
        self._flow_seq += 1
        if not self._free:
            self._grow()
        slot = self._free.pop()
        if slot >= self._slots_used:
            self._slots_used = slot + 1
        flow = self._flow_at[slot] = _Flow(self, slot, self._flow_seq, links, ids, done, weight)
        if lag:
            self._lagged_start(flow, nbytes)  # sets its bytes left
            return
        self._remaining[slot] = float(nbytes)
        # Only flows of weight 1 share a class: then a class's weight sums are
        # whole numbers, exact however they are added up.
        key = ids if self._grouped and weight == 1.0 else -self._flow_seq
        cls = self._classes.get(key)
        if cls is None:
            cls = self._classes[key] = _Class(ids, weight, key, self._class_index())
            for link in ids:
                self._on_link[link][cls] = None
        flow.cls = cls
        self._class_of[slot] = cls.index
        for place, link in enumerate(ids):
            heapq.heappush(self._link_flows[link], (flow.seq, place, flow))
            self._link_count[link] += 1
        cls.count += 1
        self._changed()

    def _ids(self, links: tuple):
        """The ids of a path's links (with a rate lag: of those that limit it);
        None if none of them limits it."""
        if self.rate_lag_s:
            return finite_ids(links, self.capacity, self._link_id, self._new_link)
        if all(math.isinf(self.capacity[l]) for l in links):
            return None
        for link in links:
            if link not in self._link_id:
                self._link_id[link] = self._new_link(link)
        return tuple(self._link_id[link] for link in links)

    def _new_link(self, link) -> int:
        """Makes room for a link met for the first time; returns its id."""
        capacity = self.capacity[link]
        self._link_capacity.append(capacity)
        self._spare.append(capacity)
        self._link_flows.append([])
        self._on_link.append({})
        self._link_count.append(0)
        if not math.isinf(capacity):
            self._max_capacity = max(self._max_capacity, capacity)
        return len(self._link_capacity) - 1

    def _class_index(self) -> int:
        if not self._class_free:
            n = len(self._class_rate)
            self._class_rate += [1.0] * n
            self._class_free = list(range(2 * n - 1, n - 1, -1))
        return self._class_free.pop()

    def _grow(self) -> None:
        n = len(self._remaining)
        grow = max(n, 64)
        self._remaining = np.concatenate([self._remaining, np.full(grow, math.inf)])
        self._rate = np.concatenate([self._rate, np.ones(grow)])
        self._class_of = np.concatenate([self._class_of, np.zeros(grow, dtype=np.intp)])
        self._weight = np.concatenate([self._weight, np.zeros(grow)])
        self._first = np.concatenate([self._first, np.zeros(grow, dtype=np.int64)])
        self._second = np.concatenate([self._second, np.zeros(grow, dtype=np.int64)])
        self._flow_at += [None] * grow
        self._free = list(range(n + grow - 1, n - 1, -1))

    def _changed(self) -> None:
        """Flows started or ended: the flow-end event takes its queue place now."""
        self._epoch += 1
        self._seq += 1
        self._end_seq = self._seq
        self._stale = True
        if not self._grouped:
            self._update()

    def _advance(self) -> None:
        dt = self.now - self._last
        if dt > 0:
            if self._stale:  # changed at _last, time moved on outside run()
                self._update()
            remaining = self._remaining
            remaining -= self._rate * dt
            # Could a flow end within float rounding of now? Then the
            # flow-end event's place among this instant's events matters.
            self._soon = False
            if self._classes:
                least = max(float(remaining.min()), 0.0)
                self._soon = not self.now + least / self._max_capacity > self.now
        self._last = self.now

    def _update(self) -> None:
        """Max-min fair rates for the flows in flight, and the next flow end."""
        self._stale = False
        if not self._classes:
            return
        self._fill()
        self._rate = rate = np.array(self._class_rate)[self._class_of]
        last = self._last  # the time the bytes left are of
        t = float((last + np.maximum(self._remaining, 0.0) / rate).min())
        epoch = self._epoch
        heapq.heappush(self._events, (max(t, self.now), self._end_seq,
                                      lambda: self._finish(epoch)))

    def _fill(self) -> None:
        self._generation += 1
        max_min.fill(self._link_capacity, self._link_count, self._on_link, self._link_flows,
                     self._class_rate, self._generation, weighted=bool(self.share_sigma))

    def _finish(self, epoch: int) -> None:
        if epoch != self._epoch:
            return
        self._advance()
        remaining = self._remaining
        slots = np.flatnonzero(remaining <= _DONE_BYTES).tolist()
        if not slots:  # rounding: finish the nearest one (the first started of ties)
            slots = np.flatnonzero(remaining == remaining.min()).tolist()
            slots = [min(slots, key=lambda s: self._flow_at[s].seq)]
        done = sorted((self._flow_at[s] for s in slots), key=lambda f: f.seq)
        for f in done:
            self._remove(f)
        self._changed()
        for f in done:
            f.done()

    def _remove(self, f: _Flow) -> None:
        slot = f.slot
        self._remaining[slot] = math.inf
        self._flow_at[slot] = None
        self._free.append(slot)
        f.slot = -1
        if self.rate_lag_s:
            self._rate[slot] = self._weight[slot] = 0.0
            return
        self._rate[slot] = 1.0
        self._class_of[slot] = 0
        cls = f.cls
        cls.count -= 1
        for link in cls.links:
            self._link_count[link] -= 1
        if not cls.count:
            del self._classes[cls.key]
            for link in cls.links:
                del self._on_link[link][cls]
            self._class_free.append(cls.index)
