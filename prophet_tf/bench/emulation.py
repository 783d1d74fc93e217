"""Emulated compute: time that passes on a device while the host CPU stays free.

A GPU computes without the host CPU, which stays free for the network. To
reproduce that on CPU-only hosts, a model stands in for its compute with
:func:`delay`: the ``EmulatedDelay`` op of ``_prophet_ops.so`` forwards its
input after ``seconds`` from one process-wide timer thread; the wait holds no
inter-op thread and burns no CPU.

``EmulatedDelay`` is stateful, so TensorFlow never prunes, merges or
constant-folds it. tf.function's automatic control dependencies (ACD) would
then chain it behind every other stateful op in program order; :func:`delay`
marks it independent instead, so delays run concurrently unless ordered by
data or by ``after``.

Its gradient is the incoming gradient unchanged, without a delay: the model
emulates its backward's compute with delays of its own.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from prophet_tf import _native_library

__all__ = ["delay"]


def delay(x, seconds, after: Any = (), hide_launch_gap: bool = False) -> tf.Tensor:
    """Returns `x` (same buffer) once `seconds` have passed since its inputs were ready.

    Works eagerly (the call returns after `seconds`) and in a tf.function.

    Args:
        x: a tensor of any dtype and shape.
        seconds: scalar, float32 or convertible: the emulated compute time,
            finite, >= 0 and <= 86400. 0 completes at once.
        after: tensors or ops (any nested structure) the delay starts after.
        hide_launch_gap: count the `seconds` from when the inputs became ready
            to the emulated device, not from when the host started the op:
            from the last delay's deadline or parameter arrival, when that is
            at most 10 ms before the start (``ops/emulated_clock.h``). This
            hides the host's latency between dependent delays, as a GPU's
            launch queue does; the delay may then end up to 10 ms sooner
            after its start than `seconds`. Only for delays whose inputs wait
            for nothing but earlier delays and parameters.

    Returns:
        `x`, same dtype, shape and buffer.

    Raises:
        tf.errors.InvalidArgumentError: `seconds` is negative, not finite,
            over 86400 or not a scalar (in a tf.function, when it runs).
        ImportError: the op library is missing (see prophet_tf._native_library).
    """
    ops = _native_library.load().ops
    x = tf.convert_to_tensor(x)
    seconds = tf.convert_to_tensor(seconds)
    if seconds.dtype != tf.float32:
        seconds = tf.cast(seconds, tf.float32)
    deps = [d for d in tf.nest.flatten(after) if d is not None]
    with tf.control_dependencies(deps):
        y = ops.emulated_delay(x, seconds, hide_launch_gap=bool(hide_launch_gap))
    if not tf.executing_eagerly():
        # Inside a tf.function, ACD would order this stateful op after every
        # earlier one; independent ops still run before the function returns.
        acd = getattr(y.graph, "experimental_acd_manager", None)
        if acd is not None:
            acd.run_independently(y.op)
    return y


@tf.RegisterGradient("EmulatedDelay")
def _emulated_delay_grad(op, grad):  # pylint: disable=unused-argument
    return [grad, None]
