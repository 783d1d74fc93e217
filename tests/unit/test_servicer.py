"""The PS servicer without a network: state, validation, sums, optimizer math.

The only test double is ``Context``, a stand-in for grpc.ServicerContext that
records the abort code; everything else (Keras, TF, protobuf) is real.
"""

import itertools
import json
import os
import threading
import time

os.environ.setdefault("TF_NUM_INTRAOP_THREADS", "1")
os.environ.setdefault("TF_NUM_INTEROP_THREADS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import grpc  # noqa: E402
import keras  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import ps_helpers  # noqa: E402
from prophet_tf import keras_optimizer, optimizer_policy  # noqa: E402
from prophet_tf.ps import aggregation, protocol, sharding  # noqa: E402
from prophet_tf.ps.protocol import PulledChunk  # noqa: E402
from prophet_tf.ps.servicer import ParameterServerServicer  # noqa: E402
from prophet_tf.ps.trace import PSTrace  # noqa: E402
from prophet_tf.ps.v1 import ps_pb2  # noqa: E402

pytestmark = pytest.mark.timeout(120)


class Aborted(Exception):
    pass


class Context:
    """Records ``abort`` like grpc.ServicerContext (which raises too)."""

    def __init__(self, timeout=10.0):
        self.deadline = time.monotonic() + timeout
        self.code = self.details = None

    def abort(self, code, details):
        self.code, self.details = code, details
        raise Aborted(code, details)

    def time_remaining(self):
        return max(0.0, self.deadline - time.monotonic())

    def is_active(self):
        return True


def expect_abort(call, request, code, *fragments, context=None):
    context = context or Context()
    with pytest.raises(Aborted):
        result = call(request, context)
        if hasattr(result, "__next__"):
            list(result)
    assert context.code == code, context.details
    for fragment in fragments:
        assert fragment in context.details
    return context.details


# A kernel split into 3 element ranges (limit 32 bytes = 8 float32 elements), a
# bias and a scalar, each one partition.
SHAPES = {0: ("dense/kernel", (6, 4)), 1: ("dense/bias", (4,)), 2: ("scale", ())}
LIMIT = 32


def specs(shapes=SHAPES, dtype="float32"):
    return [ps_pb2.VariableSpec(key=k, name=n, shape=s, dtype=dtype, priority=k)
            for k, (n, s) in shapes.items()]


def config(optimizer, variables=None):
    return keras_optimizer.config_json(optimizer, variables)


def raw_config(optimizer):
    """The optimizer as Keras serializes it, past the worker's policy checks."""
    return json.dumps(keras.optimizers.serialize(optimizer))


def initial(seed=0, shapes=SHAPES, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(dtype) for k, (_, s) in shapes.items()}


def plan(shapes=SHAPES):
    return sharding.plan(specs(shapes), 1, LIMIT, spread=True)


def register(servicer, worker_id, optimizer_config, values=None, variables=None,
             num_workers=None):
    variables = specs() if variables is None else variables
    chunks = []
    if values is not None:
        for p in sharding.plan(variables, 1, servicer.max_partition_bytes, spread=True):
            v = np.asarray(values[p.key])
            rows = sharding.elements(v, p)
            chunks.append(ps_pb2.ParameterChunk(key=p.key, partition=p.partition,
                                                dtype=variables[p.key].dtype,
                                                data=rows.tobytes()))
    request = ps_pb2.RegisterRequest(
        worker_id=worker_id, num_workers=num_workers or servicer.num_workers,
        variables=variables, optimizer_config=optimizer_config, initial_values=chunks)
    return servicer.Register(request, Context())


def grad_chunks(grads, step, partitions=None):
    partitions = plan() if partitions is None else partitions
    out = []
    for c in ps_helpers.gradient_chunks(grads, partitions, step):
        out.append(ps_pb2.GradientChunk(key=c.key, step=c.step, partition=c.partition,
                                        dtype=c.array.dtype.name, data=c.array.tobytes()))
    return out


def push(servicer, worker_id, chunks):
    return servicer.Push(ps_pb2.PushRequest(worker_id=worker_id, chunks=chunks),
                         Context()).duplicates


def pulled_chunks(messages) -> list:
    """The ParameterChunk of every Pull message (each holds one or more), in order."""
    return [c for message in messages for c in ps_pb2.ParameterChunks.FromString(message).chunks]


def pull(servicer, min_version, partitions=None, timeout=10.0, shapes=SHAPES):
    """Full arrays (key -> array) and versions after pulling every partition."""
    partitions = plan(shapes) if partitions is None else partitions
    request = ps_pb2.PullRequest(worker_id=0, min_version=min_version, items=[
        ps_pb2.KeyPartition(key=p.key, partition=p.partition) for p in partitions])
    chunks = pulled_chunks(servicer.Pull(request, Context(timeout)))
    # Each partition once, in any order: the PS sends each as it is applied.
    assert sorted((c.key, c.partition) for c in chunks) == sorted(
        (p.key, p.partition) for p in partitions)
    by_id = {(p.key, p.partition): p for p in partitions}
    out = {}
    for c in chunks:
        dtype = ml_dtypes.bfloat16 if c.dtype == "bfloat16" else np.dtype(c.dtype)
        shape = shapes[c.key][1]
        out.setdefault(c.key, np.zeros(shape, dtype))
        ps_helpers.write_chunk(PulledChunk(c.key, c.partition, c.version,
                                                    np.frombuffer(c.data, dtype)),
                              out, by_id)
    return out, {(c.key, c.partition): c.version for c in chunks}


@pytest.fixture
def make_servicer():
    made = []

    def make(num_workers=2, max_partition_bytes=LIMIT, **kwargs):
        servicer = ParameterServerServicer(num_workers, max_partition_bytes=max_partition_bytes,
                                           **kwargs)
        made.append(servicer)
        return servicer

    yield make
    for servicer in made:
        servicer.close()


@pytest.fixture
def ready(make_servicer):
    """W=2, SGD(lr=1), registered by both workers, version 0."""
    servicer = make_servicer()
    cfg = config(keras.optimizers.SGD(1.0))
    values = initial()
    register(servicer, 0, cfg, values)
    register(servicer, 1, cfg)
    return servicer, values


def ints(seed, scale=8):
    rng = np.random.default_rng(seed)
    return {k: rng.integers(-scale, scale, size=s).astype(np.float32)
            for k, (_, s) in SHAPES.items()}


# ---------------------------------------------------------------- Register

def test_register_lists_this_ps_partitions_and_version(make_servicer):
    servicer = make_servicer()
    response = register(servicer, 0, config(keras.optimizers.SGD(0.1)))
    assert (response.ps_index, response.num_ps, response.version) == (0, 1, 0)
    assert [(p.key, p.partition, p.begin, p.end) for p in response.partitions] == [
        (0, 0, 0, 8), (0, 1, 8, 16), (0, 2, 16, 24), (1, 0, 0, 4), (2, 0, 0, 1)]


def test_ps_keeps_only_its_own_partitions(make_servicer):
    servicer = make_servicer(ps_index=1, num_ps=2)
    response = register(servicer, 0, config(keras.optimizers.SGD(0.1)))
    both = sharding.plan(specs(), 2, LIMIT, spread=True)
    owned = sharding.owned_by(both, 1)
    assert [(p.key, p.partition) for p in response.partitions] == [
        (p.key, p.partition) for p in owned]
    assert 0 < len(owned) < len(both)
    not_owned = next(p for p in both if p.ps_index == 0)
    details = expect_abort(servicer.Pull, ps_pb2.PullRequest(items=[ps_pb2.KeyPartition(
        key=not_owned.key, partition=not_owned.partition)]), grpc.StatusCode.NOT_FOUND,
        "owned by PS 0")
    assert f"key={not_owned.key}" in details


@pytest.mark.parametrize("change, fragments", [
    (lambda v: v[0].shape.__setitem__(1, 5), ["Variable 0", "shape=[6, 4]", "shape=[6, 5]"]),
    (lambda v: setattr(v[1], "dtype", "float64"), ["Variable 1", "dtype=float32",
                                                  "dtype=float64"]),
    (lambda v: v.pop(), ["3 variables", "Received: 2 variables"]),
])
def test_a_worker_declaring_another_model_is_rejected(make_servicer, change, fragments):
    servicer = make_servicer()
    cfg = config(keras.optimizers.SGD(0.1))
    first = register(servicer, 0, cfg, initial())
    variables = specs()
    change(variables)
    request = ps_pb2.RegisterRequest(worker_id=1, num_workers=2, variables=variables,
                                     optimizer_config=cfg)
    expect_abort(servicer.Register, request, grpc.StatusCode.INVALID_ARGUMENT, *fragments)
    assert register(servicer, 1, cfg) == first  # nothing changed


def test_a_worker_with_another_optimizer_is_rejected(make_servicer):
    servicer = make_servicer()
    register(servicer, 0, config(keras.optimizers.SGD(0.1)))
    request = ps_pb2.RegisterRequest(worker_id=1, num_workers=2, variables=specs(),
                                     optimizer_config=config(keras.optimizers.SGD(0.2)))
    expect_abort(servicer.Register, request, grpc.StatusCode.INVALID_ARGUMENT,
                 "optimizer differs", '"learning_rate": 0.1', '"learning_rate": 0.2')


@pytest.mark.parametrize("fields, fragments", [
    (dict(worker_id=0, num_workers=3), ["num_workers=2", "Received: num_workers=3"]),
    (dict(worker_id=2, num_workers=2), ["worker_id=2"]),
    (dict(worker_id=0, num_workers=2, variables=[]), ["variables=[]"]),
    (dict(worker_id=0, num_workers=2, optimizer_config="{nope"), ["optimizer_config"]),
])
def test_malformed_register_is_rejected(make_servicer, fields, fragments):
    servicer = make_servicer()
    fields = {"variables": specs(), "optimizer_config": config(keras.optimizers.SGD(0.1)),
              **fields}
    expect_abort(servicer.Register, ps_pb2.RegisterRequest(**fields),
                 grpc.StatusCode.INVALID_ARGUMENT, *fragments)
    assert servicer._model is None


def test_initial_values_only_from_worker_0_and_checked(make_servicer):
    servicer = make_servicer()
    cfg = config(keras.optimizers.SGD(0.1))
    chunk = ps_pb2.ParameterChunk(key=1, partition=0, dtype="float32", data=b"\0" * 16)
    request = ps_pb2.RegisterRequest(worker_id=1, num_workers=2, variables=specs(),
                                     optimizer_config=cfg, initial_values=[chunk])
    expect_abort(servicer.Register, request, grpc.StatusCode.INVALID_ARGUMENT,
                 "Only worker 0", "worker_id=1")
    bad = ps_pb2.ParameterChunk(key=0, partition=2, dtype="float32", data=b"\0" * 28)
    request = ps_pb2.RegisterRequest(worker_id=0, num_workers=2, variables=specs(),
                                     optimizer_config=cfg, initial_values=[chunk, bad])
    expect_abort(servicer.Register, request, grpc.StatusCode.INVALID_ARGUMENT,
                 "expected 32 bytes", "Received: 28 bytes")
    assert servicer._model is None  # the whole request was rejected


class SGD(keras.optimizers.SGD):
    """A user's subclass under the built-in's name: the PS must not rebuild it as the built-in."""


REFUSED_BY_BOTH = [
    (lambda: SGD(0.1), "Received: optimizer class_name='SGD', module='test_servicer', "
                       "registered_name='SGD'"),
    (lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)),
     "Received: optimizer=LossScaleOptimizer"),
]


