"""Weighted max-min fair rates of the simulator's flows, by progressive filling.

:class:`prophet_tf.bench.simulate_network.FluidSim` keeps its flows in classes
(one path and weight: one rate for all of a class's flows) and calls :func:`fill`
whenever the rates are due; with a rate lag it calls :func:`rates`, the same
filling over links rather than classes, compiled (``native/max_min.c``, loaded
with ctypes): :func:`levels` is that filling in numpy, which the compiled one
is tested against. In numpy a computation was mostly the per-call overhead of
its ~25 rounds of small array operations (docs/records/2026-12-07-compiled-max-min.md).
"""
from __future__ import annotations

import ctypes
import functools
import heapq
import math
import pathlib

import numpy as np

__all__ = ["fill", "levels", "rates", "LIBRARY"]

#: The compiled filling, built with the op library (`make build`, `pip install`).
LIBRARY = pathlib.Path(__file__).resolve().parents[1] / "_max_min.so"
_ERRORS = {1: "a link count or flow count out of range", 2: "a flow on a link outside the links",
           3: "no memory for the link pairs"}

#: Links whose shares are this close to the least are filled in the same round:
#: ties in exact arithmetic, apart by float rounding.
_TIES = 1e-9
#: The level of a link that limits no flow: above any rate, and times a free
#: slot's weight 0 still 0.
NO_LEVEL = 1e300


def fill(link_capacity: list, link_count: list, on_link: list, link_flows: list,
         class_rate: list, generation: int, *, weighted: bool) -> None:
    """Sets every class's rate in ``class_rate`` (by its ``index``), with the rounding of
    a flow-by-flow computation (a class's rate is taken from a link once per flow).

    Args:
      link_capacity, link_count: per link id, its capacity and its flows in flight.
      on_link: per link id, its classes in flight in start order (a dict used as an
        ordered set); a class has ``links``, ``weight``, ``count``, ``index`` and
        ``generation`` (set to ``generation`` here when its rate is fixed).
      link_flows: per link id, a heap of ``(start seq, place in path, flow)``; flows
        that ended (``slot < 0``) are dropped from its head here.
      generation: this computation's number, new at every call.
      weighted: some weight is not 1 (then the sums go in start order, flow by flow).

    The most constrained link (least capacity left per unit of unfixed weight) fixes
    its flows' rates, in proportion to their weights. Fixing flows at the least share
    only raises every other link's share, so a heap whose stale entries are too low
    (pushed again when popped) finds each next link: O(classes x their links), not
    O(classes x links). Links of equal share go in the order the oldest flow on them
    started.
    """
    left = list(link_capacity)
    unfixed = list(link_count)
    if weighted:  # summed in start order, as flow by flow
        weight = [0.0] * len(left)
        for link, classes in enumerate(on_link):
            w = 0.0
            for c in classes:
                w += c.count * c.weight
            weight[link] = w
    else:  # every weight 1: the sums are whole numbers
        weight = [float(n) for n in unfixed]
    heap = []
    for link, n in enumerate(unfixed):
        if n:
            flows = link_flows[link]
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
        for c in on_link[link]:
            if c.generation == generation:  # fixed
                continue
            c.generation = generation
            class_rate[c.index] = rate = current * c.weight
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


