"""The simulator's links with a rate lag: the flows' shares follow their starts
and ends up to ``rate_lag_s`` late (why, and what it costs in accuracy: the
docstring of :mod:`prophet_tf.bench.simulate_network`).

:class:`RateLag` is the part of :class:`prophet_tf.bench.simulate_network.FluidSim`
that runs when ``rate_lag_s`` > 0. It keeps no classes of flows: a computation
of the rates takes, per pair of links, the weight of the flows crossing both,
fills the links by rounds and gives each flow its weight times the least level
of its links, in one call into compiled code over the flow slots' arrays
(:func:`prophet_tf.bench.simulate_max_min.rates`).
"""
from __future__ import annotations

import heapq
import math
import operator

import numpy as np

from prophet_tf.bench import simulate_max_min as max_min

__all__ = ["RateLag", "finite_ids", "weight_and_route"]

_SEQ = operator.attrgetter("seq")  # the order flows started in


def weight_and_route(sim, nbytes: float, links: tuple, done, ids) -> tuple | None:
    """A new flow's weight (drawn whether or not it moves a byte, so the draws
    follow the flows) and its route (``sim.route(links)`` if ``ids`` is False);
    None if it has no byte or no link to wait for: ``done`` is queued now."""
    weight = math.exp(sim._random.gauss(0.0, sim.share_sigma)) if sim.share_sigma else 1.0
    if ids is False:
        ids = sim.route(links)
    if nbytes <= 0 or ids is None:
        sim.at(sim.now, done)
        return None
    return weight, ids


def finite_ids(links: tuple, capacity: dict, link_id: dict, new_link) -> tuple | None:
    """The ids of the links of a path that limit it (finite capacity), None if
    none does; ``new_link(link)`` gives the id of a link met for the first
    time (kept in ``link_id``). With a rate lag a path crosses at most two."""
    finite = [link for link in links if not math.isinf(capacity[link])]
    if not finite:
        return None
    if len(finite) > 2:
        raise ValueError(f"with a rate lag a path crosses at most two links that limit it. "
                         f"Received: {finite}")
    ids = []
    for link in finite:
        if link not in link_id:
            link_id[link] = new_link(link)
        ids.append(link_id[link])
    return tuple(ids)