@pytest.mark.parametrize("optimizer, fragment", REFUSED_BY_BOTH)
def test_worker_and_ps_refuse_an_optimizer_with_the_same_message(make_servicer, optimizer,
                                                                  fragment):
    with pytest.raises(ValueError) as raised:
        config(optimizer())  # the worker's side, before it registers
    assert fragment in str(raised.value), str(raised.value)
    servicer = make_servicer()
    request = ps_pb2.RegisterRequest(worker_id=0, num_workers=2, variables=specs(),
                                     optimizer_config=raw_config(optimizer()))
    details = expect_abort(servicer.Register, request, grpc.StatusCode.INVALID_ARGUMENT,
                           fragment)
    assert details == str(raised.value)


def test_global_clipnorm_holds_a_step_until_every_partition_has_its_sum(make_servicer):
    servicer = make_servicer()
    values = initial(1)
    cfg = config(keras.optimizers.SGD(1.0, global_clipnorm=0.5))
    register(servicer, 0, cfg, values)
    register(servicer, 1, cfg)
    grads = {k: np.ones(s, np.float32) for k, (_, s) in SHAPES.items()}
    partitions = plan()
    for worker in range(2):
        push(servicer, worker, grad_chunks(grads, 0, partitions[:-1]))
    got, versions = pull(servicer, 0, timeout=0.5)
    assert set(versions.values()) == {0}  # Nothing applied: one sum is missing.
    assert servicer._norm_hold.pending() == {0: len(partitions) - 1}
    for worker in range(2):
        push(servicer, worker, grad_chunks(grads, 0, partitions[-1:]))
    got, versions = pull(servicer, 1)
    assert set(versions.values()) == {1}
    norm = np.sqrt(sum(np.sum(np.square(2 * g)) for g in grads.values()))
    for k in grads:
        np.testing.assert_allclose(got[k], values[k] - 2 * grads[k] * 0.5 / norm, rtol=1e-6)
    assert servicer._norm_hold.pending() == {}


