"""The simulator's event queue: virtual time and the callbacks due at each instant.

:class:`EventQueue` is the queue part of
:class:`prophet_tf.bench.simulate_network.FluidSim`. Events run in the order of
``(time, place in queue)``, the place taken when the event is queued. Most
events are queued for the very instant that is running (a push answered or a
parameter delivered with no latency): those go to a first-in-first-out list,
whose places follow each other, rather than the heap of later events, and
the next event is the earlier of the heads of the two. Events queued
together in order of time (a worker's gradients of an iteration) enter the
heap one at a time, each when the one before it runs. The order is the one
a single heap would give.
"""
from __future__ import annotations

import collections
import heapq
from typing import Callable

__all__ = ["EventQueue"]


class EventQueue:
    """Virtual time ``now`` and the events queued with :meth:`at`."""

    def __init__(self):
        self.now = 0.0
        self._seq = 0  # the place of the latest event queued
        self._events: list = []  # heap of (time, place, callback), time > now when queued
        self._instant: collections.deque = collections.deque()  # (place, callback) at now

    def at(self, t: float, fn: Callable[[], None]) -> None:
        """Runs ``fn`` at time ``t`` (now if ``t`` has passed), after the events
        queued before for that time."""
        self._seq += 1
        if t > self.now:
            heapq.heappush(self._events, (t, self._seq, fn))
        else:
            self._instant.append((self._seq, fn))

    def at_sorted(self, timed: list[tuple[float, Callable[[], None]]]) -> None:
        """Queues ``(time, fn)`` pairs given in order of time, as :meth:`at` one
        by one would (same places), but with only the next one in the heap:
        a worker's gradients of an iteration would otherwise fill it."""
        later = []
        for t, fn in timed:
            self._seq += 1
            if t > self.now:
                later.append((t, self._seq, fn))
            else:
                self._instant.append((self._seq, fn))
        if later:
            self._push_next(iter(later))

    def _push_next(self, stream) -> None:
        entry = next(stream, None)
        if entry is not None:
            t, seq, fn = entry

            def run():
                self._push_next(stream)
                fn()
            heapq.heappush(self._events, (t, seq, run))

    def _next_event(self) -> tuple[float, int] | None:
        """The time and place of the next event queued, or None."""
        events, instant = self._events, self._instant
        if instant and not (events and events[0][0] <= self.now and events[0][1] < instant[0][0]):
            return self.now, instant[0][0]
        return events[0][:2] if events else None

    def _pop_event(self) -> Callable[[], None] | None:
        """Takes the next event out of the queue and moves time to it (None:
        the queue is empty)."""
        events, instant = self._events, self._instant
        if instant and not (events and events[0][0] <= self.now and events[0][1] < instant[0][0]):
            return instant.popleft()[1]
        if not events:
            return None
        t, _, fn = heapq.heappop(events)
        self.now = t
        return fn
