"""Optimizer state that every ``optimizer.apply`` advances once, whichever
variables it updates: Nadam's ``u_product``, the product of its momentum
schedule, the one such state among Keras 3's built-in optimizers
(``optimizer_policy.PER_ITERATION``).

The PS applies a step one partition at a time, so that state would advance once
per partition; :class:`Rewinder` keeps it at one advance per step. Where a step
count is all there is (a PS task that resumes at step n, a worker's optimizer
saved with a model) :func:`set_after` sets it from the count alone: after n
applies ``u_product`` is the product of ``beta_1 * (1 - 0.5 * 0.96**k)`` for k = 1..n,
in the variable's dtype, as Keras multiplies it.

On a worker the PS applies the optimizer, so the worker's Nadam must not
advance its own ``u_product`` (a trainable variable, so one whose value lives
on the PS): :func:`advance_on_the_ps_only` makes Keras' Nadam skip that under the
strategy that asks for it, and only there.

Imports neither TensorFlow nor Keras at import time.
"""
from __future__ import annotations

import numpy as np

from prophet_tf import optimizer_policy

__all__ = ["tracked", "value_after", "set_after", "Rewinder", "advance_on_the_ps_only"]


def tracked(optimizer) -> bool:
    """Whether ``optimizer`` has per-apply state (a Keras 3 Nadam; tf_keras' keeps
    its own, which the PS, applying Keras 3's, never reads)."""
    return (type(optimizer).__name__ in optimizer_policy.PER_ITERATION
            and type(optimizer).__module__.startswith("keras.")
            and hasattr(optimizer, "_u_product"))


def value_after(optimizer, applies: int) -> np.ndarray:
    """Nadam's ``u_product`` after ``applies`` steps of ``optimizer``.

    Keras computes ``u * beta_1 * (1 - 0.5 * 0.96**(k))`` at step k, each
    operation rounded to the variable's dtype; so does this (``0.96**k`` may
    differ from TensorFlow's ``pow`` in the last bit). Within about a thousand
    steps the product reaches a fixed point (0 or a denormal that ``beta_1``
    rounds back to itself, once ``0.96**k`` no longer changes the factor), and
    stays there.
    """
    if not isinstance(applies, int) or applies < 0:
        raise ValueError(f"applies must be an int >= 0. Received: {applies!r}")
    dtype = np.dtype(optimizer._u_product.dtype).type  # Keras 3 names it: "float32"
    u, beta_1 = dtype(1.0), dtype(optimizer.beta_1)
    half, one, decay = dtype(0.5), dtype(1.0), dtype(0.96)
    for k in range(1, applies + 1):
        factor = one - half * np.power(decay, dtype(k))
        before, u = u, (u * beta_1) * factor
        if u == before and factor == one:
            break
    return np.asarray(u, dtype)


def set_after(optimizer, steps: int) -> None:
    """Sets ``optimizer``'s per-apply state to its value after ``steps`` raw steps
    (``_iterations``; with ``gradient_accumulation_steps`` N it advanced at every
    N-th only). Nothing for an optimizer without such state."""
    if tracked(optimizer):
        every = getattr(optimizer, "gradient_accumulation_steps", None) or 1
        optimizer._u_product.assign(value_after(optimizer, steps // every))


class Rewinder:
    """Keeps the per-apply state of the PS's optimizer at one advance per step.

    The first update of an optimizer step records the state (the previous
    step's updates all ended on the same value) and each later update of that
    step first sets it back, so each advances it from the same start to the
    same end, as Keras' one ``apply`` of the whole model does: exact, since
    Keras' own arithmetic makes every value. A step that does not follow the
    last one (the first after a resume) starts from :func:`set_after`. A
    skipped step (an overflow) applies nothing and advances nothing, as in Keras.
    """

    def __init__(self, optimizer):
        self._optimizer = optimizer if tracked(optimizer) else None
        self._step: int | None = None
        self._start = None

    def before_update(self, step: int) -> None:
        """Before the update of one partition at optimizer step ``step``."""
        if self._optimizer is None:
            return
        state = self._optimizer._u_product
        if step == self._step:
            state.assign(self._start)
            return
        if self._step is None or step != self._step + 1:
            set_after(self._optimizer, step)
        self._step, self._start = step, np.array(state.numpy())


def advance_on_the_ps_only(strategy_type: type) -> None:
    """Makes Keras 3's Nadam skip its ``u_product`` advance when it was created
    under a ``strategy_type`` strategy, whose PS advances it (:class:`Rewinder`).
    Elsewhere Nadam runs as it is. Idempotent.

    Keras' Nadam advances ``u_product`` in ``_backend_update_step``, before the
    update reaches the strategy, in the train step's ``tf.function``; in a
    prophet_tf worker that variable, created trainable, lives on the PS and
    cannot be assigned there (fit and custom loops alike).
    """
    import keras

    nadam = keras.optimizers.Nadam
    if getattr(nadam._backend_update_step, "_left_to_the_ps", False):
        return
    advancing = nadam._backend_update_step

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        if isinstance(getattr(self, "_distribution_strategy", None), strategy_type):
            return super(nadam, self)._backend_update_step(grads, trainable_variables,
                                                           learning_rate)
        return advancing(self, grads, trainable_variables, learning_rate)

    _backend_update_step._left_to_the_ps = True
    nadam._backend_update_step = _backend_update_step
