"""Tests of prophet_tf._native: loading, error messages and the C API."""

import ctypes
import json
import os
import shutil
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

from prophet_tf import _native, _native_library

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def clean_runtime():
    _native.reset()
    yield
    _native.reset()


# --------------------------------------------------------------------------- loading

def test_ops_available_after_build():
    assert _native.ops_available() is True
    native = _native.load()
    assert native.path.name == "_prophet_ops.so"
    assert native is _native.load()  # cached


def test_missing_library_names_rebuild_command(tmp_path):
    with pytest.raises(ImportError) as info:
        _native.load_library(tmp_path)
    message = str(info.value)
    assert str(tmp_path / "_prophet_ops.so") in message
    assert "python setup.py build_ext --inplace" in message
    assert "pip install -e ." in message


def _broken_library(directory, tf_version):
    (directory / "_prophet_ops.so").write_bytes(b"not an ELF file\n" * 256)
    (directory / "_build_info.json").write_text(json.dumps({"tensorflow_version": tf_version}))


def test_version_mismatch_names_both_versions(tmp_path):
    _broken_library(tmp_path, "2.0.0-fake")
    with pytest.raises(ImportError) as info:
        _native.load_library(tmp_path)
    message = str(info.value)
    assert "TensorFlow 2.0.0-fake" in message
    assert f"TensorFlow {tf.__version__} is installed" in message
    assert "--no-build-isolation" in message and "pip install" in message
    # Refused before loading: dlopen's complaint about the bytes never comes up.
    assert "invalid ELF header" not in message


def test_other_load_failure_keeps_original_message(tmp_path):
    _broken_library(tmp_path, tf.__version__)
    with pytest.raises(ImportError) as info:
        _native.load_library(tmp_path)
    message = str(info.value)
    assert "failed to load" in message
    assert "invalid ELF header" in message  # dlopen's own words survive
    assert "was built against" not in message
    assert "python setup.py build_ext --inplace" in message


def test_ops_available_never_raises(monkeypatch, tmp_path):
    monkeypatch.setattr(_native_library, "_native", None)
    monkeypatch.setattr(_native_library, "_PACKAGE_DIR", tmp_path)
    assert _native.ops_available() is False


def test_c_api_and_ops_share_one_image():
    native = _native.load()
    # RTLD_NOLOAD only succeeds for an image that is already loaded: the one
    # tf.load_op_library opened. Same handle => same static runtime.
    again = ctypes.CDLL(str(native.path), mode=os.RTLD_NOW | os.RTLD_NOLOAD)
    assert again._handle == native.lib._handle
    # And the state is shared: an op's stamp and a C API stamp drain together.
    _native.stamp(7, 1, 16)
    _native.ready_stamp(tf.constant([1.0]), key=8, step=2)
    _native.stamp(9, 3, 17)
    records = _native.drain_stamps()
    assert records["key"].tolist() == [7, 8, 9]
    assert records["kind"].tolist() == [16, _native.StampKind.READY, 17]


def test_copied_library_is_a_separate_image(tmp_path):
    # The counterpart of the test above: a copy at another path is not attached.
    shutil.copy(_native.load().path, tmp_path / "_prophet_ops.so")
    with pytest.raises(OSError):
        ctypes.CDLL(str(tmp_path / "_prophet_ops.so"), mode=os.RTLD_NOW | os.RTLD_NOLOAD)


# --------------------------------------------------------------------------- stamps

def test_clock_is_monotonic_ns():
    before = time.monotonic_ns()
    now = _native.now_ns()
    after = time.monotonic_ns()
    assert before <= now <= after


def test_stamp_kinds_are_the_op_librarys():
    from prophet_tf.engine.timeline import StampKind
    assert _native.StampKind is StampKind  # one Python definition
    lib = _native.load().lib
    in_library = {kind: lib.prophet_stamp_kind_name(kind) for kind in range(-1, 64)}
    named = {kind: name.decode() for kind, name in in_library.items() if name is not None}
    # Both ways: every Python kind is the library's under the same name, and
    # the library has no kind Python lacks.
    assert named == {int(kind): kind.name for kind in StampKind}


