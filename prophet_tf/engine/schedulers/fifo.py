"""FIFO: a plain parameter server, each gradient in the order it became ready."""
from __future__ import annotations

import collections

from prophet_tf.engine.schedulers.base import (MAX_BLOCK_BYTES, ActiveLinks, ReadyItem,
                                               Scheduler)

__all__ = ["FifoScheduler"]


class FifoScheduler(Scheduler):
    """A plain parameter server: each gradient in the order it became ready.

    All partitions of one gradient on one link form one block (split at
    :data:`MAX_BLOCK_BYTES`); each link sends its blocks in readiness order,
    two in flight (the default window: one on the wire, one queued behind it).
    """

    name = "fifo"

    def __init__(self):
        self._groups: dict[int, collections.deque[list[ReadyItem]]] = {}  # link -> groups
        self._open: dict[tuple[int, int, int], list[ReadyItem]] = {}
        self._active = ActiveLinks()  # links in the order of _groups
        self._pending = 0

    def add(self, item: ReadyItem) -> None:
        gid = (item.iteration, item.key, item.ps_index)
        group = self._open.get(gid)
        if group is None:
            group = self._open[gid] = []
            self._groups.setdefault(item.ps_index, collections.deque()).append(group)
        group.append(item)
        self._active.wake(item.ps_index)
        self._pending += 1

    def _select(self, now_ns: int) -> list[ReadyItem]:
        windows, active = self.windows, self._active
        for link in active:
            groups = self._groups[link]
            if groups and windows[link].open:
                return self._take(groups)
            active.sleep(link)  # nothing to send until an add or a sent block
        return []

    def _take(self, groups: collections.deque) -> list[ReadyItem]:
        group = groups.popleft()
        first = group[0]
        gid = (first.iteration, first.key, first.ps_index)
        if self._open.get(gid) is group:
            del self._open[gid]
        total = 0
        for cut, item in enumerate(group):
            total += item.nbytes
            if total > MAX_BLOCK_BYTES and cut:
                groups.appendleft(group[cut:])
                group = group[:cut]
                break
        self._pending -= len(group)
        return group

    @property
    def pending(self) -> int:
        return self._pending