# -------------------------------------------------------------- Push & sums

def test_two_workers_integer_gradients_sum_exactly(ready):
    servicer, values = ready
    expected = {k: v.copy() for k, v in values.items()}
    for step in range(3):
        g0, g1 = ints(10 + step), ints(20 + step)
        assert push(servicer, 0, grad_chunks(g0, step)) == 0
        got, versions = pull(servicer, step, timeout=0.5)  # not applied before worker 1
        assert set(versions.values()) == {step}
        assert push(servicer, 1, grad_chunks(g1, step)) == 0
        got, versions = pull(servicer, step + 1)
        assert set(versions.values()) == {step + 1}
        for k in expected:
            expected[k] = expected[k] - (g0[k] + g1[k])  # SGD, lr=1
            np.testing.assert_array_equal(got[k], expected[k])


def three_workers(make_servicer):
    """W=3, SGD(lr=1), registered by every worker, version 0."""
    servicer = make_servicer(num_workers=3)
    cfg = config(keras.optimizers.SGD(1.0))
    values = initial()
    for worker in range(3):
        register(servicer, worker, cfg, values if worker == 0 else None)
    return servicer, values


def with_rows(chunks, rows):
    for c in chunks:
        c.batch_rows = rows
    return chunks


# Workers' gradients whose sum depends on the order of the additions: in worker
# order (big - big) + small = small, but an order that adds small to one big
# first gives (big + small) - big = 0, as big + small rounds to big (2**30's
# float32 ulp is 128). 2**30 is a bfloat16 too.
ORDER_SENSITIVE = (2.0 ** 30, -2.0 ** 30, 1.0)

# Whole pushes in every worker order; then chunk by chunk, each its own request, in
# two shuffled orders (seeds): each partition sees its own order of the workers.
ARRIVALS = [*itertools.permutations(range(3)), "shuffled 0", "shuffled 1"]


def _arrive(servicer, arrival, chunks_of):
    """Pushes every worker's chunks of step 0 in `arrival` order."""
    if not isinstance(arrival, str):
        for worker in arrival:
            assert push(servicer, worker, chunks_of[worker]) == 0
        return
    pairs = [(w, c) for w in range(3) for c in chunks_of[w]]
    for i in np.random.default_rng(int(arrival.split()[1])).permutation(len(pairs)):
        worker, chunk = pairs[i]
        assert push(servicer, worker, [chunk]) == 0


@pytest.mark.parametrize("case", ["float32", "uneven rows", "bfloat16"])
def test_workers_are_summed_in_worker_order_whatever_the_arrival_order(make_servicer, case):
    """Every arrival order, whole pushes or chunk by chunk, applies the same bits: the sum
    of workers 0, 1, 2 in that order (float32 for bfloat16; weighted for uneven shares)."""
    dtype = ml_dtypes.bfloat16 if case == "bfloat16" else np.float32
    rows = [1, 1, 2] if case == "uneven rows" else [None] * 3
    shapes = SHAPES  # the scalar too, in bfloat16 as well
    grads = [{key: np.full(shape, g, dtype) for key, (_, shape) in shapes.items()}
             for g in ORDER_SENSITIVE]
    weights = aggregation.share_weights(rows) or [1.0] * 3
    total = np.float32(0)
    for g, weight in zip(ORDER_SENSITIVE, weights):  # worker order, in float32
        total = total + np.float32(g) * np.float32(weight)
    assert total == (1.5 if case == "uneven rows" else 1.0)
    results = []
    for arrival in ARRIVALS:
        servicer = make_servicer(num_workers=3)
        variables = specs(shapes, np.dtype(dtype).name)
        partitions = sharding.plan(variables, 1, LIMIT, spread=True)
        values = initial(shapes=shapes, dtype=dtype)
        for worker in range(3):
            register(servicer, worker, config(keras.optimizers.SGD(1.0)),
                     values if worker == 0 else None, variables=variables)
        chunks_of = [grad_chunks(grads[w], 0, partitions) for w in range(3)]
        if rows[0]:
            chunks_of = [with_rows(chunks, r) for chunks, r in zip(chunks_of, rows)]
        _arrive(servicer, arrival, chunks_of)
        assert len(chunks_of[0]) > 2  # a kernel split over partitions, a bias...
        got, versions = pull(servicer, 1, partitions, shapes=shapes)
        assert set(versions.values()) == {1}
        for key, value in values.items():
            expected = (value.astype(np.float32) - total).astype(dtype)  # SGD, lr=1
            np.testing.assert_array_equal(got[key], expected, err_msg=f"{arrival}")
        results.append({key: got[key].tobytes() for key in got})
    assert all(r == results[0] for r in results)  # bit for bit, whatever the arrival


