"""The simulator's network with a rate lag, in compiled code.

:class:`CompiledFluidSim` is :class:`prophet_tf.bench.simulate_network.FluidSim`
with ``rate_lag_s`` > 0 (:mod:`prophet_tf.bench.simulate_rate_lag`), with its
event queue and flows in native/fluid_core.c: the same events in the same
order, the same flows' rates and ends, the same results to the last bit, in
0.65x the time at 64 workers (docs/records/2026-12-07-compiled-event-core.md;
the Python path stays as the readable reference the tests compare it with).
What is left in Python is what a caller sees: link names, the paths' link
ids and the flows' weights, drawn from the same generator in the same order.
"""
from __future__ import annotations

import random
import types
from typing import Callable

from prophet_tf.bench.simulate_rate_lag import finite_ids, weight_and_route

try:
    from prophet_tf._fluid_core import Core
except ImportError as e:  # a checkout that was never built
    raise ImportError(
        "prophet_tf's compiled simulator core was not built (prophet_tf/_fluid_core.abi3.so): "
        "rebuild it from the checkout with `make build`, `pip install -e .` or "
        "`python setup.py build_ext --inplace`, or simulate with compiled=False") from e

__all__ = ["CompiledFluidSim"]


class CompiledFluidSim(Core):
    """Event queue plus a fluid network of weighted max-min fair flows whose
    rates follow their starts and ends up to ``rate_lag_s`` late (> 0).

    The arguments are :class:`~prophet_tf.bench.simulate_network.FluidSim`'s.
    ``now``, ``at``, ``at_sorted`` and ``run`` are the compiled core's.
    """

    def __init__(self, capacity: dict, share_sigma: float = 0.0, seed: int = 0,
                 rate_lag_s: float = 0.0):
        super().__init__(rate_lag_s)
        self.capacity = capacity  # link -> bytes/s (math.inf = unlimited)
        self.share_sigma = share_sigma
        self.rate_lag_s = rate_lag_s
        self._random = random.Random(seed)
        self._link_id: dict = {}
        self._link_names: list = [None]  # by id; 0 is no link
        self._path_ids: dict[tuple, tuple | None] = {}

    def route(self, links: tuple) -> tuple | None:
        """The ids of the links of a path that limit it (None: none does)."""
        ids = self._path_ids.get(links, False)
        if ids is False:
            ids = self._path_ids[links] = finite_ids(links, self.capacity, self._link_id,
                                                     self._new_link)
        return ids

    def _new_link(self, link) -> int:
        self._link_names.append(link)
        return self._add_link(self.capacity[link])

    def start_flow(self, nbytes: float, links: tuple, done: Callable[[], None],
                   ids: tuple | None | bool = False) -> None:
        """A flow of ``nbytes`` over ``links`` (whose :meth:`route` is ``ids``, or
        looked up if False); ``done`` runs when its last byte is in."""
        started = weight_and_route(self, nbytes, links, done, ids)
        if started is not None:
            weight, ids = started
            self._start(nbytes, ids[0], ids[1] if len(ids) > 1 else 0, weight, done)

    @property
    def flows(self) -> list:
        """The flows in flight, in the order they started: their limiting
        ``links`` (names) and ``rate`` (as of the latest rates)."""
        names = self._link_names
        return [types.SimpleNamespace(links=tuple(names[i] for i in (a, b) if i), rate=rate)
                for _, a, b, rate in sorted(self._flows())]