def test_stamp_records_and_drains_in_order():
    for i in range(5):
        _native.stamp(i, 10 * i, 20 + i)
    first = _native.drain_stamps(max_records=2)
    rest = _native.drain_stamps()
    assert first.dtype == _native.STAMP_DTYPE
    assert first["key"].tolist() == [0, 1]
    assert rest["key"].tolist() == [2, 3, 4]
    assert rest["step"].tolist() == [20, 30, 40]
    assert rest["kind"].tolist() == [22, 23, 24]
    assert np.all(np.diff(np.concatenate([first, rest])["t_ns"]) >= 0)
    assert len(_native.drain_stamps()) == 0


def test_full_stamp_buffer_counts_drops():
    lib = _native.load().lib
    capacity = lib.prophet_stamp_capacity()
    assert capacity == 1 << 20
    stamp = lib.prophet_stamp
    for i in range(capacity + 10):
        stamp(i, 0, 16)
    assert _native.stamps_dropped() == 10
    records = _native.drain_stamps()
    assert len(records) == capacity
    assert records["key"][0] == 0 and records["key"][-1] == capacity - 1
    _native.stamp(1, 1, 16)  # room again after draining
    assert len(_native.drain_stamps()) == 1
    assert _native.stamps_dropped() == 10
    _native.reset()
    assert _native.stamps_dropped() == 0


# --------------------------------------------------------------------------- gradients

def test_next_grad_times_out():
    start = time.monotonic()
    assert _native.next_grad(timeout_s=0.05) is None
    assert time.monotonic() - start >= 0.04


def test_next_grad_blocks_without_gil():
    # A consumer blocked in next_grad must not stop this thread from pushing.
    got = []
    consumer = threading.Thread(target=lambda: got.append(_native.next_grad(timeout_s=20)))
    consumer.start()
    time.sleep(0.05)
    _native.push_grad(tf.Variable([0.0, 0.0]).handle, tf.constant([1.0, 2.0]), key=4, step=3)
    consumer.join(timeout=20)
    assert got and got[0] is not None and got[0].key == 4
    _native.release_grad(got[0].handle)


def test_next_grad_reports_abort():
    waiter_result = []

    def wait():
        try:
            _native.next_grad(timeout_s=None)
        except _native.RuntimeAbortedError as e:
            waiter_result.append(str(e))

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.05)
    _native.abort("ps-0 unreachable")
    waiter.join(timeout=20)
    assert waiter_result and "ps-0 unreachable" in waiter_result[0]


def test_release_of_unknown_handle_is_ignored():
    _native.release_grad(12345)
    assert _native.outstanding_grads() == 0


# --------------------------------------------------------------------------- parameters

def test_declare_rejects_bad_input():
    with pytest.raises(ValueError, match="dtype"):
        _native.declare_param(0, tf.int32, [2])
    lib = _native.load().lib
    dims = (ctypes.c_int64 * 1)(-3)
    assert lib.prophet_declare_param(0, 1, 1, dims) == -2
    assert lib.prophet_declare_param(-1, 1, 0, None) == -2
    assert lib.prophet_declare_param(0, 1, 1, None) == -2  # NULL dims with ndims > 0
    _native.declare_param(0, tf.float32, [2])
    _native.declare_param(0, tf.float32, [2])  # same spec: fine
    with pytest.raises(ValueError, match="was declared as"):
        _native.declare_param(0, tf.float32, [3])


def test_delivery_errors_are_codes_not_crashes():
    lib = _native.load().lib
    assert lib.prophet_deliver_begin(5, 0) == -3
    assert lib.prophet_deliver_commit(5, 0) == -3
    assert lib.prophet_param_version(5) == -3
    with pytest.raises(KeyError):
        _native.deliver_begin(5, 0)
    _native.declare_param(5, tf.float64, [2, 2])
    assert _native.param_version(5) is None
    assert _native.param_nbytes(5) == 32
    assert lib.prophet_deliver_commit(5, 0) == -5  # no begin
    with pytest.raises(ValueError, match="version must be >= 0"):
        _native.deliver_begin(5, -1)
    _native.deliver(5, 3, np.eye(2))
    assert _native.param_version(5) == 3
    with pytest.raises(ValueError, match="must not go back"):
        _native.deliver(5, 2, np.eye(2))
    with pytest.raises(ValueError, match="expects 32 bytes"):
        _native.deliver(5, 4, np.ones(3))
    assert _native.param_version(5) == 3


