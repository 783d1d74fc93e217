"""The simulator's shortcuts give what the straightforward computations give:
the event queue's order is one heap's, and the max-min levels' one-link rounds
are the matrix product's."""
from __future__ import annotations

import heapq
import math
import random

import numpy as np

from prophet_tf.bench import simulate_max_min
from prophet_tf.bench.simulate_events import EventQueue


class _Recording(EventQueue):
    def run(self):
        while (fn := self._pop_event()) is not None:
            fn()


def test_events_run_in_the_order_of_one_heap():
    """Events queued for now, later, and in sorted batches, from inside events:
    run in (time, place) order, as a single heap of every event would run them."""
    rng = random.Random(5)
    queue, ran = _Recording(), []
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
