"""The simulator's network: virtual time, and links shared by fluid flows.

- :class:`FluidSim`: the event queue of :mod:`prophet_tf.bench.simulate`,
  and the flows crossing its links. The two are one object because a flow's
  end is an event that moves whenever another flow starts or ends on a link
  it shares.
- :class:`ClusterLinks`: the links of a cluster layout, their capacities,
  and which of them each push and pull crosses.

Fitting ``share_sigma`` to measured links is
:mod:`prophet_tf.bench.simulate_flow_share`.
"""
from __future__ import annotations

import heapq
import math
import random
from typing import Callable

__all__ = ["FluidSim", "ClusterLinks"]


class _Flow:
    __slots__ = ("remaining", "links", "rate", "done", "weight")

    def __init__(self, nbytes: float, links: tuple, done: Callable[[], None], weight: float):
        self.remaining = float(nbytes)
        self.links = links
        self.rate = 0.0
        self.done = done
        self.weight = weight


class FluidSim:
    """Event queue plus a fluid network of weighted max-min fair flows.

    Each flow's weight is 1, or with ``share_sigma`` > 0 drawn from a
    log-normal distribution (median 1, that sigma of its log) when it
    starts: TCP connections through a shaped link take turns rather than
    share it evenly (``benchmarks/flow_share.py`` measures how unevenly).
    """

    def __init__(self, capacity: dict, share_sigma: float = 0.0, seed: int = 0):
        self.share_sigma = share_sigma
        self._random = random.Random(seed)
        self.now = 0.0
        self._events: list = []
        self._seq = 0
        self.capacity = capacity  # link -> bytes/s (math.inf = unlimited)
        self.flows: list[_Flow] = []
        self._last = 0.0
        self._epoch = 0

    def at(self, t: float, fn: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._events, (max(t, self.now), self._seq, fn))

    def start_flow(self, nbytes: float, links: tuple, done: Callable[[], None]) -> None:
        self._advance()
        weight = math.exp(self._random.gauss(0.0, self.share_sigma)) if self.share_sigma else 1.0
        flow = _Flow(nbytes, links, done, weight)
        if nbytes <= 0 or all(math.isinf(self.capacity[l]) for l in links):
            self.at(self.now, done)
            return
        self.flows.append(flow)
        self._reschedule()

    def _advance(self) -> None:
        dt = self.now - self._last
        if dt > 0:
            for f in self.flows:
                f.remaining -= f.rate * dt
        self._last = self.now

    def _reschedule(self) -> None:
        # Progressive filling: the most constrained link (least capacity left
        # per unit of unfixed weight) fixes its flows' rates, in proportion to
        # their weights. Fixing flows at the least share only raises every other
        # link's share, so a heap whose stale entries are too low (pushed again
        # when popped) finds each next link: O(flows x their links), not
        # O(flows x links).
        left, weight, unfixed, flows_on = {}, {}, {}, {}
        for flow in self.flows:
            flow.rate = -1.0  # unfixed
            for link in flow.links:
                if link not in weight:
                    left[link], weight[link], unfixed[link] = self.capacity[link], 0.0, 0
                    flows_on[link] = []
                weight[link] += flow.weight
                unfixed[link] += 1
                flows_on[link].append(flow)
        order = {link: i for i, link in enumerate(weight)}  # ties: first seen
        heap = [(left[l] / weight[l], order[l], l) for l in weight]
        heapq.heapify(heap)
        while heap:
            share, _, link = heapq.heappop(heap)
            if not unfixed[link]:
                continue
            current = left[link] / weight[link]
            if current > share:
                heapq.heappush(heap, (current, order[link], link))
                continue
            for flow in flows_on[link]:
                if flow.rate >= 0:
                    continue
                flow.rate = current * flow.weight
                for l in flow.links:
                    left[l] -= flow.rate
                    weight[l] -= flow.weight
                    unfixed[l] -= 1
        self._epoch += 1
        epoch = self._epoch
        if self.flows:
            t = min(self.now + max(f.remaining, 0) / f.rate for f in self.flows)
            self.at(t, lambda: self._finish(epoch))

    def _finish(self, epoch: int) -> None:
        if epoch != self._epoch:
            return
        self._advance()
        done = [f for f in self.flows if f.remaining <= 1e-3]  # bytes; float rounding
        if not done:  # rounding: finish the nearest one
            done = [min(self.flows, key=lambda f: f.remaining)]
        self.flows = [f for f in self.flows if f not in done]
        self._reschedule()
        for f in done:
            f.done()

    def run(self, until: Callable[[], bool]) -> None:
        while self._events and not until():
            t, _, fn = heapq.heappop(self._events)
            self.now = t
            fn()


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
