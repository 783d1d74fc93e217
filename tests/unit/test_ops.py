"""Tests of the ReadyStamp, PushGrad and AwaitParam ops."""

import threading
import time

import numpy as np
import pytest
import tensorflow as tf

from prophet_tf import _native

DTYPES = [tf.float16, tf.bfloat16, tf.float32, tf.float64]
pytestmark = pytest.mark.timeout(60)

READY, AWAIT_BEGIN, AWAIT_END, DELIVER = (int(k) for k in _native.StampKind)


def _wait_until(predicate, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.002)


def _in_thread(fn):
    """Runs fn in a thread; returns (thread, box) where box gets ('ok', v) or ('err', e)."""
    box = []

    def run():
        try:
            box.append(("ok", fn()))
        except Exception as e:  # pylint: disable=broad-except
            box.append(("err", e))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def _ops_of(fn, *specs, types=("ReadyStamp", "PushGrad", "AwaitParam")):
    graph = fn.get_concrete_function(*specs).graph
    return [op for op in graph.get_operations() if op.type in types]


class OpsTestCase(tf.test.TestCase):
    test_session = None  # tf.test.TestCase's deprecated helper, which pytest would report as a skip.

    def setUp(self):
        super().setUp()
        _native.reset()

    def tearDown(self):
        _native.reset()
        super().tearDown()


class ReadyStampTest(OpsTestCase):

    def test_pass_through_every_dtype(self):
        for dtype in DTYPES:
            x = tf.constant([[1.5, -2.0, 3.25]], dtype=dtype)
            y = _native.ready_stamp(x, key=3, step=4)
            self.assertEqual(y.dtype, dtype)
            self.assertEqual(y.shape, x.shape)
            self.assertAllEqual(y, x)
            # Forwarded, not copied.
            self.assertEqual(y._numpy().ctypes.data, x._numpy().ctypes.data)

    def test_negative_key_is_rejected(self):
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError, "key.*at least minimum 0"):
            _native.ready_stamp(tf.constant([1.0]), key=-1, step=0)

        @tf.function
        def build():
            return _native.ready_stamp(tf.constant([1.0]), key=-1, step=0)

        # In a graph, TF's attr check fails when the op is constructed.
        with self.assertRaisesRegex(ValueError, "less than minimum 0"):
            build.get_concrete_function()

    def test_step_must_be_scalar(self):
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                    r"step must be a scalar. Received: step.shape=\[2\]"):
            _native.ready_stamp(tf.constant([1.0]), key=0, step=[1, 2])

        @tf.function
        def static_shape():
            return _native.ready_stamp(tf.constant([1.0]), key=0, step=[1, 2])

        with self.assertRaisesRegex(ValueError, "rank 0"):  # shape function
            static_shape.get_concrete_function()

        @tf.function(input_signature=[tf.TensorSpec(None, tf.int64)])
        def dynamic_shape(step):
            return _native.ready_stamp(tf.constant([1.0]), key=0, step=step)

        with self.assertRaisesRegex(tf.errors.InvalidArgumentError, r"step.shape=\[3\]"):
            dynamic_shape(tf.constant([1, 2, 3], tf.int64))

    def test_stamps_in_order_on_the_monotonic_clock(self):
        before = time.monotonic_ns()
        for i in range(4):
            _native.ready_stamp(tf.constant([float(i)]), key=10 + i, step=100 + i)
        after = time.monotonic_ns()
        records = _native.drain_stamps()
        self.assertEqual(records["key"].tolist(), [10, 11, 12, 13])
        self.assertEqual(records["step"].tolist(), [100, 101, 102, 103])
        self.assertEqual(records["kind"].tolist(), [READY] * 4)
        t = records["t_ns"]
        self.assertTrue(np.all(np.diff(t) > 0))
        self.assertGreaterEqual(t[0], before)
        self.assertLessEqual(t[-1], after)

    def test_independent_chains_are_not_serialised(self):
        @tf.function
        def step_fn(x, step):
            outs = []
            for key in range(4):
                h = tf.sin(x * float(key + 1))
                h = _native.ready_stamp(h, key=key, step=step)
                outs.append(h)
            return tf.add_n(outs)

        specs = (tf.TensorSpec([8], tf.float32), tf.TensorSpec([], tf.int64))
        stamp_ops = _ops_of(step_fn, *specs)
        self.assertLen(stamp_ops, 4)
        for op in stamp_ops:
            self.assertEqual(op.control_inputs, [], f"{op.name} got control inputs")
        # Nothing added them to the function's control outputs either.
        concrete = step_fn.get_concrete_function(*specs)
        self.assertFalse({op.name for op in stamp_ops} &
                         {op.name for op in concrete.graph.control_outputs})
        step_fn(tf.ones([8]), tf.constant(7, tf.int64))
        records = _native.drain_stamps()
        self.assertCountEqual(records["key"].tolist(), [0, 1, 2, 3])
        self.assertEqual(set(records["step"].tolist()), {7})

    def test_constant_inputs_are_not_folded(self):
        @tf.function
        def all_constants():
            return _native.ready_stamp(tf.constant([1.0, 2.0]), key=9, step=5)

        for _ in range(3):
            self.assertAllEqual(all_constants(), [1.0, 2.0])
        # One stamp per call: grappler did not replace the op by its value.
        self.assertEqual(_native.drain_stamps()["key"].tolist(), [9, 9, 9])

    def test_unconsumed_stamp_is_pruned(self):
        @tf.function
        def fn(x, step):
            _native.ready_stamp(x, key=1, step=step)  # result dropped
            used = _native.ready_stamp(x * 2.0, key=2, step=step)
            return used + 1.0

        fn(tf.ones([2]), tf.constant(0, tf.int64))
        self.assertEqual(_native.drain_stamps()["key"].tolist(), [2])