def test_a_partition_holds_one_chunk_per_worker_until_its_sum_is_complete(make_servicer):
    """W chunks per partition at most, each a view of its push; none once applied."""
    servicer, _ = three_workers(make_servicer)
    for worker, arrived in ((2, 1), (0, 2)):
        push(servicer, worker, grad_chunks(ints(worker), 0))
        for part in servicer._parts.values():
            assert len(part.arrived) == arrived
            assert all(held[0].nbytes == part.plan.nbytes for held in part.arrived.values())
    push(servicer, 1, grad_chunks(ints(1), 0))
    pull(servicer, 1)
    for part in servicer._parts.values():
        assert part.arrived == {}


def test_a_train_step_s_gradients_are_weighted_by_each_worker_s_rows(make_servicer):
    """Keras divides each worker's mean loss by W: a share of 1 row of 4 weighs W/4."""
    servicer, values = three_workers(make_servicer)
    grads = [ints(30 + w) for w in range(3)]
    rows = [1, 1, 2]
    for worker in (2, 0, 1):
        push(servicer, worker, with_rows(grad_chunks(grads[worker], 0), rows[worker]))
    got, _ = pull(servicer, 1)
    for key, value in values.items():
        expected = value - sum(np.float32(3 * r / 4) * grads[w][key]
                               for w, r in enumerate(rows))
        np.testing.assert_allclose(got[key], expected, rtol=1e-6, atol=1e-6)
    # Equal shares, or rows from no worker (a custom loop): plain sums.
    for step, step_rows in ((1, [2, 2, 2]), (2, [None] * 3)):
        for worker in range(3):
            chunks = grad_chunks(grads[worker], step)
            push(servicer, worker, chunks if step_rows[worker] is None
                 else with_rows(chunks, step_rows[worker]))
        before, got = got, pull(servicer, step + 1)[0]
        for key in values:
            np.testing.assert_array_equal(got[key], before[key] - (
                (grads[0][key] + grads[1][key]) + grads[2][key]))


def test_negative_batch_rows_are_refused(make_servicer):
    servicer, _ = three_workers(make_servicer)
    before = state(servicer)
    expect_abort(servicer.Push, ps_pb2.PushRequest(worker_id=0, chunks=with_rows(
        grad_chunks(ints(1), 0), -1)), grpc.StatusCode.INVALID_ARGUMENT, "batch_rows=-1")
    assert same_state(before, state(servicer))


def test_duplicates_are_counted_not_summed(ready):
    servicer, values = ready
    g0, g1 = ints(1), ints(2)
    chunks = grad_chunks(g0, 0)
    assert push(servicer, 0, chunks + chunks[:2]) == 2  # twice in one request
    assert push(servicer, 0, chunks) == len(chunks)  # a retry of the pending step
    push(servicer, 1, grad_chunks(g1, 0))
    got, _ = pull(servicer, 1)
    assert push(servicer, 1, grad_chunks(g1, 0)) == len(chunks)  # a retry after the apply
    got_again, versions = pull(servicer, 1)
    assert set(versions.values()) == {1}
    for k in values:
        np.testing.assert_array_equal(got[k], values[k] - (g0[k] + g1[k]))
        np.testing.assert_array_equal(got_again[k], got[k])


def state(servicer):
    return {key: (p.version, frozenset(p.arrived), _held(p))
            for key, p in servicer._parts.items()}


def same_state(a, b):
    return a.keys() == b.keys() and all(
        a[k][:2] == b[k][:2] and a[k][2].keys() == b[k][2].keys()
        and all((x is None) == (y is None) and (x is None or np.array_equal(x, y))
                for x, y in zip(a[k][2].values(), b[k][2].values())) for k in a)


@pytest.mark.parametrize("mutate, code, fragments", [
    (lambda c: setattr(c, "key", 9), grpc.StatusCode.NOT_FOUND, ["key=9"]),
    (lambda c: setattr(c, "partition", 7), grpc.StatusCode.NOT_FOUND, ["partition=7"]),
    (lambda c: setattr(c, "dtype", "float64"), grpc.StatusCode.INVALID_ARGUMENT,
     ["expected float32", "dtype='float64'"]),
    (lambda c: setattr(c, "data", c.data[:-4]), grpc.StatusCode.INVALID_ARGUMENT,
     ["expected 16 bytes", "Received: 12 bytes"]),
    (lambda c: setattr(c, "step", 3), grpc.StatusCode.FAILED_PRECONDITION,
     ["too far ahead", "version 1", "step=3"]),
    (lambda c: setattr(c, "step", -1), grpc.StatusCode.FAILED_PRECONDITION,
     ["from the past", "version 1", "step=-1"]),
])
def test_bad_chunk_rejects_the_whole_request_and_changes_nothing(ready, mutate, code,
                                                                 fragments):
    servicer, _ = ready
    push(servicer, 0, grad_chunks(ints(0), 0))
    push(servicer, 1, grad_chunks(ints(1), 0))
    pull(servicer, 1)
    push(servicer, 1, grad_chunks(ints(2), 1)[:1])  # a pending sum to preserve
    before = state(servicer)
    chunks = grad_chunks(ints(3), 1)
    mutate(chunks[-2])  # a good chunk first, so a partial apply would show
    expect_abort(servicer.Push, ps_pb2.PushRequest(worker_id=0, chunks=chunks), code,
                 *fragments)
    assert same_state(before, state(servicer))
    assert push(servicer, 0, grad_chunks(ints(3), 1)) == 0  # none of it was counted


def test_worker_id_out_of_range_and_push_before_values(make_servicer):
    servicer = make_servicer()
    chunks = grad_chunks(ints(0), 0)
    expect_abort(servicer.Push, ps_pb2.PushRequest(worker_id=0, chunks=chunks),
                 grpc.StatusCode.FAILED_PRECONDITION, "Register first")
    register(servicer, 0, config(keras.optimizers.SGD(1.0)))
    expect_abort(servicer.Push, ps_pb2.PushRequest(worker_id=2, chunks=chunks),
                 grpc.StatusCode.INVALID_ARGUMENT, "worker_id=2")
    expect_abort(servicer.Push, ps_pb2.PushRequest(worker_id=0, chunks=chunks),
                 grpc.StatusCode.FAILED_PRECONDITION, "no initial value", "step=0")


