"""The simulator's network: virtual time, and links shared by fluid flows.

- :class:`FluidSim`: the event queue of :mod:`prophet_tf.bench.simulate`,
  and the flows crossing its links. The two are one object because a flow's
  end is an event that moves whenever another flow starts or ends on a link
  it shares.
- :class:`ClusterLinks`: the links of a cluster layout, their capacities,
  and which of them each push and pull crosses.

What keeps it fast at many workers (a colocated run has about W² flows in
flight and W² flow starts and ends per step), with the very arithmetic of
recomputing every flow's rate at every start and end, so the results are
the same to the last bit (the tests compare the two paths):

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

Fitting ``share_sigma`` to measured links is
:mod:`prophet_tf.bench.simulate_flow_share`.
"""
from __future__ import annotations

import heapq
import math
import random
from typing import Callable

import numpy as np

__all__ = ["FluidSim", "ClusterLinks"]

#: A flow with at most this many bytes left is done (float rounding).
_DONE_BYTES = 1e-3


class _Class:
    """The flows in flight of one path (link ids) and weight: one rate for all."""

    __slots__ = ("links", "weight", "key", "index", "count", "rate", "generation")

    def __init__(self, links: tuple, weight: float, key, index: int):
        self.links, self.weight, self.key, self.index = links, weight, key, index
        self.count = 0
        self.rate = 0.0
        self.generation = 0  # the rate computation that fixed its rate


class _Flow:
    """A flow in flight; its bytes left and rate live in the simulator's arrays."""

    __slots__ = ("sim", "slot", "seq", "links", "done", "weight", "cls")

    def __init__(self, sim: "FluidSim", slot: int, seq: int, links: tuple,
                 done: Callable[[], None], weight: float, cls: _Class):
        self.sim, self.slot, self.seq, self.links = sim, slot, seq, links
        self.done, self.weight, self.cls = done, weight, cls

    @property
    def rate(self) -> float:
        return float(self.sim._rate[self.slot])

    @property
    def remaining(self) -> float:
        return float(self.sim._remaining[self.slot])