class PushGradTest(OpsTestCase):

    def setUp(self):
        super().setUp()
        self.var = tf.Variable([0.0])  # PushGrad only needs a resource to be ordered on.

    def test_bytes_reach_the_queue_without_copy(self):
        for i, dtype in enumerate(DTYPES):
            values = np.arange(12, dtype=np.float64).reshape(3, 4) / 8.0 - 0.5
            grad = tf.constant(values, dtype=dtype)
            self.assertIsNone(_native.push_grad(self.var.handle, grad, key=i, step=20 + i))
            got = _native.next_grad(timeout_s=5)
            self.assertIsNotNone(got)
            self.assertEqual((got.key, got.iteration, got.dtype), (i, 20 + i, dtype))
            expected = grad.numpy()
            self.assertEqual(got.nbytes, expected.nbytes)
            self.assertEqual(got.view().tobytes(), expected.tobytes())
            self.assertEqual(got.data, grad._numpy().ctypes.data)  # same buffer
            self.assertEqual(_native.outstanding_grads(), 1)
            _native.release_grad(got.handle)
            self.assertEqual(_native.outstanding_grads(), 0)

    def test_ready_stamp_matches_queue_entry(self):
        _native.push_grad(self.var.handle, tf.ones([2]), key=5, step=6)
        got = _native.next_grad(timeout_s=5)
        records = _native.drain_stamps()
        self.assertEqual(records["kind"].tolist(), [READY])
        self.assertEqual(records["t_ns"][0], got.ready_ns)
        _native.release_grad(got.handle)

    def test_in_function_each_gradient_is_pushed_unchained(self):
        ws = [tf.Variable(float(k + 1)) for k in range(3)]

        def grads_of(x):
            with tf.GradientTape() as tape:
                h = x
                for w in ws:
                    h = tf.tanh(h * w)
                loss = tf.reduce_sum(h)
            return tape.gradient(loss, ws)

        @tf.function
        def train_step(x, step):
            for k, (g, w) in enumerate(zip(grads_of(x), ws)):
                _native.push_grad(w.handle, g, key=k, step=step)  # no output: kept as stateful

        specs = (tf.TensorSpec([4], tf.float32), tf.TensorSpec([], tf.int64))
        push_ops = _ops_of(train_step, *specs)
        self.assertLen(push_ops, 3)
        for op in push_ops:
            # Automatic control dependencies did not chain the pushes.
            self.assertEqual([c for c in op.control_inputs if c.type == "PushGrad"], [])
        x = tf.fill([4], 0.1)
        train_step(x, tf.constant(1, tf.int64))
        expected = [g.numpy() for g in grads_of(x)]
        got = {}
        while (grad := _native.next_grad(timeout_s=0)) is not None:
            got[grad.key] = (grad.iteration, grad.view().copy())
            _native.release_grad(grad.handle)
        self.assertEqual(sorted(got), [0, 1, 2])
        for key, (step, value) in got.items():
            self.assertEqual(step, 1)
            self.assertAllClose(value, [expected[key]])

    def test_negative_key_and_bad_step(self):
        with self.assertRaises(tf.errors.InvalidArgumentError):
            _native.push_grad(self.var.handle, tf.constant([1.0]), key=-1, step=0)
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError, r"step.shape=\[1\]"):
            _native.push_grad(self.var.handle, tf.constant([1.0]), key=0, step=[1])
        self.assertEqual(_native.queued_grads(), 0)

    def test_push_after_abort_fails(self):
        _native.abort("engine stopped")
        with self.assertRaisesRegex(tf.errors.AbortedError, "engine stopped"):
            _native.push_grad(self.var.handle, tf.constant([1.0]), key=0, step=0)


