"""Prophet's profiler: burst detection, bandwidth estimation, drift (pure, no TF)."""

import random

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from prophet_tf.engine.schedulers import profiler

MS = 1_000_000


# -- split_bursts -------------------------------------------------------------------------

def test_split_bursts_edge_cases():
    assert profiler.split_bursts([]) == []
    assert profiler.split_bursts([5]) == [[0]]
    assert profiler.split_bursts([3, 3, 3]) == [[0, 1, 2]]
    # Two times: the only gap equals the mean, so it never splits.
    assert profiler.split_bursts([0, 100]) == [[0, 1]]


def test_split_bursts_sorts_and_splits_on_twice_the_mean_gap():
    times = [30, 0, 31, 1, 2, 32]  # bursts {0,1,2} and {30,31,32}; mean gap 6.4
    assert profiler.split_bursts(times) == [[1, 3, 4], [0, 2, 5]]


@settings(max_examples=150, deadline=None)
@given(times=st.lists(st.integers(0, 10**6), min_size=1, max_size=60))
def test_split_bursts_is_the_stated_rule(times):
    bursts = profiler.split_bursts(times)
    assert sorted(i for b in bursts for i in b) == list(range(len(times)))
    flat = [times[i] for b in bursts for i in b]
    assert flat == sorted(times)
    mean = (max(times) - min(times)) / (len(times) - 1) if len(times) > 1 else 0
    for a, b in zip(bursts, bursts[1:]):
        assert times[b[0]] - times[a[-1]] > 2 * mean  # every split is a big gap
    for b in bursts:
        for i, j in zip(b, b[1:]):
            assert times[j] - times[i] <= 2 * mean  # and every big gap is a split


# -- find_bursts ---------------------------------------------------------------------------

def bursty_iteration(rng, bursts, burst_times_ns, spread_ns, jitter_ns, origin):
    """{key: ready_ns}: the keys of burst j around burst_times_ns[j], plus jitter."""
    times = {}
    for keys, t in zip(bursts, burst_times_ns):
        for i, k in enumerate(keys):
            times[k] = origin + t + i * spread_ns // max(1, len(keys)) + rng.randint(0, jitter_ns)
    return times


def test_find_bursts_recovers_known_bursts_under_noise():
    rng = random.Random(1)
    bursts = [[9, 8, 7], [6, 5, 4, 3], [2, 1], [0]]
    at = [0, 10 * MS, 25 * MS, 40 * MS]
    iterations = [bursty_iteration(rng, bursts, at, 200_000, 300_000, rng.randint(0, 10**12))
                  for _ in range(5)]
    nbytes = {k: 1000 * (k + 1) for k in range(10)}
    found = profiler.find_bursts(iterations, nbytes)
    assert [set(s.keys) for s in found] == [set(k) for k in bursts]
    assert [s.nbytes for s in found] == [sum(nbytes[k] for k in keys) for keys in bursts]
    for s, gap in zip(found, [10 * MS, 15 * MS, 15 * MS, 0]):
        assert abs(s.gap_ns - gap) < 600_000
    assert found[-1].gap_ns == 0
    assert found[0].start_ns <= found[0].arrive_ns < found[1].start_ns


