"""The PS servicer and its wire parsing against hostile input, without a network.

NaN/Inf gradients (rejected whole, nothing summed), declarations that would
make the PS plan or allocate without bound (rejected before anything is
built), garbage that must not count as "another model" (which fails the job),
and push bytes that must be malformed rather than reach the servicer as
values of the wrong type. As in test_servicer.py the only double is
``Context``, a stand-in for grpc.ServicerContext that records the abort.
"""

import json
import math
import os
import struct
import time

os.environ.setdefault("TF_NUM_INTRAOP_THREADS", "1")
os.environ.setdefault("TF_NUM_INTEROP_THREADS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import grpc  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from prophet_tf import codec  # noqa: E402
import ps_helpers  # noqa: E402
from prophet_tf.ps import protocol, sharding  # noqa: E402
from prophet_tf.ps.servicer import ParameterServerServicer  # noqa: E402
from prophet_tf.ps.v1 import ps_pb2  # noqa: E402
from test_servicer import Aborted, Context  # noqa: E402  (the servicer tests' context)

pytestmark = pytest.mark.timeout(180)

W, LIMIT = 2, 32
# float32 kernel split in 3 element ranges; one variable of each other dtype.
SHAPES = {0: ("dense/kernel", (6, 4), "float32"), 1: ("wide", (3,), "float64"),
          2: ("half", (4,), "float16"), 3: ("brain", (2, 2), "bfloat16")}
DTYPES = {name: codec.to_numpy_dtype(name) for name in codec.SUPPORTED_DTYPES}
SGD1 = json.dumps({"module": "keras.optimizers", "class_name": "SGD",
                   "config": {"name": "SGD", "learning_rate": 1.0}, "registered_name": None})
CHECKED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
           grpc.StatusCode.FAILED_PRECONDITION}


def abort_of(call, request):
    """(code, details) of a call that must abort."""
    context = Context()
    with pytest.raises(Aborted):
        result = call(request, context)
        if hasattr(result, "__next__"):
            list(result)
    return context.code, context.details


def specs(shapes=SHAPES):
    return [ps_pb2.VariableSpec(key=k, name=n, shape=s, dtype=d, priority=k)
            for k, (n, s, d) in shapes.items()]


PLAN = sharding.plan(specs(), 1, LIMIT, spread=True)


def initial():
    return {k: (np.arange(math.prod(s)) % 5 - 2).astype(DTYPES[d]).reshape(s)
            for k, (_, s, d) in SHAPES.items()}


def register_request(worker_id=0, values=None, variables=None, **fields):
    chunks = []
    if values is not None:
        for p in PLAN:
            rows = sharding.elements(np.asarray(values[p.key]), p)
            chunks.append(ps_pb2.ParameterChunk(key=p.key, partition=p.partition,
                                                dtype=SHAPES[p.key][2], data=rows.tobytes()))
    fields = dict(dict(num_workers=W, optimizer_config=SGD1, max_partition_bytes=LIMIT),
                  **fields)
    return ps_pb2.RegisterRequest(worker_id=worker_id, initial_values=chunks,
                                  variables=specs() if variables is None else variables,
                                  **fields)


def gradients(step, worker):
    rng = np.random.default_rng(100 * step + worker)
    return {k: rng.integers(-4, 5, size=s).astype(DTYPES[d]) for k, (_, s, d) in SHAPES.items()}


def chunk(key, partition, step, array):
    array = np.asarray(array)
    return ps_pb2.GradientChunk(key=key, partition=partition, step=step,
                                dtype=codec.dtype_name(array.dtype), data=array.tobytes())


def step_chunks(step, worker):
    return [chunk(c.key, c.partition, c.step, c.array)
            for c in ps_helpers.gradient_chunks(gradients(step, worker), PLAN, step)]


def push(servicer, worker_id, chunks):
    return servicer.Push(ps_pb2.PushRequest(worker_id=worker_id, chunks=chunks),
                         Context()).duplicates


@pytest.fixture
def make_servicer():
    made = []

    def make(**kwargs):
        servicer = ParameterServerServicer(W, max_partition_bytes=LIMIT, **kwargs)
        made.append(servicer)
        return servicer

    yield make
    for servicer in made:
        servicer.close()