def test_low_precision_gradients_are_summed_in_float32(make_servicer):
    servicer = make_servicer(num_workers=3)
    shapes = {0: ("w", (2,))}
    variables = specs(shapes, "bfloat16")
    register(servicer, 0, config(keras.optimizers.SGD(1.0)),
             {0: np.zeros(2, ml_dtypes.bfloat16)}, variables=variables)
    partitions = sharding.plan(variables, 1, LIMIT, spread=True)
    # 256 + 1 + 1: bfloat16 has 8 significant bits, so summing in bfloat16
    # gives 256 while float32 gives 258 (representable in bfloat16).
    for worker, value in enumerate([256.0, 1.0, 1.0]):
        push(servicer, worker, grad_chunks({0: np.full(2, value, ml_dtypes.bfloat16)}, 0,
                                           partitions))
    got, _ = pull(servicer, 1, partitions, shapes=shapes)
    np.testing.assert_array_equal(got[0].astype(np.float32), [-258.0, -258.0])


# -------------------------------------------------------------------- Pull

def test_pull_of_version_0_waits_for_the_initial_values(make_servicer):
    servicer = make_servicer()
    cfg = config(keras.optimizers.SGD(1.0))
    register(servicer, 1, cfg)
    result = {}
    thread = threading.Thread(target=lambda: result.update(got=pull(servicer, 0)))
    thread.start()
    time.sleep(0.3)
    assert "got" not in result
    values = initial()
    register(servicer, 0, cfg, values)
    thread.join(10)
    got, versions = result["got"]
    assert set(versions.values()) == {0}
    for k in values:
        np.testing.assert_array_equal(got[k], values[k])


def test_pull_waits_for_the_step_then_returns_it(ready):
    servicer, values = ready
    result = {}
    thread = threading.Thread(target=lambda: result.update(got=pull(servicer, 1)))
    thread.start()
    push(servicer, 0, grad_chunks(ints(0), 0))
    time.sleep(0.3)
    assert "got" not in result
    push(servicer, 1, grad_chunks(ints(1), 0))
    thread.join(10)
    assert set(result["got"][1].values()) == {1}


def test_pull_sends_each_partition_the_moment_it_is_applied(ready):
    # A pull names the most urgent partition first; that one's iteration-0
    # gradients are still missing, yet the pull hands over the one that is
    # applied at once, and the urgent one as soon as it is applied too.
    servicer, _ = ready
    parts = plan()
    urgent, late = parts[0], parts[-1]
    request = ps_pb2.PullRequest(worker_id=0, min_version=1, items=[
        ps_pb2.KeyPartition(key=p.key, partition=p.partition) for p in (urgent, late)])
    stream = servicer.Pull(request, Context(timeout=10))
    for worker in (0, 1):
        push(servicer, worker, grad_chunks(ints(worker), 0, [late]))
    [first] = pulled_chunks([next(stream)])  # the urgent one is not applied: not in it
    assert (first.key, first.partition, first.version) == (late.key, late.partition, 1)
    for worker in (0, 1):
        push(servicer, worker, grad_chunks(ints(worker), 0, [urgent]))
    [second] = pulled_chunks([next(stream)])
    assert (second.key, second.partition, second.version) == (urgent.key, urgent.partition, 1)
    assert list(stream) == []


def test_the_trace_places_each_partition_s_completion_apply_and_answer(make_servicer,
                                                                       tmp_path):
    trace = PSTrace(ps_index=0)
    servicer = make_servicer(trace=trace)
    cfg = config(keras.optimizers.SGD(1.0))
    register(servicer, 0, cfg, initial())
    register(servicer, 1, cfg)
    parts = plan()
    late = parts[-1]
    t0 = time.monotonic_ns() / 1e3
    push(servicer, 1, grad_chunks(ints(1), 0))
    push(servicer, 0, grad_chunks(ints(0), 0, [late]))  # worker 0 completes one only
    got = pull(servicer, 1, [late])[1]
    assert got == {(late.key, late.partition): 1}
    path = tmp_path / "ps-0.json"
    trace.write(str(path))
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "i"]
    by_kind = {}
    for e in events:
        by_kind.setdefault(e["cat"], []).append(e)
    # Only the partition both workers pushed is complete, by worker 0's push.
    assert [(e["args"]["key"], e["args"]["partition"], e["args"]["step"], e["args"]["worker"])
            for e in by_kind["complete"]] == [(late.key, late.partition, 0, 0)]
    assert [(e["args"]["key"], e["args"]["version"]) for e in by_kind["applied"]] == [
        (late.key, 1)]
    assert [(e["args"]["key"], e["args"]["version"], e["args"]["worker"])
            for e in by_kind["answered"]] == [(late.key, 1, 0)]
    # In that order, on the monotonic clock the workers' timelines use.
    complete, applied, answered = (by_kind[k][0]["ts"] for k in ("complete", "applied",
                                                                 "answered"))
    assert t0 <= complete <= applied <= answered <= time.monotonic_ns() / 1e3
    with pytest.raises(ValueError, match="kind must be one of"):
        trace.record("sent", servicer._parts[late.key, late.partition], 0)


def test_pull_deadline(ready):
    servicer, _ = ready
    context = Context(timeout=0.3)
    start = time.monotonic()
    request = ps_pb2.PullRequest(worker_id=0, min_version=1,
                                 items=[ps_pb2.KeyPartition(key=1, partition=0)])
    # Ended by its deadline (nothing else would end it: no push comes), not before.
    expect_abort(servicer.Pull, request, grpc.StatusCode.DEADLINE_EXCEEDED,
                 "version 0", "min_version=1", context=context)
    assert time.monotonic() - start > 0.25