class AwaitParamTest(OpsTestCase):

    def _declare(self, key, shape=(2, 3), dtype=tf.float32):
        _native.declare_param(key, dtype, shape)

    @pytest.mark.timeout(60)
    def test_eager_wait_until_delivered(self):
        self._declare(0)
        value = np.arange(6, dtype=np.float32).reshape(2, 3)

        def deliver():
            _wait_until(lambda: _native.pending_awaits() == 1)
            _native.deliver(0, 1, value)

        thread, _ = _in_thread(deliver)
        # Blocks this (Python main) thread; the deliverer needs the GIL meanwhile.
        out = _native.await_param(1, key=0, dtype=tf.float32, shape=[2, 3])
        thread.join()
        self.assertAllEqual(out, value)
        kinds = _native.drain_stamps()["kind"].tolist()
        self.assertEqual(kinds, [AWAIT_BEGIN, DELIVER, AWAIT_END])

    def test_every_dtype(self):
        for key, dtype in enumerate(DTYPES):
            self._declare(key, shape=[3], dtype=dtype)
            _native.deliver(key, 0, np.array([0.5, -1.0, 2.0]))
            out = _native.await_param(0, key=key, dtype=dtype, shape=[3])
            self.assertEqual(out.dtype, dtype)
            self.assertAllEqual(out, tf.constant([0.5, -1.0, 2.0], dtype))

    @pytest.mark.timeout(60)
    def test_function_wait_until_delivered(self):
        self._declare(0, shape=[3])

        @tf.function
        def forward(step):
            w = _native.await_param(step, key=0, dtype=tf.float32, shape=[3])
            return w * 2.0

        for version in (1, 2):
            def deliver(version=version):
                _wait_until(lambda: _native.pending_awaits() == 1)
                _native.deliver(0, version, [version, 10.0, 100.0])

            thread, _ = _in_thread(deliver)
            out = forward(tf.constant(version, tf.int64))
            thread.join()
            self.assertAllEqual(out, [2.0 * version, 20.0, 200.0])

    @pytest.mark.timeout(60)
    def test_older_version_does_not_complete_newer_wait(self):
        self._declare(0, shape=[1])
        thread, box = _in_thread(lambda: _native.await_param(2, key=0, dtype=tf.float32,
                                                             shape=[1]).numpy())
        _wait_until(lambda: _native.pending_awaits() == 1)
        _native.deliver(0, 1, [1.0])
        time.sleep(0.05)
        self.assertEqual(_native.pending_awaits(), 1)
        self.assertEqual(box, [])
        _native.deliver(0, 2, [2.0])
        thread.join(timeout=20)
        self.assertEqual(box[0][0], "ok")
        self.assertAllEqual(box[0][1], [2.0])
        # Already staged at 2: an older step returns at once with the newest value.
        self.assertAllEqual(_native.await_param(1, key=0, dtype=tf.float32, shape=[1]), [2.0])

    @pytest.mark.timeout(60)
    def test_keys_complete_independently(self):
        self._declare(0, shape=[3])
        self._declare(1, shape=[3])

        @tf.function
        def forward(step):
            w0 = _native.await_param(step, key=0, dtype=tf.float32, shape=[3])
            h0 = _native.ready_stamp(tf.tanh(w0), key=100, step=step)  # depends on key 0 only
            w1 = _native.await_param(step, key=1, dtype=tf.float32, shape=[3])
            return tf.reduce_sum(h0 * w1)

        specs = tf.TensorSpec([], tf.int64)
        for op in _ops_of(forward, specs):
            self.assertEqual(op.control_inputs, [])

        def engine():
            _wait_until(lambda: _native.pending_awaits() == 2)
            _native.deliver(0, 5, [1.0, 2.0, 3.0])
            seen = []

            def saw_layer0():
                seen.extend(_native.drain_stamps().tolist())
                return any(key == 100 for key, _, _, _ in seen)

            _wait_until(saw_layer0)  # key 0's compute ran while key 1 still waits
            still_pending = _native.pending_awaits()
            _native.deliver(1, 5, [1.0, 1.0, 1.0])
            return seen, still_pending

        thread, box = _in_thread(engine)
        out = forward(tf.constant(5, tf.int64))
        thread.join(timeout=20)
        self.assertAllClose(out, np.tanh([1.0, 2.0, 3.0]).sum())
        seen, still_pending = box[0][1]
        self.assertEqual(still_pending, 1)
        events = [(key, kind) for key, _, _, kind in seen]
        self.assertIn((0, AWAIT_END), events)
        self.assertNotIn((1, AWAIT_END), events)
        self.assertLess(events.index((0, AWAIT_END)), events.index((100, READY)))
        rest = [(key, kind) for key, _, _, kind in _native.drain_stamps().tolist()]
        self.assertEqual(rest, [(1, DELIVER), (1, AWAIT_END)])

    @pytest.mark.timeout(60)
    def test_abort_fails_pending_and_future_waits(self):
        self._declare(0, shape=[2])
        self._declare(1, shape=[2])

        @tf.function
        def forward(step):
            a = _native.await_param(step, key=0, dtype=tf.float32, shape=[2])
            b = _native.await_param(step, key=1, dtype=tf.float32, shape=[2])
            return a + b

        def aborter():
            _wait_until(lambda: _native.pending_awaits() == 2)
            _native.abort("ps-1 is unreachable")

        thread, _ = _in_thread(aborter)
        with self.assertRaisesRegex(tf.errors.AbortedError, "ps-1 is unreachable"):
            forward(tf.constant(3, tf.int64))
        thread.join()
        self.assertEqual(_native.pending_awaits(), 0)
        with self.assertRaisesRegex(tf.errors.AbortedError, "ps-1 is unreachable"):
            _native.await_param(0, key=0, dtype=tf.float32, shape=[2])

    @pytest.mark.timeout(60)
    def test_failing_step_cancels_pending_wait(self):
        self._declare(0, shape=[2])

        @tf.function
        def forward(step):
            a = _native.await_param(step, key=0, dtype=tf.float32, shape=[2])  # never delivered
            b = _native.await_param(step, key=42, dtype=tf.float32, shape=[2])  # undeclared
            return a + b

        with self.assertRaisesRegex(tf.errors.FailedPreconditionError, "key=42 was not declared"):
            forward(tf.constant(0, tf.int64))
        self.assertEqual(_native.pending_awaits(), 0)

    @pytest.mark.timeout(60)
    def test_reset_cancels_pending_wait(self):
        self._declare(0, shape=[1])
        thread, box = _in_thread(lambda: _native.await_param(0, key=0, dtype=tf.float32,
                                                             shape=[1]))
        _wait_until(lambda: _native.pending_awaits() == 1)
        _native.reset()
        thread.join(timeout=20)
        self.assertEqual(box[0][0], "err")
        self.assertIsInstance(box[0][1], tf.errors.CancelledError)

    def test_wrong_shape_or_dtype_is_invalid_argument(self):
        self._declare(0, shape=[2, 3])
        _native.deliver(0, 0, np.zeros((2, 3)))
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError, r"declared with dtype=float, "
                                    r"shape=\[2,3\]"):
            _native.await_param(0, key=0, dtype=tf.float32, shape=[3, 2])
        with self.assertRaises(tf.errors.InvalidArgumentError):
            _native.await_param(0, key=0, dtype=tf.float64, shape=[2, 3])
        # A partially known shape compatible with the declaration is fine.
        out = _native.await_param(0, key=0, dtype=tf.float32, shape=[None, 3])
        self.assertEqual(out.shape, [2, 3])

    def test_shape_function_uses_attr(self):
        @tf.function
        def forward(step):
            return _native.await_param(step, key=0, dtype=tf.float64, shape=[None, 5])

        out_shape = forward.get_concrete_function(tf.TensorSpec([], tf.int64)).outputs[0].shape
        self.assertEqual(out_shape.as_list(), [None, 5])

    def test_bad_step(self):
        self._declare(0, shape=[1])
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError, r"step.shape=\[2\]"):
            _native.await_param([1, 2], key=0, dtype=tf.float32, shape=[1])
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError, "step must be >= 0"):
            _native.await_param(-1, key=0, dtype=tf.float32, shape=[1])
        with self.assertRaises(tf.errors.InvalidArgumentError):
            _native.await_param(0, key=-1, dtype=tf.float32, shape=[1])

    def test_reader_keeps_its_value_across_deliveries(self):
        self._declare(0, shape=[2])
        _native.deliver(0, 0, [1.0, 1.0])
        old = _native.await_param(0, key=0, dtype=tf.float32, shape=[2])
        _native.deliver(0, 1, [2.0, 2.0])
        new = _native.await_param(1, key=0, dtype=tf.float32, shape=[2])
        self.assertAllEqual(old, [1.0, 1.0])
        self.assertAllEqual(new, [2.0, 2.0])

    def test_frozen_param_serves_any_step(self):
        self._declare(0, shape=[1])
        _native.deliver(0, 0, [4.0])
        _native.freeze_param(0)
        self.assertAllEqual(_native.await_param(99, key=0, dtype=tf.float32, shape=[1]), [4.0])

    def test_constant_step_is_not_folded(self):
        self._declare(0, shape=[1])
        _native.deliver(0, 0, [1.0])

        @tf.function
        def forward():
            return _native.await_param(0, key=0, dtype=tf.float32, shape=[1])

        self.assertAllEqual(forward(), [1.0])
        _native.deliver(0, 1, [2.0])
        # Folded, the op would have become the constant [1.0].
        self.assertAllEqual(forward(), [2.0])