class RateLag:
    """The rate-lag methods of ``FluidSim`` (which holds the state they use)."""

    def _lagged_run(self, until) -> None:
        """Runs the events in order, the pending flow end (kept out of the
        queue: it moves at most flow starts, and a queued one would be left
        behind stale each time) among them at its time and place."""
        events, instant = self._events, self._instant
        heappop, inf = heapq.heappop, math.inf
        while not until():
            if instant:  # events at now: the rates are not due before they ran
                place, fn = instant[0]
                if events and events[0][0] <= self.now and events[0][1] < place:
                    fn = heappop(events)[2]
                elif self._end_time <= self.now and self._end_place < place:
                    fn = self._end_now
                else:
                    instant.popleft()
                fn()
                continue
            t = events[0][0] if events else inf
            end = self._end_time
            refill_at = self._refill_at
            if refill_at is not None and (t if t < end else end) > refill_at:
                # After the last event of that instant: the changes made at
                # it are all in.
                self.now = max(self.now, refill_at)
                self._refill()
                continue
            if end < t or (end == t < inf and self._end_place < events[0][1]):
                self.now = end
                self._end_now()
            elif events:
                t, _, fn = heappop(events)
                self.now = t
                fn()
            else:
                return

    def _lagged_start(self, flow, nbytes: float) -> None:
        """Until the rates are recomputed, the flow takes what its links have
        spare (capacity of flows ended since, or none): no link ever carries
        more than its capacity."""
        slot, ids = flow.slot, flow.ids
        self._weight[slot] = flow.weight
        self._first[slot] = ids[0]
        self._second[slot] = ids[1] if len(ids) > 1 else 0  # 0: no link
        spare = self._spare
        rate = spare[ids[0]]  # the least spare of its links, 0 if none
        if len(ids) > 1 and spare[ids[1]] < rate:
            rate = spare[ids[1]]
        if 0.0 > rate:
            rate = 0.0
        self._rate[slot] = rate
        left = float(nbytes)
        if rate > 0:
            for link in ids:
                spare[link] -= rate
            left += rate * (self.now - self._last)  # as of _last, as the other flows'
            heapq.heappush(self._late, (self.now + nbytes / rate, flow.seq, slot))
            self._next_end()
        self._remaining[slot] = left
        self._lagged_change()

    def _lagged_change(self) -> None:
        """Flows started or ended: the rates are due, at most rate_lag_s after
        the last computation."""
        if self._refill_at is None:
            self._refill_at = max(self.now, self._last + self.rate_lag_s)

    def _refill(self) -> None:
        """The max-min rates of the flows in flight, and the order they end in."""
        now = self.now
        self._refill_at = None
        self._end_at = self._end_time = math.inf  # the pending flow end was of the old rates
        # The slots past the last one in use hold no flow: left out (a free
        # slot adds 0 to every sum and never ends).
        used, flow_at = self._slots_used, self._flow_at
        while used and flow_at[used - 1] is None:
            used -= 1
        self._slots_used = used
        remaining = self._remaining[:used]
        remaining -= self._rate[:used] * (now - self._last)
        self._last = now
        self._late.clear()  # their rates are recomputed too
        self._end_next = 0
        rate = self._fill_levels(used)
        with np.errstate(divide="ignore"):  # a free slot: inf bytes at rate 0
            ends = now + np.maximum(remaining, 0.0) / rate
        # Ordered: the ends before the next computation if a flow starts or
        # ends before it, else the first one (its end brings one at once).
        soon = np.flatnonzero(ends <= now + self.rate_lag_s)
        if not len(soon) and used and ends.min() < math.inf:
            soon = np.array([ends.argmin()])
        slots = soon[np.argsort(ends[soon], kind="stable")]
        self._end_slots, self._end_times = slots.tolist(), ends[slots].tolist()
        self._next_end()

    def _fill_levels(self, used: int) -> np.ndarray:
        """Sets the rate of every flow in the first ``used`` slots (returned)
        and every link's spare capacity."""
        capacity = self._capacity_array
        if len(capacity) != len(self._link_capacity):  # links met since
            capacity = self._capacity_array = np.array(self._link_capacity)
        rate = self._rate[:used]
        spare = max_min.rates(capacity, self._first[:used], self._second[:used],
                              self._weight[:used], rate)
        self._spare = spare.tolist()
        return rate

    def _next_end(self) -> None:
        """Makes the earliest end the pending flow-end event, unless it is."""
        times, late = self._end_times, self._late
        t = min(times[self._end_next] if self._end_next < len(times) else math.inf,
                late[0][0] if late else math.inf)
        if t < self._end_at:
            # In place of the one pending, with the place a queued event takes.
            self._end_at = t
            self._seq += 1
            self._end_time, self._end_place = max(t, self.now), self._seq

    def _end_now(self) -> None:
        """The pending flow end is due: the flows due by now end."""
        self._end_at = self._end_time = math.inf
        now = self.now
        times, slots, late, flow_at = self._end_times, self._end_slots, self._late, self._flow_at
        done = []
        i, count = self._end_next, len(times)
        while i < count and times[i] <= now:
            done.append(flow_at[slots[i]])
            i += 1
        self._end_next = i
        while late and late[0][0] <= now:
            done.append(flow_at[heapq.heappop(late)[2]])
        if len(done) > 1:
            done.sort(key=_SEQ)
        spare, rate = self._spare, self._rate
        for f in done:
            freed = float(rate[f.slot])
            for link in f.ids:
                spare[link] += freed
            self._remove(f)
        self._lagged_change()
        self._next_end()
        for f in done:
            f.done()
