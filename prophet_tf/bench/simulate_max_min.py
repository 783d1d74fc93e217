"""Weighted max-min fair rates of the simulator's flows, by progressive filling.

:class:`prophet_tf.bench.simulate_network.FluidSim` keeps its flows in classes
(one path and weight: one rate for all of a class's flows) and calls :func:`fill`
whenever the rates are due.
"""
from __future__ import annotations

import heapq

__all__ = ["fill"]


def fill(link_capacity: list, link_count: list, on_link: list, link_flows: list,
         class_rate: list, generation: int, *, weighted: bool, one_by_one: bool) -> list:
    """Sets every class's rate in ``class_rate`` (by its ``index``); returns each link's
    capacity that no flow takes.

    Args:
      link_capacity, link_count: per link id, its capacity and its flows in flight.
      on_link: per link id, its classes in flight in start order (a dict used as an
        ordered set); a class has ``links``, ``weight``, ``count``, ``index`` and
        ``generation`` (set to ``generation`` here when its rate is fixed).
      link_flows: per link id, a heap of ``(start seq, place in path, flow)``; flows
        that ended (``slot < 0``) are dropped from its head here.
      generation: this computation's number, new at every call.
      weighted: some weight is not 1 (then the sums go in start order, flow by flow).
      one_by_one: take a class's rate from a link once per flow, with the rounding
        of a flow-by-flow computation (the bit-identical path), rather than once.

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
                elif not one_by_one:
                    left[l] -= rate * count
                else:  # as many subtractions as flows: the same rounding
                    x = left[l]
                    for _ in range(count):
                        x -= rate
                    left[l] = x
                weight[l] -= w
                unfixed[l] -= count
    return left