@pytest.mark.parametrize("fields, code, fragment", [
    (dict(items=[ps_pb2.KeyPartition(key=5)]), grpc.StatusCode.NOT_FOUND, "key=5"),
    (dict(items=[ps_pb2.KeyPartition(key=0, partition=3)]), grpc.StatusCode.NOT_FOUND,
     "partition=3"),
    (dict(min_version=-1), grpc.StatusCode.INVALID_ARGUMENT, "min_version=-1"),
    (dict(worker_id=7), grpc.StatusCode.INVALID_ARGUMENT, "worker_id=7"),
])
def test_bad_pull_requests(ready, fields, code, fragment):
    servicer, _ = ready
    expect_abort(servicer.Pull, ps_pb2.PullRequest(**fields), code, fragment)


def test_a_pull_message_carries_the_ready_partitions_after_its_first_up_to_the_pack_limit(
        ready, monkeypatch):
    servicer, _ = ready
    parts = plan()  # kernel 0-2, bias, scale: in this order of urgency
    request = ps_pb2.PullRequest(worker_id=0, min_version=0, items=[
        ps_pb2.KeyPartition(key=p.key, partition=p.partition) for p in parts])
    answers = [protocol.encode_pull_entry(p.key, p.partition, 0, "float32",
                                          np.zeros(p.end - p.begin, np.float32))
               for p in parts]
    # Room for two answers after each message's first (all but the scale's
    # are the same size), so the third does not fit: messages of 3 and 2.
    monkeypatch.setattr(protocol, "PULL_PACK_BYTES", len(answers[1]) + len(answers[2]))
    messages = list(servicer.Pull(request, Context()))
    assert [len(ps_pb2.ParameterChunks.FromString(m).chunks) for m in messages] == [3, 2]
    assert [(c.key, c.partition) for c in pulled_chunks(messages)] == [
        (p.key, p.partition) for p in parts]
    assert [len(m) for m in messages] == [sum(map(len, answers[:3])), sum(map(len, answers[3:]))]
    # With no room, every partition is a message of its own.
    monkeypatch.setattr(protocol, "PULL_PACK_BYTES", 0)
    assert [len(ps_pb2.ParameterChunks.FromString(m).chunks)
            for m in servicer.Pull(request, Context())] == [1] * len(parts)


def test_a_pack_skips_partitions_not_yet_applied_and_never_waits_for_them(ready):
    servicer, _ = ready
    parts = plan()
    urgent, rest = parts[0], parts[1:]
    request = ps_pb2.PullRequest(worker_id=0, min_version=1, items=[
        ps_pb2.KeyPartition(key=p.key, partition=p.partition) for p in parts])
    stream = servicer.Pull(request, Context(timeout=10))
    for worker in (0, 1):
        push(servicer, worker, grad_chunks(ints(worker), 0, rest))
    pull(servicer, 1, rest)  # returns once every one of them is applied
    first = pulled_chunks([next(stream)])  # all of them: the urgent one is not applied
    assert [(c.key, c.partition) for c in first] == [(p.key, p.partition) for p in rest]
    for worker in (0, 1):
        push(servicer, worker, grad_chunks(ints(worker), 0, [urgent]))
    assert [(c.key, c.partition) for c in pulled_chunks(stream)] == [(urgent.key, 0)]


def test_versions_are_serialized_once_and_shared(ready):
    servicer, _ = ready
    request = ps_pb2.PullRequest(items=[ps_pb2.KeyPartition(key=0, partition=1)])
    first = next(servicer.Pull(request, Context()))
    second = next(servicer.Pull(request, Context()))
    assert first is second


# --------------------------------------------------- optimizer equals Keras

def lr_schedule():
    return keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=2, decay_rate=0.5)


def adamw_without_bias_decay():
    optimizer = keras.optimizers.AdamW(0.05, weight_decay=0.2)
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    return optimizer


@pytest.mark.parametrize("make_optimizer", [
    lambda: keras.optimizers.SGD(0.1),
    lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    lambda: keras.optimizers.Adam(0.01),
    lambda: keras.optimizers.Adam(lr_schedule()),
    lambda: keras.optimizers.RMSprop(0.01, rho=0.8),
    adamw_without_bias_decay,
    # Clipping of the summed gradient: clipvalue on the split kernel's element
    # ranges; clipnorm by the norm of all of the kernel's.
    lambda: keras.optimizers.SGD(0.1, momentum=0.9, clipvalue=0.5),
    lambda: keras.optimizers.Adam(0.05, clipnorm=1.0),
    # global_clipnorm: one norm over the split kernel's element ranges and the rest.
    lambda: keras.optimizers.SGD(0.1, momentum=0.9, global_clipnorm=1.0),
    # Every other built-in optimizer, on the split kernel where it is exact.
    lambda: keras.optimizers.SGD(0.1, momentum=0.5, weight_decay=0.01),
    lambda: keras.optimizers.Adam(0.01, amsgrad=True),
    lambda: keras.optimizers.RMSprop(0.01, momentum=0.5, centered=True),
    lambda: keras.optimizers.Adagrad(0.1, initial_accumulator_value=0.2),
    lambda: keras.optimizers.Adadelta(1.0, rho=0.9),
    lambda: keras.optimizers.Adamax(0.01),
    lambda: keras.optimizers.Ftrl(0.1, l1_regularization_strength=0.01,
                                  l2_regularization_strength=0.02, beta=0.1),
    lambda: keras.optimizers.Lion(0.001, beta_1=0.8),
    # Nadam's u_product advances once per step over the three element ranges.
    lambda: keras.optimizers.Nadam(0.01),
    lambda: keras.optimizers.Nadam(lr_schedule(), weight_decay=0.01),
    # Norms or factored moments over each variable: every variable whole.
    lambda: keras.optimizers.Lamb(0.01),
    lambda: keras.optimizers.Adafactor(0.1),
    # The average of every 2 (3) steps' sums, each partition's accumulated apart.
    lambda: keras.optimizers.SGD(0.1, momentum=0.9, gradient_accumulation_steps=2),
    lambda: keras.optimizers.Nadam(lr_schedule(), clipvalue=0.5, gradient_accumulation_steps=3),
], ids=["sgd", "momentum", "adam", "adam-schedule", "rmsprop", "adamw-decay",
        "momentum-clipvalue", "adam-clipnorm", "momentum-global-clipnorm",
        "momentum-weight-decay", "adam-amsgrad", "rmsprop-centered", "adagrad", "adadelta",
        "adamax", "ftrl", "lion", "nadam", "nadam-schedule-decay", "lamb", "adafactor",
        "momentum-accumulate-2", "nadam-schedule-clipvalue-accumulate-3"])