@pytest.fixture
def ready(make_servicer):
    """Both workers registered, SGD(lr=1), version 0."""
    servicer = make_servicer()
    servicer.Register(register_request(0, initial()), Context())
    servicer.Register(register_request(1), Context())
    return servicer


def state(servicer):
    with servicer._lock:
        return {k: (p.version, frozenset(p.arrived), _held(p))
                for k, p in servicer._parts.items()}


def assert_same_state(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k][:2] == b[k][:2], k
        assert a[k][2].keys() == b[k][2].keys(), k
        for worker, held in a[k][2].items():
            assert (held is None) == (b[k][2][worker] is None), (k, worker)
            if held is not None:
                np.testing.assert_array_equal(held, b[k][2][worker])


def with_bad_value(array, value, index=0):
    out = np.array(array, copy=True).reshape(-1)
    out[index] = value
    return out.reshape(np.shape(array))


def with_bits(array, bits, index=0):
    """``array`` with element ``index`` replaced by raw bits (NaN payloads)."""
    out = np.array(array, copy=True).reshape(-1)
    uint = {2: np.uint16, 4: np.uint32, 8: np.uint64}[out.dtype.itemsize]
    out.view(uint)[index] = bits
    return out.reshape(np.shape(array))


# --------------------------------------------------------------- NaN / Inf

@pytest.mark.parametrize("key", sorted(SHAPES))
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_nan_or_inf_gradient_is_rejected_whole_and_nothing_is_summed(ready, key, bad):
    servicer = ready
    before = state(servicer)
    chunks = step_chunks(0, 1)
    target = next(i for i, c in enumerate(chunks) if c.key == key)
    p = PLAN[target]
    good = np.frombuffer(chunks[target].data, DTYPES[SHAPES[key][2]])
    chunks[target] = chunk(p.key, p.partition, 0, with_bad_value(good, bad, index=good.size - 1))
    code, details = abort_of(servicer.Push, ps_pb2.PushRequest(worker_id=1, chunks=chunks))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    for fragment in (repr(SHAPES[key][0]), f"key={key}", f"partition={p.partition}",
                     "at step 0", "1 NaN or Inf", "nothing of it was summed",
                     "Received: worker_id=1, step=0"):
        assert fragment in details, details
    assert_same_state(before, state(servicer))
    # Nothing of the rejected push was recorded: the clean one counts in full.
    assert push(servicer, 1, step_chunks(0, 1)) == 0
    assert push(servicer, 0, step_chunks(0, 0)) == 0
    for p in PLAN:
        assert servicer_version(servicer, p) == 1


def servicer_version(servicer, p, timeout=30):
    """The partition's version once it is 1 (applied), or at the timeout."""
    def version():
        with servicer._lock:
            return servicer._parts[p.key, p.partition].version
    deadline = time.monotonic() + timeout
    while version() < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    return version()


