"""Sharding: determinism, coverage, balance and row splitting."""

import math
import random
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


@settings(max_examples=200, deadline=None)
@given(specs=specs_strategy, num_ps=st.integers(1, 5), limit=st.integers(1, 2000))
def test_every_row_of_every_variable_in_exactly_one_partition(specs, num_ps, limit):
    parts = sharding.plan(specs, num_ps, limit)
    for s in specs:
        mine = [p for p in parts if p.key == s.key]
        rows = s.shape[0] if s.shape else 1
        assert [p.partition for p in mine] == list(range(len(mine)))
        assert mine[0].row_begin == 0 and mine[-1].row_end == rows
        for a, b in zip(mine, mine[1:]):
            assert a.row_end == b.row_begin
        assert sum(p.nbytes for p in mine) == nbytes(s)
        assert all(0 <= p.ps_index < num_ps for p in mine)


@settings(max_examples=200, deadline=None)
@given(specs=specs_strategy, num_ps=st.integers(1, 5), limit=st.integers(1, 2000))
def test_split_sizes_respect_the_limit_and_differ_by_at_most_one_row(specs, num_ps, limit):
    for s in specs:
        mine = [p for p in sharding.plan([s], num_ps, limit)]
        rows = s.shape[0] if s.shape else 1
        row_bytes = nbytes(s) // rows if rows else 0
        if len(mine) > 1:
            sizes = [p.num_rows for p in mine]
            assert max(sizes) - min(sizes) <= 1
            # The fewest parts that keep every part within the limit.
            assert len(mine) == math.ceil(rows / max(1, limit // row_bytes))
        # Over the limit only when a single row is already over it.
        assert all(p.nbytes <= max(limit, row_bytes) for p in mine)


@settings(max_examples=200, deadline=None)
@given(specs=specs_strategy, num_ps=st.integers(1, 5), limit=st.integers(1, 2000))
def test_loads_differ_by_at_most_the_largest_partition(specs, num_ps, limit):
    parts = sharding.plan(specs, num_ps, limit)
    loads = [sum(p.nbytes for p in parts if p.ps_index == ps) for ps in range(num_ps)]
    assert max(loads) - min(loads) <= max(p.nbytes for p in parts)


def test_same_plan_whatever_the_declaration_order():
    specs = [spec(i, (random.Random(i).randint(1, 500), 7)) for i in range(30)]
    shuffled = specs[:]
    random.Random(1).shuffle(shuffled)
    assert sharding.plan(specs, 3, 1000) == sharding.plan(shuffled, 3, 1000)


def test_large_variable_is_split_into_near_equal_row_ranges():
    # 10 rows of 400 bytes, limit 1500: at most 3 rows a part -> 4 parts of 3, 3, 2, 2.
    parts = sharding.plan([spec(0, (10, 100))], 1, 1500)
    assert [(p.row_begin, p.row_end, p.nbytes) for p in parts] == [
        (0, 3, 1200), (3, 6, 1200), (6, 8, 800), (8, 10, 800)]


def test_vectors_split_by_elements_and_scalars_are_one_row():
    parts = sharding.plan([spec(0, (1000,)), spec(1, ())], 2, 1000)
    vector = [p for p in parts if p.key == 0]
    scalar = [(p.row_begin, p.row_end, p.nbytes) for p in parts if p.key == 1]
    assert [p.num_rows for p in vector] == [250] * 4
    assert scalar == [(0, 1, 4)]


def test_a_row_bigger_than_the_limit_stays_whole():
    parts = sharding.plan([spec(0, (2, 1000))], 1, 100)
    assert [(p.row_begin, p.row_end) for p in parts] == [(0, 1), (1, 2)]


def test_balance_on_a_typical_model():
    # An MLP: two big kernels, small biases; 2 PS tasks, 4 MiB partitions.
    specs = [spec(0, (4096, 1024)), spec(1, (1024,)), spec(2, (1024, 4096)), spec(3, (4096,)),
             spec(4, (4096, 10)), spec(5, (10,))]
    parts = sharding.plan(specs, 2)
    loads = [sum(p.nbytes for p in parts if p.ps_index == ps) for ps in range(2)]
    assert abs(loads[0] - loads[1]) <= sharding.DEFAULT_MAX_PARTITION_BYTES
    assert min(loads) > 0.45 * sum(loads)


def test_balanced_limit_spreads_one_dominant_kernel_over_every_ps():
    # The bench CNN: 4.2 of its 4.5 MB in one dense kernel. At 4 MiB
    # partitions one PS would hold 94% of it; at the balanced limit every PS
    # holds a fair share.
    specs = [spec(0, (3, 3, 3, 32)), spec(1, (32,)), spec(2, (3, 3, 32, 64)), spec(3, (64,)),
             spec(4, (4096, 256)), spec(5, (256,)), spec(6, (256, 10)), spec(7, (10,))]
    total = sum(nbytes(s) for s in specs)
    skewed = sharding.plan(specs, 2)
    assert max(sum(p.nbytes for p in skewed if p.ps_index == ps) for ps in range(2)) > 0.9 * total
    for num_ps in (2, 3, 4):
        limit = sharding.balanced_limit(specs, num_ps, sharding.DEFAULT_MAX_PARTITION_BYTES)
        assert limit == math.ceil(total / (sharding.PIECES_PER_PS * num_ps))
        parts = sharding.plan(specs, num_ps, limit)
        loads = [sum(p.nbytes for p in parts if p.ps_index == ps) for ps in range(num_ps)]
        assert max(loads) <= (1 + 1 / sharding.PIECES_PER_PS) * total / num_ps, loads
        assert {p.ps_index for p in parts if p.key == 4} == set(range(num_ps))
    assert sharding.balanced_limit(specs, 1, 1000) == 1000  # one PS: nothing to balance
    assert sharding.balanced_limit(specs, 2, 1000) == 1000  # never above the given limit


def test_owned_by_filters_in_plan_order():
    parts = sharding.plan([spec(0, (100, 10)), spec(1, (100, 10))], 2, 1000)
    owned = sharding.owned_by(parts, 1)
    assert owned and all(p.ps_index == 1 for p in owned)
    assert owned == sorted(owned, key=lambda p: (p.key, p.partition))


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_ps=0), "num_ps=0"),
    (dict(num_ps=1, max_partition_bytes=0), "max_partition_bytes=0"),
])
def test_bad_arguments_name_what_was_received(kwargs, message):
    with pytest.raises(ValueError, match=message):
        sharding.plan([spec(0, (3,))], **kwargs)


def test_bad_specs_name_what_was_received():
    with pytest.raises(ValueError, match="key=0"):
        sharding.plan([spec(0, (3,)), spec(0, (4,))], 1)
    with pytest.raises(ValueError, match=r"shape=\[-1\]"):
        sharding.plan([spec(0, (-1,))], 1)
    with pytest.raises(ValueError, match="int8"):
        sharding.plan([spec(0, (3,), "int8")], 1)