def test_updates_equal_single_process_keras(make_servicer, make_optimizer):
    _check_updates_equal_single_process_keras(make_servicer, make_optimizer)


@pytest.mark.parametrize("make_optimizer", [
    lambda: keras.optimizers.Lamb(0.01),
    lambda: keras.optimizers.Lamb(lr_schedule(), weight_decay=0.01),
    lambda: keras.optimizers.Lamb(0.01, global_clipnorm=1.0),
    lambda: keras.optimizers.Lamb(0.01, clipnorm=0.5, gradient_accumulation_steps=2),
], ids=["lamb", "lamb-schedule-decay", "lamb-global-clipnorm", "lamb-clipnorm-accumulate-2"])
def test_lamb_takes_its_ratio_over_every_partition_of_a_cut_variable(make_servicer,
                                                                      make_optimizer):
    """dense/kernel in three element ranges: each moves by the whole variable's trust
    ratio (prophet_tf.ps.lamb), as Keras' Lamb moves the whole variable."""
    _check_updates_equal_single_process_keras(make_servicer, make_optimizer, limit=LIMIT,
                                              cut=SHAPES[0][0])


@pytest.mark.parametrize("make_optimizer", [
    lambda: keras.optimizers.Adafactor(0.1),
    lambda: keras.optimizers.Adafactor(lr_schedule(), weight_decay=0.01),
    lambda: keras.optimizers.Adafactor(0.1, global_clipnorm=1.0),
    lambda: keras.optimizers.Adafactor(0.1, clipnorm=0.5, gradient_accumulation_steps=2),
], ids=["adafactor", "adafactor-schedule-decay", "adafactor-global-clipnorm",
        "adafactor-clipnorm-accumulate-2"])
def test_adafactor_applies_a_cut_variable_whole(make_servicer, make_optimizer):
    """dense/kernel in three element ranges: applied as one matrix once all three
    sums of a step are in (prophet_tf.ps.whole_apply), with its row and column
    moments over the whole matrix, as Keras' Adafactor."""
    _check_updates_equal_single_process_keras(make_servicer, make_optimizer, limit=LIMIT,
                                              cut=SHAPES[0][0])


@pytest.mark.parametrize("name", sorted(optimizer_policy.SUPPORTED_OPTIMIZERS))
def test_every_builtin_optimizer_with_a_schedule_and_weight_decay(make_servicer, name):
    """Each optimizer the policy supports, its rate from a schedule and decaying weights."""
    _check_updates_equal_single_process_keras(
        make_servicer, lambda: getattr(keras.optimizers, name)(lr_schedule(), weight_decay=0.01))


def test_the_policy_names_every_keras_builtin_optimizer():
    """Supported, or refused with a reason; LossScaleOptimizer is the workers' (its
    inner optimizer is what they register)."""
    builtin = {name for name, cls in vars(keras.optimizers).items()
               if isinstance(cls, type) and issubclass(cls, keras.optimizers.Optimizer)
               and cls is not keras.optimizers.Optimizer}
    assert builtin - set(optimizer_policy.SUPPORTED_OPTIMIZERS) == {
        "LossScaleOptimizer", *optimizer_policy.UNSUPPORTED_OPTIMIZERS}
    with pytest.raises(ValueError, match="cannot apply Muon: .*path and shape"):
        config(keras.optimizers.Muon())


def _check_updates_equal_single_process_keras(make_servicer, make_optimizer, limit=None,
                                              cut=None):
    """Two workers' pushes for 4 steps, against Keras applying their sum to whole variables
    (``cut``: the name of a variable that must be in several partitions)."""
    optimizer = make_optimizer()
    if limit is None:
        whole = optimizer_policy.needs_whole_variables(keras.optimizers.serialize(optimizer))
        limit = 1 << 20 if whole else LIMIT
    partitions = sharding.plan(specs(), 1, limit, spread=True)
    if cut is not None:
        key = next(k for k, (name, _) in SHAPES.items() if name == cut)
        assert sum(p.key == key for p in partitions) > 1
    servicer = make_servicer(max_partition_bytes=limit)
    reference_vars, reference, reference_apply, cfg = start_against_keras(
        servicer, make_optimizer, initial(3))
    if reference.weight_decay:  # the PS exempts what Keras exempts (AdamW's bias, below)
        exempt = [k for k, v in enumerate(reference_vars) if not reference._use_weight_decay(v)]
        assert json.loads(cfg).get("prophet_tf_no_weight_decay", []) == exempt
    rng = np.random.default_rng(7)
    for step in range(4):
        grads = [{k: rng.standard_normal(s).astype(np.float32) for k, (_, s) in SHAPES.items()}
                 for _ in range(2)]
        push(servicer, 1, grad_chunks(grads[1], step, partitions))
        push(servicer, 0, grad_chunks(grads[0], step, partitions))
        reference_apply([grads[0][k] + grads[1][k] for k in SHAPES])
        got, versions = pull(servicer, step + 1, partitions)
        assert set(versions.values()) == {step + 1}
        for k, variable in enumerate(reference_vars):
            np.testing.assert_allclose(got[k], variable.numpy(), rtol=1e-6, atol=1e-7,
                                       err_msg=f"{SHAPES[k][0]} at step {step}")


def start_against_keras(servicer, make_optimizer, values, make_config=config):
    """Registers two workers with ``make_optimizer()`` and initial ``values``; returns
    Keras' reference: ``(variables, optimizer built on them, its apply, the config)``.
    The apply is traced, as in ``fit``'s train step: eager ops round differently
    (Ftrl by up to 4e-6 relative on the whole variable, with nothing partitioned)."""
    reference_vars = [keras.Variable(values[k], name=name.split("/")[-1])
                      for k, (name, _) in SHAPES.items()]
    reference = make_optimizer()
    reference.build(reference_vars)
    cfg = make_config(make_optimizer(), reference_vars)
    register(servicer, 0, cfg, values)
    register(servicer, 1, cfg)
    reference_apply = tf.function(lambda grads: reference.apply(grads, reference_vars),
                                  autograph=False)
    return reference_vars, reference, reference_apply, cfg