@pytest.mark.parametrize("dtype, bits", [
    ("float32", 0x7F800001),  # signalling NaN
    ("float32", 0xFFC00000),  # negative quiet NaN
    ("float32", 0x7FFFFFFF),  # NaN with a full payload
    ("float64", 0x7FF0000000000001),
    ("float16", 0x7C01), ("float16", 0xFE00), ("float16", 0xFC00),  # NaNs, -Inf
    ("bfloat16", 0x7F81), ("bfloat16", 0xFFC0), ("bfloat16", 0x7F80),  # NaNs, +Inf
])
def test_every_nan_and_inf_encoding_is_caught(ready, dtype, bits):
    key = next(k for k, (_, _, d) in SHAPES.items() if d == dtype)
    p = next(p for p in PLAN if p.key == key)
    values = np.zeros(p.nbytes // DTYPES[dtype].itemsize, DTYPES[dtype])
    code, details = abort_of(ready.Push, ps_pb2.PushRequest(
        worker_id=0, chunks=[chunk(key, p.partition, 0, with_bits(values, bits, index=1))]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "NaN or Inf" in details


def test_largest_finite_values_are_accepted(ready):
    """Finite gradients whose sum would overflow are not mistaken for Inf."""
    servicer = ready
    chunks = []
    for p in PLAN:
        dtype = DTYPES[SHAPES[p.key][2]]
        big = ml_dtypes.finfo(dtype).max if dtype.itemsize == 2 else np.finfo(dtype).max
        chunks.append(chunk(p.key, p.partition, 0,
                            np.full(p.nbytes // dtype.itemsize, big, dtype)))
    assert push(servicer, 0, chunks) == 0
    with servicer._lock:
        assert all(part.arrived.keys() == {0} for part in servicer._parts.values())


def test_nan_in_one_chunk_rejects_the_good_chunks_of_the_same_push(ready):
    servicer = ready
    chunks = step_chunks(0, 0)
    last = PLAN[-1]
    values = np.frombuffer(chunks[-1].data, DTYPES[SHAPES[last.key][2]])
    chunks[-1] = chunk(last.key, last.partition, 0, with_bad_value(values, math.nan))
    before = state(servicer)
    code, _ = abort_of(servicer.Push, ps_pb2.PushRequest(worker_id=0, chunks=chunks))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert_same_state(before, state(servicer))
    assert push(servicer, 0, chunks[:-1]) == 0  # not duplicates: never counted


# --------------------------------------------------------------- Register

HUGE_SHAPES = [
    ([2**62, 2**62], LIMIT, "product overflows int64"),
    ([2**40], LIMIT, "more than 65536 partitions"),
    ([2**40, 2**20], 2**62, "more than 1 PS task(s) with this machine's memory"),
    ([1, 2**60], 2**62, "this machine's memory"),
    ([2**63 - 1, 0, 2**63 - 1], LIMIT, "product overflows int64"),
    ([0, 2**62, 2**62], LIMIT, "product overflows int64"),
    ([2] * 255, LIMIT, "more than 254 dimensions"),
    ([5, -1], LIMIT, "negative dimension"),
    ([-2**63], LIMIT, "negative dimension"),
]


@pytest.mark.parametrize("shape, limit, fragment", HUGE_SHAPES)
def test_huge_declared_shapes_are_rejected_before_allocating(make_servicer, shape, limit,
                                                             fragment):
    servicer = make_servicer()
    variables = specs() + [ps_pb2.VariableSpec(key=len(SHAPES), name="huge", shape=shape,
                                               dtype="float32")]
    # CPU time of this thread, not wall time: a busy machine stretches the
    # latter, while planning 2**40 rows one by one would take CPU hours.
    started = time.thread_time()
    code, details = abort_of(servicer.Register, register_request(
        1, variables=variables, max_partition_bytes=limit))
    assert time.thread_time() - started < 2.0  # nothing was planned row by row
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in details and "Received:" in details and len(details) < 1000, details
    assert servicer._model is None and servicer.failure is None
    servicer.Register(register_request(0, initial()), Context())  # a good one still works
    assert servicer._model is not None


def test_a_zero_size_variable_with_large_dimensions_is_accepted(make_servicer):
    servicer = make_servicer()
    variables = specs() + [ps_pb2.VariableSpec(key=len(SHAPES), name="empty",
                                               shape=[2**40, 0], dtype="float32")]
    response = servicer.Register(register_request(0, variables=variables), Context())
    assert (len(SHAPES), 0) in {(p.key, p.partition) for p in response.partitions}


@pytest.mark.parametrize("variables, fragment", [
    ([ps_pb2.VariableSpec(key=k, name="", shape=[], dtype="float32") for k in range(70000)],
     "more variables than a PS accepts"),
    (specs()[:-1] + [ps_pb2.VariableSpec(key=3, name="n" * 1025, shape=[2],
                                         dtype="bfloat16")], "more than 1024 characters"),
    (specs()[:-1] + [ps_pb2.VariableSpec(key=3, name="brain", shape=[2, 2],
                                         dtype="x" * 100000)], "unsupported dtype"),
    ([ps_pb2.VariableSpec(key=k, name="", shape=[], dtype="float32")
      for k in [*range(1000), 5000]], "Variable keys must be 0..n-1"),
])
def test_absurd_declarations_get_short_errors(make_servicer, variables, fragment):
    servicer = make_servicer()
    code, details = abort_of(servicer.Register, register_request(1, variables=variables))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in details and len(details) < 1000, details


BAD_OPTIMIZERS = [
    ("{", "must be the JSON"),
    ("[" * 100000, "must be the JSON"),  # RecursionError inside json
    ('{"class_name": "SGD", "config": []}', 'its "config" is not a dict'),
    ('{"class_name": "SGD", "config": {}, "prophet_tf_no_weight_decay": 5}',
     "not a list of variable keys"),
    ('{"class_name": "SGD", "config": {}, "prophet_tf_no_weight_decay": [[1]]}',
     "not a list of variable keys"),
    ('"' + "a" * (1 << 20) + '"', "longer than 1048576 characters"),
]


@pytest.mark.parametrize("text, fragment", BAD_OPTIMIZERS)
def test_a_malformed_optimizer_is_rejected_on_a_fresh_ps(make_servicer, text, fragment):
    servicer = make_servicer()
    code, details = abort_of(servicer.Register, register_request(0, initial(),
                                                                 optimizer_config=text))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and fragment in details, details
    assert servicer._model is None


@pytest.mark.parametrize("fields", [
    dict(optimizer_config=text) for text, _ in BAD_OPTIMIZERS] + [
    dict(max_partition_bytes=-1), dict(max_partition_bytes=-2**63),
    dict(variables=specs() + [ps_pb2.VariableSpec(key=4, name="x", shape=[2**40, 2**40],
                                                  dtype="float32")]),
    dict(variables=specs()[:-1] + [ps_pb2.VariableSpec(key=3, name="brain", shape=[2, -2],
                                                       dtype="bfloat16")]),
])
def test_garbage_from_a_worker_does_not_fail_the_job(ready, fields):
    """Only a well-formed declaration of another model fails the job."""
    servicer = ready
    code, _ = abort_of(servicer.Register, register_request(1, **fields))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert servicer.failure is None
    assert push(servicer, 0, step_chunks(0, 0)) == 0
    assert push(servicer, 1, step_chunks(0, 1)) == 0
    assert all(servicer_version(servicer, p) == 1 for p in PLAN)


# ------------------------------------------------------------ Push / Pull

def test_an_empty_push_is_invalid(ready):
    code, details = abort_of(ready.Push, ps_pb2.PushRequest(worker_id=1))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "at least one gradient chunk" in details


def test_a_long_dtype_is_quoted_short(ready):
    p = PLAN[0]
    bad = ps_pb2.GradientChunk(key=p.key, partition=p.partition, step=0, dtype="f" * 100000,
                               data=bytes(p.nbytes))
    code, details = abort_of(ready.Push, ps_pb2.PushRequest(worker_id=0, chunks=[bad]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "Wrong dtype" in details and "(100000 characters)" in details and len(details) < 800


def test_a_pull_of_more_items_than_owned_partitions_is_invalid(ready):
    items = [ps_pb2.KeyPartition(key=p.key, partition=p.partition) for p in PLAN] * 1000
    code, details = abort_of(ready.Pull, ps_pb2.PullRequest(worker_id=0, items=items))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"at most the {len(PLAN)} partitions" in details and f"{len(items)} items" in details


# ------------------------------------------------------------ wire parsing

def varint(value):
    return protocol._varint(value & ((1 << 64) - 1))


def field(number, wire_type, payload=b""):
    return varint(number << 3 | wire_type) + payload


GOOD_CHUNK = (field(1, 0, varint(0)) + field(2, 0, varint(3)) + field(3, 0, varint(1))
              + field(4, 2, varint(7) + b"float32") + field(5, 2, varint(4) + bytes(4)))


@pytest.mark.parametrize("message, fragment", [
    (field(1, 2, varint(1) + b"\x01") + field(2, 2, varint(len(GOOD_CHUNK)) + GOOD_CHUNK),
     "field 1 has wire type 2"),  # worker_id as bytes
    (field(2, 0, varint(5)), "field 2 has wire type 0"),  # a chunk as a varint
    (field(2, 2, varint(2) + field(5, 0, varint(7))), "field 5 has wire type 0"),  # data
    (field(2, 2, varint(2) + field(1, 1)[:1] + b"\x00"), "field 1 has wire type 1"),
    (field(2, 2, varint(2) + field(5, 2, varint(9))), "Truncated protobuf field 5"),
    (field(3, 2, varint(8) + struct.pack("<d", 0.1)), "field 3 has wire type 2"),  # lr
    (field(3, 5, bytes(4)), "field 3 has wire type 5"),
    (field(2, 2, varint(0)) * 70000, "More than 65600 protobuf fields"),
    (field(2, 2, varint(70 * 2) + field(1, 0, varint(0)) * 70), "More than 64 protobuf fields"),
    (field(0, 0, varint(0)), "Invalid protobuf field number 0"),
    (field(2**29, 0, varint(0)), "Invalid protobuf field number 536870912"),
    (field(1, 0, b"\xff" * 10 + b"\x01"), "more than 10 bytes"),
    (field(2, 2, varint(2**63)), "needs 9223372036854775808 bytes"),
])
def test_push_bytes_that_are_not_a_push_request_are_malformed(message, fragment):
    request = protocol.parse_push_request(message)
    assert request.malformed and fragment in request.malformed, request.malformed
    assert request.chunks == []


def test_a_ten_byte_varint_keeps_64_bits_like_protobuf():
    # 10 bytes can carry 70 bits; protobuf keeps the low 64.
    overlong = b"\xff" * 9 + b"\x7f"
    message = field(1, 0, overlong)
    assert protocol.parse_fields(message)[1] == -1
    assert ps_pb2.PushRequest.FromString(message).worker_id == -1


# One servicer serves every example (it is slow to build); each example checks
# what it must leave unchanged.
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                      HealthCheck.function_scoped_fixture])


@given(st.binary(max_size=300))
@settings(max_examples=300, **SETTINGS)
def test_random_push_bytes_never_raise_past_the_servicer(ready, data):
    request = protocol.parse_push_request(data)
    assert request.malformed or all(
        type(c.key) is int and type(c.step) is int and type(c.partition) is int
        and type(c.dtype) is str and isinstance(c.data, memoryview) for c in request.chunks)
    context = Context()
    try:
        ready.Push(request, context)
    except Aborted:
        assert context.code in CHECKED, context.details
    with ready._lock:  # random bytes never form a gradient the PS counts
        assert all(not p.arrived for p in ready._parts.values())


@given(st.lists(st.integers(-2**63, 2**63 - 1), max_size=6),
       st.sampled_from(codec.SUPPORTED_DTYPES), st.sampled_from([0, 1, LIMIT, 2**40, 2**62]))
@settings(max_examples=200, **SETTINGS)
def test_random_shapes_at_register_are_checked_fast(ready, shape, dtype, limit):
    """A worker declaring any shape gets an answer at once; a malformed one
    never fails the job (a well-formed other model does, by design)."""
    variables = specs() + [ps_pb2.VariableSpec(key=len(SHAPES), name="x", shape=shape,
                                               dtype=dtype)]
    failure = ready.failure
    context = Context()
    started = time.thread_time()  # CPU, not wall, time: see the test above
    with pytest.raises(Aborted):
        ready.Register(register_request(1, variables=variables, max_partition_bytes=limit),
                       context)
    assert time.thread_time() - started < 1.0
    assert context.code in (grpc.StatusCode.INVALID_ARGUMENT,
                            grpc.StatusCode.FAILED_PRECONDITION), context.details
    overflow = DTYPES[dtype].itemsize * math.prod(max(d, 1) for d in shape) >= 2**63
    if overflow or any(d < 0 for d in shape):
        assert context.code == grpc.StatusCode.INVALID_ARGUMENT, context.details
        assert ready.failure == failure


def _held(part):
    """The gradients a partition holds for its current iteration, by worker."""
    return {w: None if a is None else np.array(a[0]) for w, a in part.arrived.items()}
