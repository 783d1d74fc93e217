"""The links of a simulated cluster layout: their capacities, and which of them each
push and pull crosses (the network that carries them: :mod:`prophet_tf.bench.simulate_network`).
"""
from __future__ import annotations

__all__ = ["ClusterLinks"]


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