class FluidSim:
    """Event queue plus a fluid network of weighted max-min fair flows.

    Each flow's weight is 1, or with ``share_sigma`` > 0 drawn from a
    log-normal distribution (median 1, that sigma of its log) when it
    starts: TCP connections through a shaped link take turns rather than
    share it evenly (``benchmarks/flow_share.py`` measures how unevenly).

    ``classes=False`` gives every flow a class of its own and recomputes the
    rates at every flow's start and end: the straightforward path, which the
    tests compare the default with.
    """

    def __init__(self, capacity: dict, share_sigma: float = 0.0, seed: int = 0,
                 classes: bool = True):
        self.share_sigma = share_sigma
        self._random = random.Random(seed)
        self.now = 0.0
        self._events: list = []
        self._seq = 0
        self.capacity = capacity  # link -> bytes/s (math.inf = unlimited)
        self._grouped = classes
        # Links by id: the rates are computed over lists, not dicts.
        self._link_id: dict = {}
        self._link_capacity: list[float] = []
        self._link_flows: list[list] = []  # per link, heap of (start, place in path, flow)
        self._on_link: list[dict] = []  # per link, its classes in flight in start order
        self._link_count: list[int] = []  # per link, its flows in flight
        self._generation = 0
        self._path_ids: dict[tuple, tuple | None] = {}  # None: no finite link on it
        self._max_capacity = 0.0  # the fastest finite link: no flow is faster
        self._classes: dict = {}  # key -> _Class with flows in flight, in start order
        self._class_free: list[int] = []
        self._class_rate = np.ones(1)  # by class index; 0 is no class's
        # Per flow slot: bytes left and rate (a free slot: inf bytes at rate
        # 1, never done and never next), its class and flow.
        self._remaining = np.full(0, math.inf)
        self._rate = np.ones(0)
        self._class_of = np.zeros(0, dtype=np.intp)
        self._flow_at: list = []
        self._free: list[int] = []
        self._flow_seq = 0
        self._last = 0.0
        self._epoch = 0
        self._stale = False  # the rates are not those of the flows in flight
        self._end_seq = 0  # the queue place of the flow-end event of the latest change
        self._soon = False  # a flow may end at this instant (few bytes left)

    # -- events -------------------------------------------------------------------------

    def at(self, t: float, fn: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._events, (max(t, self.now), self._seq, fn))

    def run(self, until: Callable[[], bool]) -> None:
        events = self._events
        while not until():
            if self._stale and self._due(events):
                self._update()
            if not events:
                return
            t, _, fn = heapq.heappop(events)
            self.now = t
            fn()

    def _due(self, events: list) -> bool:
        """Whether the rates must be brought up to date before the next event:
        time moves on, or the flow-end event may come first at this instant
        (an event queued after the change, while a flow is about to end)."""
        if not events:
            return True
        t, seq, _ = events[0]
        return t > self.now or (seq > self._end_seq and self._soon)

    # -- flows --------------------------------------------------------------------------

    @property
    def flows(self) -> list[_Flow]:
        """The flows in flight, in the order they started, at their current rates."""
        if self._stale:
            self._update()
        return sorted((f for f in self._flow_at if f is not None), key=lambda f: f.seq)

    def start_flow(self, nbytes: float, links: tuple, done: Callable[[], None]) -> None:
        self._advance()
        weight = math.exp(self._random.gauss(0.0, self.share_sigma)) if self.share_sigma else 1.0
        ids = self._path_ids.get(links, False)
        if ids is False:
            ids = self._path_ids[links] = self._ids(links)
        if nbytes <= 0 or ids is None:
            self.at(self.now, done)
            return
        self._flow_seq += 1
        # Only flows of weight 1 share a class: then a class's weight sums are
        # whole numbers, exact however they are added up.
        key = ids if self._grouped and weight == 1.0 else -self._flow_seq
        cls = self._classes.get(key)
        if cls is None:
            cls = self._classes[key] = _Class(ids, weight, key, self._class_index())
            for link in ids:
                self._on_link[link][cls] = None
        if not self._free:
            self._grow()
        slot = self._free.pop()
        flow = self._flow_at[slot] = _Flow(self, slot, self._flow_seq, links, done, weight, cls)
        self._remaining[slot] = float(nbytes)
        self._class_of[slot] = cls.index
        for place, link in enumerate(ids):
            heapq.heappush(self._link_flows[link], (flow.seq, place, flow))
            self._link_count[link] += 1
        cls.count += 1
        self._changed()

    def _ids(self, links: tuple):
        """The ids of a path's links; None if none of them limits it."""
        if all(math.isinf(self.capacity[l]) for l in links):
            return None
        ids = []
        for link in links:
            if link not in self._link_id:
                self._link_id[link] = len(self._link_capacity)
                self._link_capacity.append(self.capacity[link])
                self._link_flows.append([])
                self._on_link.append({})
                self._link_count.append(0)
                if not math.isinf(self.capacity[link]):
                    self._max_capacity = max(self._max_capacity, self.capacity[link])
            ids.append(self._link_id[link])
        return tuple(ids)

    def _class_index(self) -> int:
        if not self._class_free:
            n = len(self._class_rate)
            self._class_rate = np.concatenate([self._class_rate, np.ones(n)])
            self._class_free = list(range(2 * n - 1, n - 1, -1))
        return self._class_free.pop()

    def _grow(self) -> None:
        n = len(self._remaining)
        grow = max(n, 64)
        self._remaining = np.concatenate([self._remaining, np.full(grow, math.inf)])
        self._rate = np.concatenate([self._rate, np.ones(grow)])
        self._class_of = np.concatenate([self._class_of, np.zeros(grow, dtype=np.intp)])
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
        class_rate = self._class_rate
        for c in self._classes.values():
            class_rate[c.index] = c.rate
        self._rate = rate = class_rate[self._class_of]
        last = self._last  # the time the bytes left are of
        t = float((last + np.maximum(self._remaining, 0.0) / rate).min())
        epoch = self._epoch
        heapq.heappush(self._events, (max(t, self.now), self._end_seq,
                                      lambda: self._finish(epoch)))

    def _fill(self) -> None:
        # Progressive filling: the most constrained link (least capacity left
        # per unit of unfixed weight) fixes its flows' rates, in proportion to
        # their weights. Fixing flows at the least share only raises every other
        # link's share, so a heap whose stale entries are too low (pushed again
        # when popped) finds each next link: O(classes x their links), not
        # O(classes x links). Per class, the same float operations as per flow
        # (its flows' rates are taken from each link one by one), and links of
        # equal share go in the order the oldest flow on them started.
        self._generation += 1
        generation = self._generation
        left = list(self._link_capacity)
        unfixed = list(self._link_count)
        on = self._on_link
        if self.share_sigma:  # summed in start order, as flow by flow
            weight = [0.0] * len(left)
            for link, classes in enumerate(on):
                w = 0.0
                for c in classes:
                    w += c.count * c.weight
                weight[link] = w
        else:  # every weight 1: the sums are whole numbers
            weight = [float(n) for n in unfixed]
        heads = self._link_flows
        heap = []
        for link, n in enumerate(unfixed):
            if n:
                flows = heads[link]
                while flows[0][2].slot < 0:  # ended
                    heapq.heappop(flows)
                heap.append((left[link] / weight[link], flows[0][:2], link))
        heapq.heapify(heap)
        while heap:
            share, order, link = heapq.heappop(heap)
            if not unfixed[link]:
                continue
            current = left[link] / weight[link]
            if current > share:
                heapq.heappush(heap, (current, order, link))
                continue
            for c in on[link]:
                if c.generation == generation:  # fixed
                    continue
                c.generation = generation
                c.rate = rate = current * c.weight
                count, w = c.count, c.count * c.weight
                for l in c.links:
                    if count == 1:
                        left[l] -= rate
                    else:  # as many subtractions as flows: the same rounding
                        x = left[l]
                        for _ in range(count):
                            x -= rate
                        left[l] = x
                    weight[l] -= w
                    unfixed[l] -= count

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
            slot = f.slot
            remaining[slot] = math.inf
            self._rate[slot] = 1.0
            self._class_of[slot] = 0
            self._flow_at[slot] = None
            self._free.append(slot)
            f.slot = -1
            cls = f.cls
            cls.count -= 1
            for link in cls.links:
                self._link_count[link] -= 1
            if not cls.count:
                del self._classes[cls.key]
                for link in cls.links:
                    del self._on_link[link][cls]
                self._class_free.append(cls.index)
        self._changed()
        for f in done:
            f.done()


