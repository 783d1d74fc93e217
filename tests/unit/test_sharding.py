"""Sharding: determinism, coverage, balance, and both cutting rules."""

import math
import os
import random
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prophet_tf.bench import saved_profiles, simulate
from prophet_tf.ps import sharding


def spec(key, shape, dtype="float32"):
    return SimpleNamespace(key=key, shape=list(shape), dtype=dtype)


ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}

specs_strategy = st.lists(
    st.tuples(st.lists(st.integers(0, 40), min_size=0, max_size=3),
              st.sampled_from(sorted(ITEMSIZE))),
    min_size=1, max_size=12,
).map(lambda items: [spec(i, shape, dtype) for i, (shape, dtype) in enumerate(items)])


def nbytes(s):
    return ITEMSIZE[s.dtype] * math.prod(s.shape)


def loads(parts, num_ps):
    out = [0] * num_ps
    for p in parts:
        out[p.ps_index] += p.nbytes
    return out


@settings(max_examples=300, deadline=None)
@given(specs=specs_strategy, num_ps=st.integers(1, 9), limit=st.integers(1, 2000),
       spread=st.booleans())
def test_every_element_of_every_variable_in_exactly_one_partition(specs, num_ps, limit, spread):
    parts = sharding.plan(specs, num_ps, limit, spread=spread)
    assert parts == sorted(parts, key=lambda p: (p.key, p.partition))
    for s in specs:
        mine = [p for p in parts if p.key == s.key]
        assert [p.partition for p in mine] == list(range(len(mine)))
        assert mine[0].begin == 0 and mine[-1].end == math.prod(s.shape)
        for a, b in zip(mine, mine[1:]):
            assert a.end == b.begin and a.end > a.begin
        assert all(p.nbytes == p.num_elements * ITEMSIZE[s.dtype] for p in mine)
        assert all(0 <= p.ps_index < num_ps for p in mine)
    assert len(parts) <= sharding.max_partitions(specs, num_ps, limit)


