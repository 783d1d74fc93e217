"""prophet_tf's native code from Python: the training ops and the C API's wrappers.

(The library's ``EmulatedDelay`` op, for the bench, is wrapped in
``prophet_tf.bench.emulation``.)

``_prophet_ops.so`` holds the TensorFlow ops (``ReadyStamp``, ``PushGrad``,
``AwaitParam``; the bench's ``EmulatedDelay``) and a small C API the engine drives through ctypes: the stamp
buffer, the gradient queue and the parameter staging area. Loading it is
prophet_tf._native_library's job; any wrapper here loads on first use (and
raises ``ImportError`` with a rebuild hint when it cannot).

``ReadyStamp`` and ``AwaitParam`` are registered non-stateful so that
tf.function's automatic control dependencies do not serialise them: their
outputs must be consumed or they are pruned. ``PushGrad`` is stateful on its
variable's resource handle, so it runs although it has no output and is
ordered only against other ops on that variable (see ops/ops.cc). Constant
folding is refused by the kernels, so constant inputs are fine.

``PushGrad`` and ``AwaitParam`` read and write host memory (the gradient
queue, the staging area), and have CPU kernels only: their wrappers place them
on the host CPU of whatever device scope is active ("/cpu:0" merged into it),
so under a GPU scope TensorFlow copies their inputs and outputs across instead
of soft placement choosing for them.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import numpy as np
import tensorflow as tf

from prophet_tf import codec
from prophet_tf._native_library import (  # noqa: F401 (re-exported)
    _GradInfo, load, load_library, ops_available)
from prophet_tf.engine.timeline import StampKind

__all__ = [
    "StampKind", "STAMP_DTYPE", "Grad", "RuntimeAbortedError", "ops_available", "load",
    "ready_stamp", "push_grad", "await_param", "drain_stamps", "stamps_dropped", "stamp",
    "now_ns", "next_grad", "release_grad", "outstanding_grads", "queued_grads",
    "declare_param", "freeze_param", "deliver_begin", "deliver_write", "deliver_commit",
    "deliver_cancel", "deliver", "param_version", "pending_awaits", "abort", "reset",
]


# Layout of the C struct ProphetStamp (32 bytes).
STAMP_DTYPE = np.dtype({"names": ["key", "step", "t_ns", "kind"],
                        "formats": [np.int64, np.int64, np.int64, np.int32],
                        "offsets": [0, 8, 16, 24], "itemsize": 32})

# Return codes of the C API.
(_OK, _ABORTED, _INVALID, _UNDECLARED, _VERSION_ORDER, _NO_DELIVERY, _CONFLICT, _BOUNDS,
 _BUSY) = range(0, -9, -1)

_SUPPORTED_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)

#: Where PushGrad and AwaitParam run: merged into the active device scope, the
#: CPU of the same task ("/job:localhost/replica:0/task:0/device:GPU:1" -> its CPU:0).
HOST = "/cpu:0"


class RuntimeAbortedError(RuntimeError):
    """The native runtime was aborted (``abort``); carries the abort message."""


def _lib() -> ctypes.CDLL:
    return load().lib


def _last_error() -> str:
    return (_lib().prophet_last_error() or b"").decode("utf-8", "replace")


def _check(rc: int, what: str) -> int:
    if rc >= 0:
        return rc
    message = f"{what} failed: {_last_error()}"
    if rc == _ABORTED:
        raise RuntimeAbortedError(message)
    if rc == _UNDECLARED:
        raise KeyError(message)
    raise ValueError(message)


# --------------------------------------------------------------------------- ops

def _step_tensor(step) -> tf.Tensor:
    step = tf.convert_to_tensor(step)
    if step.dtype != tf.int64:
        step = tf.cast(step, tf.int64)
    return step


def ready_stamp(x: tf.Tensor, key: int, step) -> tf.Tensor:
    """Records that `x` is ready (kind READY) and returns it unchanged (no copy).

    The result must be consumed, or the op is pruned from a tf.function.

    Args:
        x: a float16/bfloat16/float32/float64 tensor.
        key: parameter key (>= 0).
        step: scalar step (any integer dtype; cast to int64).

    Returns:
        `x`, same shape, dtype and buffer.
    """
    return load().ops.ready_stamp(x, _step_tensor(step), key=key)


def push_grad(variable_handle: tf.Tensor, grad: tf.Tensor, key: int, step):
    """Stamps READY and hands `grad` to the engine's gradient queue.

    Never waits. Stateful on `variable_handle` (the handle of the variable the
    gradient belongs to), so a tf.function runs it although it has no output,
    ordered only against other ops on that variable. Runs on the host CPU
    (`grad` is copied there); TensorFlow places an op on its resource input's
    device, so the variable must live on the host too.

    Returns:
        The op in graph mode, None in eager mode.
    """
    with tf.device(HOST):
        return load().ops.push_grad(variable_handle, grad, _step_tensor(step), key=key)


def await_param(step, key: int, dtype, shape) -> tf.Tensor:
    """Returns parameter `key` once it is staged at a version >= `step`.

    Args:
        step: scalar step; waits for version >= step.
        key: parameter key, declared with `declare_param`.
        dtype: the declared dtype.
        shape: the declared shape (may be partially unknown).

    Returns:
        The staged tensor (shared with the staging area; read-only), in host
        memory: the op runs on the host CPU.

    Raises:
        tf.errors.AbortedError: the runtime was aborted (message included).
        tf.errors.InvalidArgumentError: dtype/shape differ from the declaration.
        tf.errors.FailedPreconditionError: `key` was never declared.
    """
    with tf.device(HOST):
        return load().ops.await_param(_step_tensor(step), key=key, dtype=tf.as_dtype(dtype),
                                      shape=tf.TensorShape(shape))


# --------------------------------------------------------------------------- stamps

def now_ns() -> int:
    """The stamps' clock: CLOCK_MONOTONIC in ns, comparable to time.monotonic_ns()."""
    return _lib().prophet_now_ns()