def levels(capacity: np.ndarray, pairs: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """Each link's level: the rate per unit of weight of the flows it limits
    (``NO_LEVEL`` if it limits none). A flow's max-min fair rate is its weight
    times the least level of its links.

    Args:
      capacity: per link id, its capacity (``math.inf``: it limits nothing).
      pairs: per pair of link ids, the weight of the flows that cross both (symmetric);
        a flow crosses at most two links.
      weight: per link id, the weight of the flows that cross it.

    Progressive filling by rounds: the links of the least share (capacity left
    per unit of weight not yet limited) are full at that level, and the flows
    they limit take it from their other link. A round is a few operations on
    arrays of links, so a computation costs per distinct level, not per class
    of flows (4,000 at 64 colocated workers, about 30 levels).
    """
    n = len(capacity)
    # Capacity left (row 0) and weight not yet limited (row 1) of each link,
    # updated together: a round with one full link (most) is a few operations.
    state = np.empty((2, n))
    state[0], state[1] = capacity, weight
    left, weight = state
    level = np.full(n, NO_LEVEL)
    share = np.empty(n)
    both = np.empty((2, n))
    taken, unlimited = both  # the two rows
    lowest = np.fmin.reduce
    # A link is out of the filling (share inf) once full, or once no flow of
    # its is left to fix (left over weight 0: inf, or nan if left is 0 too).
    left[weight <= 0] = math.inf
    with np.errstate(divide="ignore", invalid="ignore"):
        while True:
            np.divide(left, weight, out=share)
            least = float(lowest(share))  # nan: left 0 over weight 0
            if least == math.inf:
                return level
            full = (share <= least * (1 + _TIES)).nonzero()[0]
            if len(full) == 1:  # the same products as the matrix one below
                link = full[0]
                level[link] = fixed = share[link]
                left[link] = math.inf
                crossing = pairs[link]
                np.multiply(crossing, fixed, out=taken)
                np.copyto(unlimited, crossing)
                state -= both
            else:
                level[full] = fixed = share[full]
                left[full] = math.inf
                crossing = pairs[full]
                left -= fixed @ crossing
                weight -= np.add.reduce(crossing, 0)
            # Rounding: never below 0 (-inf shares), so a link out stays out.
            np.maximum(state, 0.0, out=state)


@functools.cache
def _compiled():
    if not LIBRARY.is_file():
        raise ImportError(f"prophet_tf's simulator library was not built: {LIBRARY} does not "
                          "exist. Rebuild it from the checkout with `make build`, "
                          "`pip install -e .` or `python setup.py build_ext --inplace`.")
    fn = ctypes.CDLL(str(LIBRARY)).prophet_max_min_rates
    doubles = np.ctypeslib.ndpointer(np.float64, ndim=1, flags="C_CONTIGUOUS")
    links = np.ctypeslib.ndpointer(np.int64, ndim=1, flags="C_CONTIGUOUS")
    out = np.ctypeslib.ndpointer(np.float64, ndim=1, flags=("C_CONTIGUOUS", "WRITEABLE"))
    fn.argtypes = [ctypes.c_int64, doubles, ctypes.c_int64, links, links, doubles, out, out]
    fn.restype = ctypes.c_int
    return fn


def rates(capacity: np.ndarray, first: np.ndarray, second: np.ndarray, weight: np.ndarray,
          out: np.ndarray) -> np.ndarray:
    """Every flow's max-min fair rate, into ``out``; returns each link's spare
    capacity (its capacity less the rates crossing it).

    Args:
      capacity: per link id, its capacity (``math.inf``: it limits nothing).
      first, second: per flow, the ids of its links (int64; ``second`` 0 for none:
        link 0 limits nothing).
      weight: per flow, its weight (0: a free slot, which takes no rate).
      out: per flow, its rate (written).

    The rates are :func:`levels`' (a flow's weight times the least level of its
    links) with the same sums in the same order, but for the rounds in which
    several links are full at once (numpy's matrix product sums in BLAS's own
    order, the compiled one in link order: a last bit may differ).
    """
    n, used = len(capacity), len(first)
    if not (len(second) == len(weight) == len(out) == used):
        raise ValueError(f"rates takes one link pair, weight and rate per flow. Received: "
                         f"{used} first links, {len(second)} second links, {len(weight)} "
                         f"weights and {len(out)} rates")
    spare = np.empty(n)
    code = _compiled()(n, capacity, used, first, second, weight, out, spare)
    if code:
        bad = [int(x) for x in (*first, *second) if not 0 <= x < n][:3]
        raise ValueError(f"rates cannot fill {n} links and {used} flows: "
                         f"{_ERRORS.get(code, f'error {code}')}. Links out of range: {bad}")
    return spare
