"""P3: small fixed slices, always the most urgent ready slice next."""
from __future__ import annotations

import heapq

from prophet_tf.engine.schedulers.base import PriorityScheduler, ReadyItem

__all__ = ["P3Scheduler"]


class P3Scheduler(PriorityScheduler):
    """P3: small fixed slices, always the most urgent ready slice next.

    Each block is one slice (one partition: the engine cuts variables into
    slices of ``slice_bytes``). Default 200,000 bytes: P3 (Jayarajan et al.,
    "Priority-based Parameter Propagation for Distributed DNN Training",
    SysML 2019) used slices of 50,000 parameters, i.e. 200,000 bytes of
    float32. Window: :attr:`SLICES_IN_FLIGHT` = 2 slices per link, one on the
    wire and one queued behind it, so the link does not idle between RPCs
    (P3's ZeroMQ sends were asynchronous too), while a newly ready urgent
    slice waits behind at most two slices.

    Args:
      slice_bytes: slice size in bytes.
      slices_in_flight: the window: slices in flight per link. A slice holds
        its place until the PS has answered, so the window must cover what
        the link carries during that answer's delay; on a fast link more
        slices keep it busy, at the cost of urgent slices waiting behind them
        (see ``ProphetScheduler``'s ``blocks_in_flight``).
    """

    name = "p3"
    SLICES_IN_FLIGHT = 2
    OPTIONS = {"slice_bytes": 200_000, "slices_in_flight": SLICES_IN_FLIGHT}

    def __init__(self, slice_bytes: int = 200_000, slices_in_flight: int = SLICES_IN_FLIGHT):
        super().__init__()
        self.slice_bytes = slice_bytes
        self.slices_in_flight = self.window_blocks = slices_in_flight

    @property
    def partition_bytes(self) -> int:
        return self.slice_bytes

    def _select(self, now_ns: int) -> list[ReadyItem]:
        windows, active = self.windows, self._active
        for link in active:
            heap = self._ready[link]
            if heap and windows[link].open:
                return self._start([heapq.heappop(heap)[-1]])
            active.sleep(link)  # nothing to send until an add or a sent block
        return []

    def plan(self) -> dict:
        return {"scheduler": self.name, "slice_bytes": self.slice_bytes,
                "slices_in_flight": self.slices_in_flight}
