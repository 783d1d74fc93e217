"""What each training step records for the engine, by step number.

The engine reads a step's learning rate and this worker's share rows when the
step's first gradient arrives, which can be after a callback already set the
next epoch's rate on the optimizer, or after the next step's batch was split:
so each step writes its own into a ring of variables, by step number
(``SLOTS`` steps kept; at most two are in flight), and its pushes wait for
those writes.
"""
from __future__ import annotations

import tensorflow as tf

from prophet_tf import _keras_compat

__all__ = ["SLOTS", "StepRecords"]

#: Steps whose records are kept (a ring by step number).
SLOTS = 16


class StepRecords:
    """The rings, on ``host_device`` where the engine reads them; made at first use."""

    def __init__(self, host_device):
        self._device = host_device
        self._rates: tf.Variable | None = None  # float64 learning rates
        self._rows: tf.Variable | None = None  # int64 share rows, -1: not weighted

    @property
    def has_rates(self) -> bool:
        """Whether a step recorded its learning rate (not a schedule's: the PS runs those)."""
        return self._rates is not None

    def record(self, optimizer, share_rows, step) -> list:
        """The ops that write step ``step``'s learning rate (None for a schedule) and
        ``share_rows`` (None: -1, not a Keras train step)."""
        ops = []
        rate = _keras_compat.learning_rate_variable(optimizer)
        if rate is not None:
            if self._rates is None:
                self._rates = self._ring("prophet_tf_learning_rates", tf.float64, 0)
            ops.append(_write(self._rates, step, tf.cast(tf.convert_to_tensor(rate), tf.float64)))
        return ops + [self._record_rows(share_rows, step)]

    def _record_rows(self, share_rows, step):
        if self._rows is None:
            self._rows = self._ring("prophet_tf_share_rows", tf.int64, -1)
        rows = tf.constant(-1, tf.int64) if share_rows is None else share_rows
        return _write(self._rows, step, rows)

    def _ring(self, name: str, dtype, fill) -> tf.Variable:
        """SLOTS values of ``fill``, on the host device, made outside any trace."""
        with tf.init_scope(), tf.device(self._device):
            return tf.Variable(tf.fill([SLOTS], tf.constant(fill, dtype)), trainable=False,
                               name=name)

    def rate_of_step(self, step: int) -> float:
        """The learning rate step ``step`` recorded."""
        return float(self._rates.numpy()[step % SLOTS])

    def rows_of_step(self, step: int) -> int | None:
        """The share rows step ``step`` recorded; None: its gradients are not weighted."""
        rows = int(self._rows.numpy()[step % SLOTS])
        return None if rows < 0 else rows


def _write(ring: tf.Variable, step, value):
    """``value`` into ``ring``'s slot for ``step``."""
    slot = tf.math.floormod(step, SLOTS)
    return ring.scatter_nd_update(tf.reshape(slot, [1, 1]), tf.reshape(value, [1]))
