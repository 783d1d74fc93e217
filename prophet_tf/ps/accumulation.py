"""``gradient_accumulation_steps`` on the PS: the average of every N steps' sums.

The workers hand over every step's gradient (``keras_optimizer.leave_to_the_ps``)
and the PS's optimizer, rebuilt with the option, accumulates the sums as Keras
does inside ``optimizer.apply``: at raw step k (its ``_iterations``) it adds the
gradient to the variable's accumulator, and when k + 1 is a multiple of N it
applies ``(gradient + accumulator) / N`` and zeroes the accumulators. Its
``iterations`` (what schedules and bias corrections read) is k // N.

Keras zeroes *every* variable's accumulator at that update; the PS applies one
partition per ``apply``, so the reset would drop the sums of the partitions not
yet applied. While a partition's update is traced, :func:`one_partition` narrows
the reset to that partition's accumulator. The accumulators are optimizer slots:
checkpoints and saved models hold them. Clipping by norms with accumulation
reads them (:func:`accumulated`, ``clipping.py``).
"""
from __future__ import annotations

import contextlib

import numpy as np

from prophet_tf.ps import sharding

__all__ = ["one_partition", "accumulated"]


def _accumulator(optimizer, variable):
    return optimizer._accumulated_gradients[optimizer._get_variable_index(variable)]


def accumulated(optimizer, part) -> np.ndarray:
    """The accumulator of a partition (a ``registration.Part``): the sum of the steps
    since its last update; its elements of the whole variable's where the variable
    is applied whole (``whole_apply.py``)."""
    if part.whole is None:
        return np.asarray(_accumulator(optimizer, part.variable).numpy())
    return sharding.elements(np.asarray(_accumulator(optimizer, part.whole.variable).numpy()),
                             part.plan)


@contextlib.contextmanager
def one_partition(optimizer, variable):
    """While tracing ``optimizer.apply([gradient], [variable])``: a reset of the
    accumulators zeroes ``variable``'s only (nothing to do without accumulation)."""
    if not getattr(optimizer, "gradient_accumulation_steps", None):
        yield
        return
    from keras import ops

    accumulator = _accumulator(optimizer, variable)

    def reset_this_partition():
        accumulator.assign(ops.zeros(accumulator.shape, dtype=accumulator.dtype))

    optimizer._backend_reset_gradient_accumulators = reset_this_partition
    try:
        yield
    finally:
        del optimizer._backend_reset_gradient_accumulators  # the class's again
