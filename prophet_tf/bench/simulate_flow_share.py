"""Fitting the simulator's ``share_sigma`` to how unevenly real links are shared.

``benchmarks/flow_share.py`` keeps K TCP connections busy with back-to-back
messages on one emulated link and measures each message's rate over the fair
share. :func:`message_rate_ratios` is the same experiment in the simulator's
fluid model (:class:`prophet_tf.bench.simulate_network.FluidSim`), and
:func:`fit_share_sigma` the ``share_sigma`` whose median matches the
measured one; ``prophet-tf simulate --validate --flow-share`` runs with it,
each run with the fitted sigma of its link rate and connections
(:func:`share_sigma_for`, :func:`uplink_connections`).
"""
from __future__ import annotations

import math
import statistics
from typing import Sequence

from prophet_tf.bench.simulate_network import FluidSim

__all__ = ["message_rate_ratios", "fit_share_sigma", "uplink_connections", "share_sigma_for"]


def message_rate_ratios(share_sigma: float, flows: int, *, message_bytes: int = 1 << 18,
                        messages: int = 2000, seed: int = 0) -> list:
    """Each message's rate over the fair share, when ``flows`` connections
    keep one link busy with back-to-back messages and flows share it with
    weights of that ``share_sigma``: what ``benchmarks/flow_share.py``
    measures on the emulated link, here in the fluid model, to fit one to
    the other. The first tenth is left out (all flows started together)."""
    if not isinstance(flows, int) or flows < 1:
        raise ValueError(f"flows must be an int >= 1. Received: {flows!r}")
    capacity = 1e6  # bytes/s; the ratios do not depend on it
    sim = FluidSim({"link": capacity}, share_sigma, seed)
    spans: list = []

    def send() -> None:
        start = sim.now

        def done() -> None:
            spans.append(sim.now - start)
            send()
        sim.start_flow(message_bytes, ("link",), done)
    for _ in range(flows):
        sim.at(0.0, send)
    sim.run(until=lambda: len(spans) >= messages)
    fair = capacity / flows
    return [message_bytes / t / fair for t in spans[messages // 10:messages]]


def fit_share_sigma(median_ratio: float, flows: int, *, seed: int = 0) -> float:
    """The ``share_sigma`` whose simulated messages have the measured median
    rate over the fair share (bisection; the median grows with the sigma
    from 1, fair sharing, towards ``flows``, one message at a time)."""
    if not 1.0 <= median_ratio < flows:
        raise ValueError(f"median_ratio must be in [1, flows={flows}). "
                         f"Received: {median_ratio!r}")
    low, high = 0.0, 4.0
    for _ in range(20):
        mid = (low + high) / 2
        if statistics.median(message_rate_ratios(mid, flows, seed=seed)) < median_ratio:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def uplink_connections(workers: int, num_ps: int, layout: str) -> int:
    """Connections that share the busiest uplink: a colocated host's pushes
    to the other hosts' PS tasks and its PS's answers to the other workers;
    a dedicated PS host's answers to every worker, or a worker's pushes to
    every PS host."""
    if layout == "colocated":
        return 2 * (workers - 1)
    return max(workers, num_ps)


def share_sigma_for(flow_shares: Sequence[dict] | None, link_mbit: float | None,
                    connections: int) -> float:
    """The fitted ``share_sigma`` of ``benchmarks/flow_share.py``: of the
    result at the link rate nearest ``link_mbit``, the case with the nearest
    number of connections (0.0, even sharing, without one)."""
    if not flow_shares or connections < 2:
        return 0.0
    flow_share = min(flow_shares, key=lambda f: abs(f["link_mbit"] - (link_mbit or math.inf)))
    cases = {int(k): v["share_sigma"] for k, v in flow_share["by_connections"].items()
             if v.get("share_sigma") is not None}
    if not cases:
        return 0.0
    return cases[min(cases, key=lambda k: (abs(k - connections), k))]
