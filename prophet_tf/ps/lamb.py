"""Lamb on a variable cut into partitions: its trust ratio over the whole variable.

Keras' Lamb (``keras/src/optimizers/lamb.py``) moves a variable by
``ratio * lr * update``: ``update`` is Adam's direction from the moments
(element by element), ``ratio = norm(weights) / norm(update)`` (1 where either
is 0), both norms over the whole variable (its weights after weight decay).
Applied one partition at a time, Keras' own ``update_step`` would take each
partition's norms instead. So each partition of a variable cut into several
(all on one PS task: the whole rule of ``sharding.py`` keeps them together)
is updated in two phases, both on the apply thread:

1. :meth:`LambPartition.moments`: ``optimizer.apply`` of the partition as for
   any optimizer (clipping, weight decay, accumulation: Keras' own code), with
   Lamb's ``update_step`` replaced by its first part, the same operations in
   the same order: the moments are updated, and the direction, the learning
   rate and the sums of squares of the weights and of the direction
   (float64) are kept aside;
2. :class:`Ratios` adds the sums of a step's partitions of the variable; once
   all are in, :meth:`LambPartition.finish` moves each partition by
   ``ratio * lr * direction`` with the variable's ratio (float32, as Keras
   computes it from its norms), and it is published.

A step that only accumulates (``gradient_accumulation_steps``) calls no
``update_step``: its first phase says so and the second leaves the weights.
With ``use_ema`` the moving average follows the weights of the second phase
(``ema.after_update``), not those of the first, which Keras' ``apply`` would
average: the first phase runs without it.
"""
from __future__ import annotations

import contextlib
import math

import numpy as np

from prophet_tf.ps import ema, zero_copy

__all__ = ["LambPartition", "Ratios", "ratio"]


def ratio(weights_squared: float, update_squared: float) -> np.float32:
    """Keras' trust ratio from the two sums of squares: their norms' quotient, 1 where
    either norm is 0."""
    w = np.float32(math.sqrt(weights_squared))
    g = np.float32(math.sqrt(update_squared))
    return w / g if w > 0 and g > 0 else np.float32(1.0)


class Ratios:
    """The sums of squares of each cut variable's partitions, per step, until all
    are in (used on the apply thread only)."""

    def __init__(self):
        self._held: dict[tuple, list] = {}  # (step, key) -> [(part, applied, w2, r2)]

    def add(self, part, step: int, applied: bool, weights_squared: float,
            update_squared: float) -> list | None:
        """Records a partition's first phase of ``step``; once it was the variable's
        last: ``[(part, ratio or None)]`` for all of them (None: nothing to apply).
        Else None."""
        held = self._held.setdefault((step, part.plan.key), [])
        held.append((part, applied, weights_squared, update_squared))
        if len(held) < part.lamb_partitions:
            return None
        del self._held[step, part.plan.key]
        r = ratio(sum(h[2] for h in held), sum(h[3] for h in held))
        return [(p, r if applied else None) for p, applied, _, _ in held]

    def pending(self) -> dict:
        """(step, key) -> partitions in (for errors and tests)."""
        return {k: len(v) for k, v in self._held.items()}


@contextlib.contextmanager
def _first_part_of_update_step(optimizer, keep):
    """While tracing: Lamb's ``update_step`` stops before its ratio and hands
    ``keep(update, lr)`` its direction and learning rate (Keras 3's
    ``Lamb.update_step``, line for line up to ``update``)."""
    from keras import ops

    def update_step(gradient, variable, learning_rate):
        lr = ops.cast(learning_rate, variable.dtype)
        gradient = ops.cast(gradient, variable.dtype)
        local_step = ops.cast(optimizer.iterations + 1, variable.dtype)
        beta_1_power = ops.power(ops.cast(optimizer.beta_1, variable.dtype), local_step)
        beta_2_power = ops.power(ops.cast(optimizer.beta_2, variable.dtype), local_step)
        m = optimizer._momentums[optimizer._get_variable_index(variable)]
        v = optimizer._velocities[optimizer._get_variable_index(variable)]
        optimizer.assign_add(m, ops.multiply(ops.subtract(gradient, m), 1 - optimizer.beta_1))
        optimizer.assign_add(v, ops.multiply(ops.subtract(ops.square(gradient), v),
                                             1 - optimizer.beta_2))
        m_t_hat = ops.divide(m, (1.0 - beta_1_power))
        v_sqrt = ops.add(ops.sqrt(ops.divide(v, (1.0 - beta_2_power))), optimizer.epsilon)
        keep(ops.divide(m_t_hat, v_sqrt), lr)

    optimizer.update_step = update_step
    try:
        yield
    finally:
        del optimizer.update_step  # the class's again