@settings(max_examples=300, deadline=None)
@given(specs=specs_strategy, num_ps=st.integers(1, 9), limit=st.integers(1, 2000))
def test_whole_rule_cuts_only_what_exceeds_the_limit_into_even_ranges(specs, num_ps, limit):
    parts = sharding.plan(specs, num_ps, limit, spread=False)
    for s in specs:
        mine = [p for p in parts if p.key == s.key]
        count, itemsize = math.prod(s.shape), ITEMSIZE[s.dtype]
        if nbytes(s) <= limit:
            assert len(mine) == 1
        else:  # the fewest ranges within the limit (one element at the least)
            assert len(mine) == math.ceil(count / max(1, limit // itemsize))
        sizes = [p.num_elements for p in mine]
        assert max(sizes) - min(sizes) <= 1
        assert all(p.nbytes <= max(limit, itemsize) for p in mine)
        assert len({p.ps_index for p in mine}) == 1  # a variable's norms on one PS
    # LPT over variables: two PS loads differ by at most the largest variable.
    spread = loads(parts, num_ps)
    assert max(spread) - min(spread) <= max(nbytes(s) for s in specs)


@settings(max_examples=300, deadline=None)
@given(specs=specs_strategy, num_ps=st.integers(2, 9), limit=st.integers(1, 2000))
def test_spread_rule_gives_every_ps_the_same_bytes_to_a_few_elements(specs, num_ps, limit):
    parts = sharding.plan(specs, num_ps, limit, spread=True)
    total = sum(nbytes(s) for s in specs)
    pieces_per_ps = max(sharding.PIECES_PER_PS, math.ceil(total / (num_ps * limit)))
    # Each cut moves back by less than one element: each piece is off by less
    # than two elements, each PS by its pieces' sum of that.
    slack = pieces_per_ps * 2 * max(ITEMSIZE[s.dtype] for s in specs)
    for load in loads(parts, num_ps):
        assert abs(load - total / num_ps) <= slack


@pytest.mark.parametrize("model", sorted(os.path.splitext(f)[0]
                                         for f in os.listdir(saved_profiles.PROFILE_DIR)))
def test_every_bench_model_within_one_percent_on_1_to_128_ps(model):
    specs = simulate.specs_of(saved_profiles.load_profile(model))
    total = sum(nbytes(s) for s in specs)
    worst = []
    for num_ps in range(1, 129):
        parts = sharding.plan(specs, num_ps, sharding.DEFAULT_MAX_PARTITION_BYTES, spread=True)
        worst.append(max(loads(parts, num_ps)) / (total / num_ps))
        assert sum(p.nbytes for p in parts) == total
    assert max(worst) <= 1.01, (model, max(worst), worst.index(max(worst)) + 1)


def test_spread_puts_every_large_layer_on_every_ps_and_small_ones_whole():
    # The bench CNN: 4.2 of its 4.5 MB in one dense kernel.
    specs = [spec(0, (3, 3, 3, 32)), spec(1, (32,)), spec(2, (3, 3, 32, 64)), spec(3, (64,)),
             spec(4, (4096, 256)), spec(5, (256,)), spec(6, (256, 10)), spec(7, (10,))]
    whole = sharding.plan(specs, 2, spread=False)
    assert max(loads(whole, 2)) > 0.9 * sum(nbytes(s) for s in specs)
    for num_ps in (2, 3, 4, 16):
        parts = sharding.plan(specs, num_ps, spread=True)
        assert {p.ps_index for p in parts if p.key == 4} == set(range(num_ps))
        assert len([p for p in parts if p.key == 4]) >= sharding.PIECES_PER_PS * num_ps - 2
        assert len([p for p in parts if p.key == 7]) == 1
    # Pieces in turn: consecutive partitions of one variable on consecutive PS tasks.
    kernel = [p for p in sharding.plan(specs, 3, spread=True) if p.key == 4]
    assert [(b.ps_index - a.ps_index) % 3 for a, b in zip(kernel, kernel[1:])] == \
        [1] * (len(kernel) - 1)


def test_the_partition_limit_raises_the_piece_count_in_multiples_of_the_ps_count():
    # 100,000 bytes over 3 PS tasks at 1,000 bytes a piece: 34 pieces each.
    parts = sharding.plan([spec(0, (25_000,))], 3, 1000, spread=True)
    assert len(parts) == 3 * 34
    assert max(p.nbytes for p in parts) <= 1000
    per_ps = loads(parts, 3)
    assert sum(per_ps) == 100_000 and max(per_ps) - min(per_ps) <= 2 * 4, per_ps


def test_one_ps_is_the_whole_rule():
    specs = [spec(0, (10, 100)), spec(1, (7,))]
    assert sharding.plan(specs, 1, 1500, spread=True) == sharding.plan(specs, 1, 1500,
                                                                      spread=False)


def test_same_plan_whatever_the_declaration_order():
    specs = [spec(i, (random.Random(i).randint(1, 500), 7)) for i in range(30)]
    shuffled = specs[:]
    random.Random(1).shuffle(shuffled)
    for spread in (True, False):
        assert sharding.plan(specs, 3, 1000, spread=spread) == \
            sharding.plan(shuffled, 3, 1000, spread=spread)


def test_a_large_variable_is_cut_into_near_equal_element_ranges():
    # 1,000 elements of 4 bytes, limit 1,500: 3 ranges of 334, 333, 333.
    parts = sharding.plan([spec(0, (10, 100))], 1, 1500, spread=False)
    assert [(p.begin, p.end, p.nbytes) for p in parts] == [
        (0, 334, 1336), (334, 667, 1332), (667, 1000, 1332)]


def test_one_row_kernels_scalars_and_empty_variables():
    # A 1x1 convolution's kernel is one row: it is cut like any other variable.
    parts = sharding.plan([spec(0, (1, 1, 64, 256)), spec(1, ()), spec(2, (0, 3))], 4,
                          spread=True)
    assert len({p.ps_index for p in parts if p.key == 0}) == 4
    assert [(p.begin, p.end, p.nbytes) for p in parts if p.key == 1] == [(0, 1, 4)]
    assert [(p.begin, p.end, p.nbytes) for p in parts if p.key == 2] == [(0, 0, 0)]
    assert sharding.plan([spec(0, (0,)), spec(1, (0, 2))], 3, spread=True) == [
        sharding.Partition(0, 0, 2, 0, 0, 0), sharding.Partition(1, 0, 2, 0, 0, 0)]


def test_whole_shape_and_elements():
    import numpy as np

    array = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    whole = sharding.Partition(0, 0, 0, 0, 24, 96)
    part = sharding.Partition(0, 1, 0, 5, 11, 24)
    assert sharding.whole_shape(whole, (2, 3, 4)) == (2, 3, 4)
    assert sharding.whole_shape(part, (2, 3, 4)) == (6,)
    assert sharding.whole_shape(sharding.Partition(0, 0, 0, 0, 1, 4), ()) == ()
    assert sharding.elements(array, part).tolist() == list(range(5, 11))
    assert np.shares_memory(sharding.elements(array, part), array)


def test_owned_by_filters_in_plan_order():
    parts = sharding.plan([spec(0, (100, 10)), spec(1, (100, 10))], 2, 1000, spread=True)
    owned = sharding.owned_by(parts, 1)
    assert owned and all(p.ps_index == 1 for p in owned)
    assert owned == sorted(owned, key=lambda p: (p.key, p.partition))


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_ps=0), "num_ps=0"),
    (dict(num_ps=1, max_partition_bytes=0), "max_partition_bytes=0"),
])
def test_bad_arguments_name_what_was_received(kwargs, message):
    with pytest.raises(ValueError, match=message):
        sharding.plan([spec(0, (3,))], spread=True, **kwargs)


def test_bad_specs_name_what_was_received():
    with pytest.raises(ValueError, match="key=0"):
        sharding.plan([spec(0, (3,)), spec(0, (4,))], 1, spread=True)
    with pytest.raises(ValueError, match=r"shape=\[-1\]"):
        sharding.plan([spec(0, (-1,))], 1, spread=True)
    with pytest.raises(ValueError, match="int8"):
        sharding.plan([spec(0, (3,), "int8")], 1, spread=True)