def stamp(key: int, step: int, kind: int) -> None:
    """Records an event on the stamps' clock (kinds >= 16; 0..15 are `StampKind`'s)."""
    _lib().prophet_stamp(key, step, int(kind))


def drain_stamps(max_records: int | None = None) -> np.ndarray:
    """Removes and returns recorded stamps, oldest first.

    Args:
        max_records: at most this many (default: all).

    Returns:
        A structured array of `STAMP_DTYPE` (fields key, step, t_ns, kind).
    """
    lib = _lib()
    chunks, total = [], 0
    while max_records is None or total < max_records:
        want = 1 << 16 if max_records is None else min(1 << 16, max_records - total)
        buf = np.empty(want, dtype=STAMP_DTYPE)
        n = lib.prophet_drain_stamps(buf.ctypes.data, want)
        chunks.append(buf[:n])
        total += n
        if n < want:
            break
    return np.concatenate(chunks) if len(chunks) > 1 else chunks[0]


def stamps_dropped() -> int:
    """Number of stamps dropped because the buffer was full (since the last reset)."""
    return _lib().prophet_stamps_dropped()


# --------------------------------------------------------------------------- gradients

class Grad(NamedTuple):
    """A gradient popped from the queue. Valid until `release_grad(handle)`.

    ``iteration`` is the training iteration PushGrad was given; ``dtype`` a wire
    dtype name ("float32"), so the engine needs no TensorFlow.
    """

    key: int
    iteration: int
    handle: int
    dtype: str
    nbytes: int
    data: int       # address of the tensor's buffer
    ready_ns: int   # when PushGrad ran

    def view(self) -> np.ndarray:
        """A flat read-only numpy view of the buffer (no copy); do not keep it past release."""
        np_dtype = codec.to_numpy_dtype(self.dtype)
        if self.nbytes == 0:
            return np.empty(0, dtype=np_dtype)
        raw = (ctypes.c_char * self.nbytes).from_address(self.data)
        array = np.frombuffer(raw, dtype=np_dtype)
        array.flags.writeable = False
        return array


def next_grad(timeout_s: float | None = None) -> Grad | None:
    """Pops the next pushed gradient, waiting up to `timeout_s` (None: forever).

    Blocks without holding the GIL.

    Returns:
        A `Grad`, or None on timeout.

    Raises:
        RuntimeAbortedError: the runtime was aborted.
    """
    info = _GradInfo()
    timeout_us = -1 if timeout_s is None else max(0, int(timeout_s * 1e6))
    rc = _lib().prophet_next_grad(timeout_us, ctypes.byref(info))
    if rc == 0:
        return None
    _check(rc, "next_grad")
    return Grad(key=info.key, iteration=info.step, handle=info.handle,
                dtype=tf.dtypes.as_dtype(info.dtype).name, nbytes=info.nbytes,
                data=info.data or 0, ready_ns=info.ready_ns)


def release_grad(handle: int) -> None:
    """Drops the runtime's reference to a popped gradient (unknown handles are ignored)."""
    _lib().prophet_release_grad(handle)


def outstanding_grads() -> int:
    """Gradients popped by `next_grad` and not yet released."""
    return _lib().prophet_outstanding_grads()


def queued_grads() -> int:
    """Gradients pushed and not yet popped."""
    return _lib().prophet_queued_grads()


# --------------------------------------------------------------------------- parameters