def test_learning_rates_sent_with_pushes_are_applied_per_step(make_servicer):
    """A callback's rate reaches the PS with each step's pushes; the PS sets
    the optimizer only when the rate changes, so a change, a repeat and a
    return to an earlier rate must all be applied as Keras applies them."""
    servicer = make_servicer()
    values = initial(5)
    reference_vars = [keras.Variable(values[k]) for k in SHAPES]
    reference = keras.optimizers.SGD(0.1, momentum=0.9)
    reference.build(reference_vars)
    cfg = config(keras.optimizers.SGD(0.1, momentum=0.9), reference_vars)
    register(servicer, 0, cfg, values)
    register(servicer, 1, cfg)
    rng = np.random.default_rng(11)
    for step, rate in enumerate([0.1, 0.1, 0.025, 0.025, 0.1, 0.5]):
        grads = [{k: rng.standard_normal(s).astype(np.float32) for k, (_, s) in SHAPES.items()}
                 for _ in range(2)]
        for wid in (1, 0):
            servicer.Push(ps_pb2.PushRequest(worker_id=wid, learning_rate=rate,
                                             chunks=grad_chunks(grads[wid], step)), Context())
        reference.learning_rate = rate
        reference.apply([grads[0][k] + grads[1][k] for k in SHAPES], reference_vars)
        got, _ = pull(servicer, step + 1)
        for k, variable in enumerate(reference_vars):
            np.testing.assert_allclose(got[k], variable.numpy(), rtol=1e-6, atol=1e-7,
                                       err_msg=f"{SHAPES[k][0]} at step {step}, rate {rate}")


# ------------------------------------------------------------- wire format

def test_malformed_push_bytes_are_invalid_argument(ready):
    servicer, _ = ready
    request = protocol.parse_push_request(b"\x12\xff\x01abc")  # a chunk longer than the message
    assert request.malformed
    expect_abort(servicer.Push, request, grpc.StatusCode.INVALID_ARGUMENT,
                 "not a PushRequest", "needs 255 bytes", "(6 bytes)")


def test_a_conflicting_model_fails_the_waiting_pulls_of_the_others(make_servicer):
    # Workers that disagree on the model can never finish a step: the worker
    # already waiting learns it at once instead of at its deadline.
    servicer = make_servicer()
    cfg = config(keras.optimizers.SGD(0.1))
    register(servicer, 0, cfg, initial())
    variables = specs()
    variables[0].shape[1] = 5
    request = ps_pb2.RegisterRequest(worker_id=1, num_workers=2, variables=variables,
                                     optimizer_config=cfg)
    expect_abort(servicer.Register, request, grpc.StatusCode.INVALID_ARGUMENT, "Variable 0")
    pull = ps_pb2.PullRequest(worker_id=0, min_version=1,
                              items=[ps_pb2.KeyPartition(key=0, partition=0)])
    expect_abort(servicer.Pull, pull,
                 grpc.StatusCode.FAILED_PRECONDITION, "worker 1 declared another model",
                 "shape=[6, 5]")


def test_pulls_waiting_per_worker_are_bounded_and_freed_when_they_end(ready):
    """Pulls of a version that never comes cannot tie up the server's threads."""
    from prophet_tf.ps.pulls import MAX_PULLS_PER_WORKER
    servicer, _ = ready
    request = ps_pb2.PullRequest(worker_id=1, min_version=99, items=[
        ps_pb2.KeyPartition(key=1, partition=0)])
    contexts = [Context(timeout=2.0) for _ in range(MAX_PULLS_PER_WORKER)]
    outcomes = []

    def wait(context):
        try:
            list(servicer.Pull(request, context))
        except Aborted as e:
            outcomes.append(e.args[0])

    threads = [threading.Thread(target=wait, args=(c,)) for c in contexts]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while servicer._pulls[1] < MAX_PULLS_PER_WORKER and time.monotonic() < deadline:
        time.sleep(0.01)
    expect_abort(servicer.Pull, request, grpc.StatusCode.RESOURCE_EXHAUSTED,
                 f"worker 1 already has {MAX_PULLS_PER_WORKER} pulls in progress")
    # Another worker is not affected, and neither is worker 1 once its pulls end.
    assert pull(servicer, 0)[1]
    for t in threads:
        t.join(10)
    assert outcomes == [grpc.StatusCode.DEADLINE_EXCEEDED] * MAX_PULLS_PER_WORKER
    assert servicer._pulls[1] == 0
    request.min_version = 0
    assert len(list(servicer.Pull(request, Context()))) == 1


def test_rejections_are_logged_at_most_once_per_interval_with_a_count(ready, caplog):
    servicer, _ = ready
    bad = ps_pb2.HeartbeatRequest(worker_id=7)
    with caplog.at_level("INFO", logger="prophet_tf.ps.servicer"):
        for _ in range(50):
            expect_abort(servicer.Heartbeat, bad, grpc.StatusCode.INVALID_ARGUMENT, "worker_id")
    lines = [r.getMessage() for r in caplog.records if "rejected" in r.getMessage()]
    assert len(lines) == 1 and "Heartbeat from worker 7 rejected" in lines[0], lines
    servicer._rejections._last["Heartbeat"] -= servicer._rejections.INTERVAL_S
    with caplog.at_level("INFO", logger="prophet_tf.ps.servicer"):
        expect_abort(servicer.Heartbeat, bad, grpc.StatusCode.INVALID_ARGUMENT, "worker_id")
    assert "(49 more Heartbeat rejections not logged)" in caplog.records[-1].getMessage()


def _held(part):
    """The gradients a partition holds for its current iteration, by worker."""
    return {w: None if a is None else np.array(a[0]) for w, a in part.arrived.items()}
