"""The engine's checks on what a PS sends back, against the real op runtime.

A pulled chunk is staged only when it is the partition the engine asked for,
at the version asked for or later, with that partition's dtype and size; any
other chunk fails with a message naming both, and nothing is staged.
"""
import threading

import numpy as np
import pytest
import tensorflow as tf

from prophet_tf import _native
from prophet_tf.engine import schedulers
from prophet_tf.engine.delivery import Assembler
from prophet_tf.engine.dispatch import Dispatch
from prophet_tf.engine.gradients_out import GradientsOut
from prophet_tf.ps import sharding
from prophet_tf.ps.client import PulledChunk
from prophet_tf.ps.v1 import ps_pb2

pytestmark = pytest.mark.timeout(60)

NATIVE_KEY = 7  # the op library's key of PS key 0
SHAPE = (4, 3)  # 12 elements of 4 bytes, in two partitions of 6


def make_dispatch(name="p3"):
    # 24-byte slices cut the variable into two partitions (not balanced
    # further: the tests name the two), both on PS 0 (the whole rule keeps a
    # variable's partitions together).
    specs = [ps_pb2.VariableSpec(key=0, name="w", shape=SHAPE, dtype="float32", priority=0)]
    options = {"slice_bytes": 24} if name == "p3" else {}
    return Dispatch([NATIVE_KEY], specs, 2, schedulers.make_scheduler(name, **options),
                    balance=False)


@pytest.fixture
def engine():
    _native.reset()
    _native.declare_param(NATIVE_KEY, tf.float32, SHAPE)
    dispatch = make_dispatch()
    parts = dispatch.partitions_of[0]
    assert parts == [sharding.Partition(0, 0, 0, 0, 6, 24), sharding.Partition(0, 1, 0, 6, 12, 24)]
    yield Assembler(_native, dispatch), parts
    _native.reset()


def chunk(partition, version, rows=2, dtype=np.float32, key=0):
    values = np.arange(rows * 3, dtype=dtype) + 100 * partition + version
    return PulledChunk(key, partition, version, values)


def staged(version):
    return _native.await_param(version, key=NATIVE_KEY, dtype=tf.float32, shape=SHAPE).numpy()


def test_partitions_are_assembled_and_published_once_all_arrived(engine):
    e, parts = engine
    e.deliver(chunk(1, 3), parts[1], 3)  # in any order
    assert _native.param_version(NATIVE_KEY) is None
    e.deliver(chunk(0, 4), parts[0], 3)  # a newer version is fine
    np.testing.assert_array_equal(
        staged(3), np.concatenate([chunk(0, 4).array, chunk(1, 3).array]).reshape(SHAPE))
    assert e.open_versions == 0


@pytest.mark.parametrize("bad,message", [
    (chunk(1, 3), "expected key 0 partition 0 at version >= 3. Received: key 0 partition 1"),
    (chunk(0, 3, key=1), "Received: key 1 partition 0"),
    (chunk(0, 2), "Received: key 0 partition 0 version 2"),
    (chunk(0, 3, rows=3), "with 36 bytes of float32; the partition holds 24 bytes"),
    (chunk(0, 3, rows=1), "with 12 bytes of float32; the partition holds 24 bytes"),
    (chunk(0, 3, dtype=np.float64), "48 bytes of float64"),
    (chunk(0, 3, rows=4, dtype=np.float16), "24 bytes of float16; the partition holds 24 bytes of float32"),
])
def test_a_chunk_other_than_the_one_asked_for_stages_nothing(engine, bad, message):
    e, parts = engine
    with pytest.raises(RuntimeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        e.deliver(bad, parts[0], 3)
    e.deliver(chunk(1, 3), parts[1], 3)
    assert _native.param_version(NATIVE_KEY) is None  # never published


def test_a_second_gradient_for_the_same_variable_and_iteration_fails_and_keeps_the_first(engine):
    _, parts = engine
    asked = []  # versions asked of the pullers
    # Only the pump: two links, no clients, no threads.
    e = GradientsOut(_native, make_dispatch(), [None, None], threading.Event(),
                     fail=None, ask_version=asked.append, rpc_timeout_s=60.0)
    variable = tf.Variable(tf.zeros(SHAPE))
    first = tf.ones(SHAPE)
    _native.push_grad(variable.handle, first, key=NATIVE_KEY, step=0)
    _native.push_grad(variable.handle, 2 * first, key=NATIVE_KEY, step=0)
    with pytest.raises(RuntimeError,
                       match="a second gradient arrived for variable key 7 at iteration 0"):
        e.pump()
    grad = e._dispatch.payload(schedulers.ReadyItem(0, 0, 0, 0, 0, 24, 0))
    assert grad.dtype == "float32" and grad.view().tolist() == [1.0] * 12  # the first, readable
    assert _native.outstanding_grads() == 1  # the second was released
    # The first is sent: both partitions to PS 0, one block each (the window).
    assert [len(e._send_queues[0].get_nowait()) for _ in parts] == [1, 1]
    assert e._send_queues[1].empty()
    assert asked == [1]  # version 1 asked for


def test_a_pull_takes_its_partitions_in_any_order_but_each_once():
    from prophet_tf.engine.delivery import Expected

    parts = make_dispatch().partitions_of[0]
    expected = Expected(1, parts)
    assert expected.take(chunk(1, 3)) == parts[1]  # the second asked, first applied
    assert len(expected) == 1 and expected.left() == [parts[0]]
    with pytest.raises(RuntimeError, match="not asked for, or twice.*partition 1 version 3"):
        expected.take(chunk(1, 3))
    with pytest.raises(RuntimeError, match="key 5 partition 0"):
        expected.take(chunk(0, 3, key=5))
    assert expected.left() == [parts[0]]  # a bad answer changes nothing
    assert expected.take(chunk(0, 3)) == parts[0] and not expected