def test_find_bursts_one_burst_only():
    rng = random.Random(2)
    # Evenly spaced readiness (no pauses): one burst, whatever the jitter.
    iterations = [{k: k * MS + rng.randint(0, MS // 3) for k in range(12)} for _ in range(5)]
    found = profiler.find_bursts(iterations, {k: 4 for k in range(12)})
    assert len(found) == 1 and found[0].keys == frozenset(range(12))
    assert found[0].gap_ns == 0 and found[0].nbytes == 48


def test_find_bursts_single_huge_tensor():
    found = profiler.find_bursts([{7: 123}, {7: 456}, {7: 789}], {7: 10**10})
    assert found == [profiler.Burst(keys=frozenset({7}), start_ns=0, arrive_ns=0, gap_ns=0,
                                   nbytes=10**10)]


def test_find_bursts_huge_tensor_among_small_ones_does_not_change_bursts():
    # Bursts come from times only; a 1 GB tensor in the middle burst stays there.
    at = {0: 30, 1: 30, 2: 30, 3: 10, 4: 10, 5: 10, 6: 0, 7: 0, 8: 0}
    iterations = [{k: t * MS + k for k, t in at.items()}] * 3
    nbytes = {k: 10 for k in at} | {4: 10**9}
    found = profiler.find_bursts(iterations, nbytes)
    assert [sorted(s.keys) for s in found] == [[6, 7, 8], [3, 4, 5], [0, 1, 2]]
    assert found[1].nbytes == 10**9 + 20


def test_find_bursts_key_missing_from_an_iteration_is_placed_by_the_others():
    full = {0: 20 * MS, 1: 20 * MS, 2: 0, 3: 1}
    found = profiler.find_bursts([full, full, {0: 20 * MS, 2: 0, 3: 1}], {k: 1 for k in range(4)})
    assert [sorted(s.keys) for s in found] == [[2, 3], [0, 1]]
    assert abs(found[0].gap_ns - (20 * MS - 1)) <= 1


def test_find_bursts_rejects_bad_input():
    with pytest.raises(ValueError, match="Received: 2 iterations"):
        profiler.find_bursts([{}, {}], {})
    with pytest.raises(ValueError, match=r"keys=\[3\]"):
        profiler.find_bursts([{3: 0}], {})


@settings(max_examples=100, deadline=None)
@given(sizes=st.lists(st.integers(1, 6), min_size=1, max_size=8),
       gap=st.integers(5 * MS, 50 * MS), seed=st.integers(0, 2**32 - 1))
def test_find_bursts_finds_generated_bursts(sizes, gap, seed):
    rng = random.Random(seed)
    keys = iter(range(100))
    bursts = [[next(keys) for _ in range(n)] for n in sizes]
    at = [j * gap for j in range(len(bursts))]
    iterations = [bursty_iteration(rng, bursts, at, 100_000, 100_000, rng.randint(0, 10**9))
                  for _ in range(5)]
    medians = {k: sorted(it[k] - min(it.values()) for it in iterations)[2] for k in iterations[0]}
    times = sorted(medians.values())
    mean = (times[-1] - times[0]) / max(1, len(times) - 1)
    # The rule finds exactly these bursts when every pause between them is more
    # than twice the mean gap and no gap inside one is.
    inside = [b - a for keys in bursts for a, b in zip(sorted(medians[k] for k in keys),
                                                       sorted(medians[k] for k in keys)[1:])]
    assume(all(g <= 2 * mean for g in inside))
    assume(len(bursts) == 1 or gap - 300_000 > 2 * mean)
    found = profiler.find_bursts(iterations, {k: 1 for k in medians})
    assert [set(s.keys) for s in found] == [set(k) for k in bursts]
    assert all(abs(s.gap_ns - gap) < 300_000 for s in found[:-1])


# -- BandwidthEstimator -------------------------------------------------------------------

def test_bandwidth_constant_rate_is_exact():
    e = profiler.BandwidthEstimator()
    assert e.bytes_per_ns is None and e.samples == 0
    t = 0
    for n in [10, 1000, 5_000_000, 7]:
        e.add(n, t, t + n * 2)  # 0.5 bytes/ns
        t += n * 2 + 1000
    assert e.bytes_per_ns == pytest.approx(0.5)


def test_bandwidth_overlapping_transfers_count_busy_time_once():
    e = profiler.BandwidthEstimator()
    e.add(1000, 0, 1000)
    e.add(1000, 0, 2000)  # ran concurrently: the link was busy 2000 ns for 2000 bytes
    assert e.bytes_per_ns == pytest.approx(1.0)


def test_bandwidth_counts_the_union_when_a_later_push_ends_first():
    """Pushes in flight together finish in any order; the busy time is the
    union of their intervals whatever the order they are recorded in."""
    e = profiler.BandwidthEstimator()
    e.add(300, 2, 5)  # started after the next one, ended first
    e.add(1000, 0, 10)
    assert e.bytes_per_ns == pytest.approx(1300 / 10)  # not 1300 / 8
    e.add(700, 20, 30)  # a gap of idle link is not busy time
    e.add(100, 25, 40)
    assert e.bytes_per_ns == pytest.approx(2100 / (10 + 20))


def test_bandwidth_window_follows_a_change():
    e = profiler.BandwidthEstimator(window=4)
    t = 0
    for _ in range(4):
        e.add(1000, t, t + 1000)
        t += 1000
    for _ in range(4):
        e.add(1000, t, t + 2000)
        t += 2000
    assert e.bytes_per_ns == pytest.approx(0.5)
    assert e.samples == 4
    with pytest.raises(ValueError, match="window=0"):
        profiler.BandwidthEstimator(window=0)


# -- drift --------------------------------------------------------------------------------

def test_drifted():
    assert not profiler.drifted(119, 100)
    assert profiler.drifted(121, 100)
    assert profiler.drifted(79, 100)
    assert not profiler.drifted(0.5, 0.1, floor=1.0)  # jitter below the floor


def test_drift_detector_ignores_one_outlier_and_flags_a_lasting_change():
    d = profiler.DriftDetector(10.0, window=3)
    assert not d.observe(30.0)  # window not full
    assert not d.observe(10.0)
    assert not d.observe(10.0)  # median 10
    assert not d.observe(13.0)  # median 10
    assert d.observe(13.0)  # median 13: +30%