def test_deliver_writes_parts_and_commit_publishes_without_copy():
    _native.declare_param(1, tf.float32, [4])
    _native.deliver_begin(1, 0)
    _native.deliver_begin(1, 0)  # the same open buffer: no-op
    src = np.array([1.5, 2.5, 3.5, 4.5], np.float32)
    _native.deliver_write(1, 0, 8, src[2:])  # parts in any order
    _native.deliver_write(1, 0, 0, src[:2])
    _native.deliver_commit(1, 0)
    value = _native.await_param(0, key=1, dtype=tf.float32, shape=[4])
    np.testing.assert_array_equal(value.numpy(), src)
    # Readers share the staged buffer: a second read is the same memory.
    again = _native.await_param(0, key=1, dtype=tf.float32, shape=[4])
    assert value._numpy().ctypes.data == again._numpy().ctypes.data


@pytest.mark.parametrize("offset,nbytes", [
    (-1, 4), (0, -1), (13, 4), (16, 1), (17, 0), (-(1 << 63), 4), (8, (1 << 63) - 1),
    ((1 << 63) - 1, 1), (4, 13)])
def test_deliver_write_out_of_bounds_is_refused_and_writes_nothing(offset, nbytes):
    lib = _native.load().lib
    _native.declare_param(6, tf.float32, [4])  # 16 bytes
    _native.deliver_begin(6, 1)
    _native.deliver_write(6, 1, 0, np.full(4, 7.0, np.float32))
    src = np.zeros(64, np.uint8)
    assert lib.prophet_deliver_write(6, 1, offset, src.ctypes.data, nbytes) == -7
    message = _native._last_error()
    assert f"offset={offset}, nbytes={nbytes}" in message and "16 bytes" in message, message
    _native.deliver_commit(6, 1)
    value = _native.await_param(1, key=6, dtype=tf.float32, shape=[4])
    np.testing.assert_array_equal(value.numpy(), np.full(4, 7.0, np.float32))


def test_deliver_write_names_what_was_wrong():
    lib = _native.load().lib
    _native.declare_param(7, tf.float32, [2])
    src = np.ones(2, np.float32)
    with pytest.raises(KeyError, match="key=8"):
        _native.deliver_write(8, 0, 0, src)
    with pytest.raises(ValueError, match="without prophet_deliver_begin.*version=0"):
        _native.deliver_write(7, 0, 0, src)  # not opened
    _native.deliver_begin(7, 2)
    with pytest.raises(ValueError, match="without prophet_deliver_begin.*version=3"):
        _native.deliver_write(7, 3, 0, src)  # another version
    with pytest.raises(ValueError, match="outside parameter key=7"):
        _native.deliver_write(7, 2, 4, src)
    assert lib.prophet_deliver_write(7, 2, 0, None, 8) == -2  # NULL source
    assert lib.prophet_deliver_write(7, 2, 0, None, 0) == 0  # nothing to copy
    _native.deliver_cancel(7, 2)
    with pytest.raises(ValueError, match="without prophet_deliver_begin"):
        _native.deliver_write(7, 2, 0, src)  # cancelled


def test_deliver_cancel_drops_open_buffer():
    _native.declare_param(2, tf.float32, [1])
    _native.deliver_begin(2, 0)
    _native.deliver_cancel(2, 0)
    with pytest.raises(ValueError, match="without prophet_deliver_begin"):
        _native.deliver_commit(2, 0)


def test_abort_fails_deliveries_and_reset_clears_it():
    _native.declare_param(3, tf.float32, [1])
    _native.abort("shutting down")
    with pytest.raises(_native.RuntimeAbortedError, match="shutting down"):
        _native.deliver_begin(3, 0)
    _native.reset()
    with pytest.raises(KeyError):  # declarations are gone too
        _native.param_version(3)
    _native.declare_param(3, tf.float32, [1])
    _native.deliver(3, 0, [1.0])
    assert _native.param_version(3) == 0
