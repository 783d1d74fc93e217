"""A variable cut into partitions, applied whole: Adafactor's factored moments.

Keras' Adafactor (``keras/src/optimizers/adafactor.py``) keeps, for a matrix,
a row mean and a column mean of the squared gradients over the whole matrix,
and scales each step by the root mean square of the whole variable and of the
whole update. No element range can be updated from its own elements, and its
slots have shapes of their own (a row and a column vector), so a cut variable
cannot be applied partition by partition, nor in Lamb's two phases of added
sums (:mod:`prophet_tf.ps.lamb`).

So a variable larger than ``max_partition_bytes`` under such an optimizer
travels and is summed in partitions as any other (all on one PS task: the
whole rule of ``sharding.py``), but is applied whole: :class:`Held` keeps each
partition's sum of a step until the variable's last is in, then
:meth:`WholeVariable.apply` runs one traced ``optimizer.apply`` on a
``keras.Variable`` of the variable's own shape (the optimizer is built on it,
so its slots are whole: a saved model and a checkpoint hold them as Keras
does), from the partitions' current values, and writes each partition's
elements back. Clipping, weight decay and accumulation stay Keras' own.
"""
from __future__ import annotations

import math

import numpy as np

from prophet_tf.ps import zero_copy

__all__ = ["WholeVariable", "Held"]


class WholeVariable:
    """The one ``keras.Variable`` of a cut variable that the optimizer updates.

    Args:
        variable: a ``keras.Variable`` of the variable's own shape and dtype.
        count: how many partitions the variable is cut into (all on this task).
    """

    def __init__(self, variable, count: int):
        self.variable = variable
        self.count = count
        self._fn = None  # traced on the first apply

    def apply(self, optimizer, parts: list, totals: list, iteration: int, factor,
              patches, clips: bool) -> list[np.ndarray]:
        """One step: the whole gradient (the partitions' sums, in element order) applied
        to the whole variable (set from the partitions' values first); every
        partition's new values, in ``parts``' order.

        Args:
            parts: the variable's ``Part``\\ s, sorted by partition.
            totals: their sums of this step.
            iteration: the optimizer's raw iteration count for it.
            factor: the clipping factor (None without clipping).
            patches: ``(variable) -> (*factor) -> ExitStack`` (``apply.py``).
        """
        import tensorflow as tf

        if self._fn is None:
            self._fn = self._trace(optimizer, parts, totals, patches(self.variable), clips)
        values = self._fn(*(zero_copy.to_tensor(t.reshape(-1)) for t in totals),
                          tf.constant(iteration, tf.int64),
                          *(tf.constant(f, tf.float32) for f in factor or ()))
        return [zero_copy.to_array(v).reshape(p.shape) for p, v in zip(parts, values)]

    def _trace(self, optimizer, parts, totals, patches, clips):
        import tensorflow as tf

        whole = self.variable
        shape = tuple(whole.shape)
        ranges = [(p.plan.begin, p.plan.end) for p in parts]
        if ranges[0][0] != 0 or ranges[-1][1] != math.prod(shape) or any(
                a[1] != b[0] for a, b in zip(ranges, ranges[1:])):
            raise ValueError(f"The partitions of {parts[0].spec.name!r} do not cover it in "
                             f"order. Received: element ranges {ranges} of shape {shape}")

        def apply(*args):
            gradients, iteration, factor = args[:len(parts)], args[len(parts)], \
                args[len(parts) + 1:]
            gradient = tf.reshape(tf.concat(gradients, 0), shape)
            whole.assign(tf.reshape(tf.concat(
                [tf.reshape(p.variable.value, [-1]) for p in parts], 0), shape))
            optimizer._iterations.assign(iteration)
            with patches(*factor):
                optimizer.apply([gradient], [whole])
            flat = tf.reshape(whole.value, [-1])
            out = []
            for p, (begin, end) in zip(parts, ranges):
                p.variable.assign(tf.reshape(flat[begin:end], p.shape))
                out.append(p.variable.value.read_value())
            return out

        signature = [tf.TensorSpec((t.size,), tf.as_dtype(t.dtype)) for t in totals]
        signature.append(tf.TensorSpec((), tf.int64))
        if clips:
            signature += [tf.TensorSpec((), tf.float32)] * 2
        fn = tf.function(apply, autograph=False, input_signature=signature)
        fn._omit_frequent_tracing_warning = True  # one trace per variable, by design
        return fn.get_concrete_function()


class Held:
    """Each cut variable's partition sums of a step until all are in (apply thread
    only)."""

    def __init__(self):
        self._held: dict[tuple, dict] = {}  # (step, key) -> {partition: (part, total, ...)}

    def add(self, part, step: int, total: np.ndarray, optimizer_iteration: int,
            factor) -> tuple | None:
        """Records a partition's sum of ``step``; once it was the variable's last:
        ``(parts, totals, optimizer_iteration, factor)`` in partition order. Else None.

        Every partition of a variable has the same iteration and clipping factor
        (its norm group is the variable or the whole step)."""
        held = self._held.setdefault((step, part.plan.key), {})
        held[part.plan.partition] = (part, total, optimizer_iteration, factor)
        if len(held) < part.whole.count:
            return None
        del self._held[step, part.plan.key]
        ordered = [held[i] for i in sorted(held)]
        return ([h[0] for h in ordered], [h[1] for h in ordered], ordered[-1][2],
                ordered[-1][3])

    def pending(self) -> dict:
        """(step, key) -> partitions in (for errors and tests)."""
        return {k: len(v) for k, v in self._held.items()}
