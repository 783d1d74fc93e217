"""The simulated PS tasks' versions and the workers' pulls in progress
(:mod:`prophet_tf.bench.simulate`'s PS side)."""
from __future__ import annotations

import collections
from typing import Callable

from prophet_tf.bench.simulate_network import FluidSim

__all__ = ["Servers", "partition_id"]


class Servers:
    """The PS tasks' versions: a partition's version k+1 exists once every
    simulated worker's iteration-k push of it has arrived."""

    def __init__(self, sim: FluidSim, pushers: int):
        self.sim, self.pushers = sim, pushers
        # version -> partition_id(key, partition) -> time at PS
        self.available: dict[int, dict[int, float]] = collections.defaultdict(dict)
        self._pushes: dict[tuple, int] = {}
        self._waiting: dict[int, list[Callable]] = {}  # ps -> pulls to resume
        # ps -> worker -> (version, partitions not yet sent) of its pull in progress
        self.pulls: dict[int, dict[int, tuple[int, list]]] = collections.defaultdict(dict)

    def arrived(self, ps: int, items, at: float) -> None:
        applied = False
        for item in items:
            version = (item.key, item.partition, item.iteration + 1)
            count = self._pushes.pop(version, 0) + 1
            if count == self.pushers:
                self.available[item.iteration + 1][partition_id(item.key, item.partition)] = at
                applied = True
            else:
                self._pushes[version] = count
        # A pull waits for a partition to be applied: a push that applies none
        # would wake all W workers' pulls of this PS for nothing.
        if applied:
            for resume in self._waiting.pop(ps, []):
                self.sim.at(at, resume)

    def wait(self, ps: int, resume: Callable) -> None:
        self._waiting.setdefault(ps, []).append(resume)

    def owed(self, ps_tasks, max_version: int, workers) -> int:
        """Partitions the pulls in progress on ``ps_tasks`` still owe ``workers`` of
        versions up to ``max_version`` (the PS's ``Owed``)."""
        return sum(len(left) for ps in ps_tasks
                   for worker, (version, left) in self.pulls.get(ps, {}).items()
                   if worker in workers and version <= max_version)


_PARTITION_BITS = 24


def partition_id(key: int, partition: int) -> int:
    """One int for a partition: a cheaper key than the tuple."""
    if partition >> _PARTITION_BITS:
        raise ValueError(f"a variable has more than 2**{_PARTITION_BITS} partitions. "
                         f"Received: partition {partition} of key {key}")
    return key << _PARTITION_BITS | partition
