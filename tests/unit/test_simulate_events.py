"""The simulator's shortcuts give what the straightforward computations give:
the event queues' order (Python and compiled) is one heap's, the max-min
levels' one-link rounds are the matrix product's, and the compiled rates are
numpy's."""
from __future__ import annotations

import heapq
import math
import random

import numpy as np
import pytest

from prophet_tf.bench import simulate_max_min
from prophet_tf.bench.simulate_compiled import CompiledFluidSim
from prophet_tf.bench.simulate_events import EventQueue


class _Recording(EventQueue):
    def run(self):
        while (fn := self._pop_event()) is not None:
            fn()


class _Compiled(CompiledFluidSim):
    def __init__(self):
        super().__init__({}, rate_lag_s=0.1)

    def run(self):
        super().run(until=lambda: False)  # until none are left


@pytest.mark.parametrize("queue_type", [_Recording, _Compiled])
def test_events_run_in_the_order_of_one_heap(queue_type):
    """Events queued for now, later, and in sorted batches, from inside events:
    run in (time, place) order, as a single heap of every event would run them
    (the Python queue, and the compiled one of native/fluid_core.c)."""
    rng = random.Random(5)
    queue, ran = queue_type(), []
    heap, seq = [], [0]  # the reference: every event in one heap

    def queue_some(depth):
        for _ in range(rng.randint(0, 3)):
            t = queue.now + rng.choice([0.0, 0.0, 1.0, 2.0, rng.random()])
            seq[0] += 1
            heapq.heappush(heap, (max(t, queue.now), seq[0]))
            queue.at(t, make(seq[0], depth))
        if rng.random() < 0.3:
            times = sorted(queue.now + rng.choice([0.0, 1.0, rng.random()]) for _ in range(4))
            batch = []
            for t in times:
                seq[0] += 1
                heapq.heappush(heap, (t, seq[0]))
                batch.append((t, make(seq[0], depth)))
            queue.at_sorted(batch)

    def make(name, depth):
        def fn():
            ran.append((queue.now, name))
            if depth < 4:
                queue_some(depth + 1)
        return fn

    queue_some(0)
    queue.run()
    assert len(ran) == len(heap) > 50
    assert ran == sorted(heap)


def _levels_by_matrix(capacity, pairs, weight):
    """Progressive filling with the matrix product in every round."""
    left, weight = capacity.copy(), weight.copy()
    level = np.full(len(capacity), simulate_max_min.NO_LEVEL)
    left[weight <= 0] = math.inf
    with np.errstate(divide="ignore", invalid="ignore"):
        while True:
            share = left / weight
            least = np.fmin.reduce(share)
            if least == math.inf:
                return level
            full = np.flatnonzero(share <= least * (1 + simulate_max_min._TIES))
            level[full] = fixed = share[full]
            left[full] = math.inf
            crossing = pairs[full]
            left -= fixed @ crossing
            weight -= np.add.reduce(crossing, 0)
            np.maximum(left, 0.0, out=left)
            np.maximum(weight, 0.0, out=weight)


def test_levels_equal_the_matrix_product_rounds_to_the_bit():
    rng = np.random.default_rng(0)
    rounds_of_one = 0
    for case in range(200):
        n = int(rng.integers(2, 30))
        capacity = rng.uniform(1.0, 100.0, n)
        capacity[0] = math.inf
        first, second = rng.integers(0, n, (2, int(rng.integers(1, 150))))
        weights = np.exp(rng.normal(0.0, 1.0, len(first))) if case % 2 else np.ones(len(first))
        p = np.bincount(first * n + second, weights=weights, minlength=n * n).reshape(n, n)
        pairs, weight = p + p.T, p.sum(0) + p.sum(1)
        expected = _levels_by_matrix(capacity, pairs, weight)
        assert np.array_equal(simulate_max_min.levels(capacity, pairs, weight), expected)
        rounds_of_one += len(set(expected[expected < simulate_max_min.NO_LEVEL].tolist()))
    assert rounds_of_one > 200


def _numpy_rates(capacity, first, second, weight):
    """The rates and spare capacities in numpy, as the simulator took them
    before the compiled filling."""
    n = len(capacity)
    p = np.bincount(first * n + second, weights=weight, minlength=n * n).reshape(n, n)
    level = simulate_max_min.levels(capacity, p + p.T, np.add.reduce(p, 0) + np.add.reduce(p, 1))
    rate = weight * np.minimum(level[first], level[second])
    return rate, capacity - (np.bincount(first, rate, n) + np.bincount(second, rate, n))