class LambPartition:
    """One partition's two traced phases and what the first keeps for the second.

    Args:
        optimizer: the PS's Lamb, built on the partitions' variables.
        variable: this partition's.
        gradient_spec: the ``tf.TensorSpec`` of its summed gradient.
        clips: whether every update comes with a clipping factor.
        patches: ``(*factor) -> contextlib.ExitStack`` entered around its ``apply``
            (accumulation's narrowed reset, the clipping factor: ``apply.py``).
    """

    def __init__(self, optimizer, variable, gradient_spec, clips: bool, patches):
        import tensorflow as tf

        self._variable = variable
        dtype = variable.dtype
        self._update = tf.Variable(tf.zeros(variable.shape, dtype), trainable=False)
        self._lr = tf.Variable(tf.zeros((), dtype), trainable=False)
        self._applied = tf.Variable(False, trainable=False)

        def keep(update, lr):
            self._update.assign(update)
            self._lr.assign(lr)
            self._applied.assign(True)

        def moments(gradient, iteration, *factor):
            optimizer._iterations.assign(iteration)
            self._applied.assign(False)
            with patches(*factor), _first_part_of_update_step(optimizer, keep):
                optimizer.apply([gradient], [variable])
            w = tf.cast(variable.value, tf.float64)
            r = tf.cast(self._update, tf.float64)
            return (self._applied.read_value(), tf.reduce_sum(w * w),
                    tf.reduce_sum(r * r))

        def finish(trust_ratio, applied, iteration):
            # Keras: assign_sub(variable, ratio * lr * update); x - 0 is x exactly.
            variable.assign_sub(tf.cast(applied, dtype) * tf.cast(trust_ratio, dtype) *
                                self._lr * self._update)
            optimizer._iterations.assign(iteration)
            ema.after_update(optimizer, variable)
            return variable.value.read_value()

        signature = [gradient_spec, tf.TensorSpec((), tf.int64)]
        if clips:
            signature += [tf.TensorSpec((), tf.float32)] * 2
        first = tf.function(moments, autograph=False, input_signature=signature)
        second = tf.function(finish, autograph=False, input_signature=[
            tf.TensorSpec((), tf.float32), tf.TensorSpec((), tf.bool),
            tf.TensorSpec((), tf.int64)])
        for fn in (first, second):
            fn._omit_frequent_tracing_warning = True  # one trace per partition, by design
        self._first = first.get_concrete_function()
        self._second = second.get_concrete_function()

    def moments(self, total: np.ndarray, iteration: int, factor) -> tuple[bool, float, float]:
        """Phase 1: ``(applied, sum of squared weights, sum of squared direction)``."""
        import tensorflow as tf

        applied, w2, r2 = self._first(zero_copy.to_tensor(total), tf.constant(iteration, tf.int64),
                                      *(tf.constant(f, tf.float32) for f in factor or ()))
        return bool(applied.numpy()), float(w2.numpy()), float(r2.numpy())

    def finish(self, trust_ratio, iteration: int) -> np.ndarray:
        """Phase 2: the weights moved by ``trust_ratio * lr * direction`` (None: not
        moved, a step that only accumulates), then the moving average
        updated (``use_ema``); their values. ``iteration``: the optimizer's raw
        iteration of the first phase."""
        import tensorflow as tf

        return zero_copy.to_array(self._second(
            tf.constant(1.0 if trust_ratio is None else trust_ratio, tf.float32),
            tf.constant(trust_ratio is not None), tf.constant(iteration, tf.int64)))