def _dtype_of(dtype) -> tf.DType:
    dtype = tf.as_dtype(dtype)
    if dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be one of float16, bfloat16, float32, float64. "
                         f"Received: dtype={dtype.name}")
    return dtype


def declare_param(key: int, dtype, shape) -> None:
    """Declares parameter `key`'s dtype and shape (idempotent for the same spec).

    Raises:
        ValueError: bad key/dtype/shape, or `key` was declared with another spec.
    """
    dtype = _dtype_of(dtype)
    dims = [int(d) for d in tf.TensorShape(shape).as_list()]
    array = (ctypes.c_int64 * max(1, len(dims)))(*dims)
    _check(_lib().prophet_declare_param(key, dtype.as_datatype_enum, len(dims), array),
           f"declare_param(key={key})")


def freeze_param(key: int) -> None:
    """Makes AwaitParam of `key` return the staged value at any step (an untrained variable)."""
    _check(_lib().prophet_freeze_param(key), f"freeze_param(key={key})")


def param_nbytes(key: int) -> int:
    """Size in bytes of parameter `key` as declared."""
    return _check(_lib().prophet_param_nbytes(key), f"param_nbytes(key={key})")


def param_version(key: int) -> int | None:
    """The staged version of `key`, or None before the first delivery.

    Raises:
        KeyError: `key` was never declared.
    """
    v = _lib().prophet_param_version(key)
    if v == -1:
        return None
    return _check(v, f"param_version(key={key})")


def pending_awaits() -> int:
    """Number of AwaitParam requests currently waiting."""
    return _lib().prophet_pending_awaits()


def deliver_begin(key: int, version: int) -> None:
    """Opens a fresh buffer for `key` at `version` (again for the same open version: no-op).

    Fill it with `deliver_write`, then publish it with `deliver_commit`.

    Raises:
        KeyError: `key` was never declared.
        ValueError: `version` is older than the staged one, or negative.
        RuntimeAbortedError: the runtime was aborted.
    """
    _check(_lib().prophet_deliver_begin(key, version),
           f"deliver_begin(key={key}, version={version})")


def deliver_write(key: int, version: int, offset: int, data: np.ndarray) -> None:
    """Copies `data`'s bytes to byte `offset` of the open delivery of `key` at `version`.

    The runtime checks the range against the declared size before writing
    anything; writes to disjoint ranges may run from several threads at once.

    Raises:
        ValueError: the range falls outside the parameter (nothing written),
            or no delivery of `version` is open.
        KeyError: `key` was never declared.
        RuntimeAbortedError: the runtime was aborted.
    """
    data = np.ascontiguousarray(data)
    _check(_lib().prophet_deliver_write(key, version, offset, data.ctypes.data, data.nbytes),
           f"deliver_write(key={key}, version={version})")


def deliver_commit(key: int, version: int) -> None:
    """Publishes the buffer of `deliver_begin` as `key`'s staged value.

    Completes every AwaitParam of `key` waiting for a step <= `version`.
    """
    _check(_lib().prophet_deliver_commit(key, version),
           f"deliver_commit(key={key}, version={version})")


def deliver_cancel(key: int, version: int) -> None:
    """Drops an open delivery (after `deliver_begin`, instead of committing)."""
    _check(_lib().prophet_deliver_cancel(key, version),
           f"deliver_cancel(key={key}, version={version})")


def deliver(key: int, version: int, value) -> None:
    """Stages `value` as `key` at `version`: begin, copy once, commit.

    `value` is converted to the declared dtype; its size must match the declaration.
    """
    nbytes = param_nbytes(key)
    dtype = tf.dtypes.as_dtype(_check(_lib().prophet_param_dtype(key), f"deliver(key={key})"))
    src = np.ascontiguousarray(value, dtype=dtype.as_numpy_dtype)
    if src.nbytes != nbytes:
        raise ValueError(f"deliver(key={key}) expects {nbytes} bytes of {dtype.name}. "
                         f"Received: shape={src.shape} ({src.nbytes} bytes)")
    deliver_begin(key, version)
    try:
        deliver_write(key, version, 0, src)
    except BaseException:
        deliver_cancel(key, version)
        raise
    deliver_commit(key, version)


# --------------------------------------------------------------------------- lifecycle

def abort(message: str) -> None:
    """Fails pending and future AwaitParam/PushGrad/next_grad with `message`."""
    _lib().prophet_abort(message.encode("utf-8"))


def reset() -> None:
    """Clears queues, stamps, staged values, declarations and the abort state.

    Pending AwaitParams fail with Cancelled. Popped gradients' buffers are freed:
    release every `Grad` view first.
    """
    _lib().prophet_reset()