def _flows(rng, n, count, weighted):
    """Flows over up to two links each, the second 0 (none) for some."""
    first = rng.integers(1, n, count)
    second = np.where(rng.random(count) < 0.2, 0, rng.integers(1, n, count))
    weight = np.exp(rng.normal(0.0, 1.0, count)) if weighted else np.ones(count)
    weight[rng.random(count) < 0.1] = 0.0  # free slots
    return first, second, weight


def test_compiled_rates_are_numpys():
    """To the bit where no two links are full at once (distinct random
    capacities), and to the last bits where ties make several full in one round
    (equal capacities: numpy's matrix product sums in BLAS's order)."""
    rng = np.random.default_rng(1)
    for case in range(300):
        n = int(rng.integers(2, 140))
        ties = case % 3 == 0
        capacity = np.full(n, 50.0) if ties else rng.uniform(1.0, 100.0, n)
        capacity[0] = math.inf
        first, second, weight = _flows(rng, n, int(rng.integers(0, 3000)), case % 2 == 1)
        out = np.full(len(first), -1.0)
        spare = simulate_max_min.rates(capacity, first, second, weight, out)
        want_rate, want_spare = _numpy_rates(capacity, first, second, weight)
        if ties:
            np.testing.assert_allclose(out, want_rate, rtol=1e-12, err_msg=f"case {case}")
            np.testing.assert_allclose(spare[1:], want_spare[1:], rtol=1e-9, atol=1e-9)
        else:
            assert np.array_equal(out, want_rate), f"case {case}"
            assert np.array_equal(spare, want_spare), f"case {case}"
        # Max-min: no link over its capacity, and every flow limited by a full link.
        assert (spare[1:] >= -1e-9 * capacity[1:]).all()
        moving = weight > 0
        full = spare <= 1e-9 * np.where(np.isinf(capacity), 1.0, capacity)
        assert (full[first[moving]] | full[second[moving]]).all()


def test_compiled_rates_refuse_links_out_of_range_and_write_nothing():
    capacity = np.array([math.inf, 10.0, 10.0])
    first, second = np.array([1, 3], dtype=np.int64), np.array([2, 0], dtype=np.int64)
    out = np.full(2, -1.0)
    with pytest.raises(ValueError, match=r"3 links and 2 flows.*outside the links.*\[3\]"):
        simulate_max_min.rates(capacity, first, second, np.ones(2), out)
    assert (out == -1.0).all()
    with pytest.raises(ValueError, match="2 first links, 2 second links, 1 weights and 2 rates"):
        simulate_max_min.rates(capacity, first, second, np.ones(1), out)


def test_schedulers_pick_as_with_every_link_scanned(monkeypatch):
    """Scanning only the links that may start a block (``ActiveLinks``) sends
    the same blocks at the same times as scanning every link in order."""
    from prophet_tf.bench import saved_profiles, simulate
    from prophet_tf.engine.dispatch import Dispatch
    from prophet_tf.engine.schedulers import base
    profile = saved_profiles.load_profile("cnn")
    run = dict(workers=4, num_ps=4, bandwidth_mbit=200.0, layout="colocated",
               iterations=simulate.WARMUP_ITERATIONS + 2)
    blocks = []
    next_blocks = Dispatch.next_blocks

    def recording(dispatch, now_ns):
        out = next_blocks(dispatch, now_ns)
        blocks.extend((now_ns, [(i.key, i.partition, i.iteration) for i in block])
                      for block in out)
        return out
    monkeypatch.setattr(Dispatch, "next_blocks", recording)
    for name in ("fifo", "p3", "bytescheduler", "prophet"):
        blocks.clear()
        fast = simulate.simulate(profile, name, **run)
        fast_blocks = list(blocks)
        with monkeypatch.context() as every_link:
            every_link.setattr(base.ActiveLinks, "__iter__",
                               lambda self: (self.wake_all(), iter(list(self._awake)))[1])
            blocks.clear()
            assert simulate.simulate(profile, name, **run) == fast
        assert blocks == fast_blocks and len(blocks) > 100