class ClusterLinks:
    """The links each message crosses, by layout (see :mod:`prophet_tf.bench.simulate`).

    dedicated: PS hosts of their own; one worker is simulated and PS p's link
    carries the W workers' identical flows, so it gets 1/W of it.
    colocated: PS p lives on worker host ``p % W``; every worker is simulated
    (the placement need not be symmetric), and each host has one link each
    way. A message between two hosts crosses the sender's uplink and the
    receiver's downlink; one within a host crosses none.
    """

    def __init__(self, layout: str, workers: int, num_ps: int, bytes_per_s: float):
        self.layout, self.workers = layout, workers
        #: Workers simulated: all of them when colocated, else one by symmetry.
        self.simulated = workers if layout == "colocated" else 1
        self.capacity = {}
        for w in range(self.simulated):
            self.capacity["w", w, "up"] = self.capacity["w", w, "down"] = bytes_per_s
        if layout == "dedicated":
            for ps in range(num_ps):
                self.capacity["ps", ps, "up"] = bytes_per_s / workers
                self.capacity["ps", ps, "down"] = bytes_per_s / workers

    def local_ps(self, worker: int, num_ps: int) -> list[int]:
        """The PS tasks on ``worker``'s host (none in the dedicated layout)."""
        if self.layout == "dedicated":
            return []
        return [ps for ps in range(num_ps) if ps % self.workers == worker]

    def push_links(self, worker: int, ps: int) -> tuple:
        if self.layout == "dedicated":
            return (("w", worker, "up"), ("ps", ps, "down"))
        host = ps % self.workers
        return () if host == worker else (("w", worker, "up"), ("w", host, "down"))

    def pull_links(self, worker: int, ps: int) -> tuple:
        if self.layout == "dedicated":
            return (("ps", ps, "up"), ("w", worker, "down"))
        host = ps % self.workers
        return () if host == worker else (("w", host, "up"), ("w", worker, "down"))
