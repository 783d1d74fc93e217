"""Dynamic loss scaling (Keras' ``LossScaleOptimizer``, the ``mixed_float16`` policy) across workers.

Single-process Keras checks the step's gradients and, when any is not finite,
skips the update and halves the loss scale; after ``dynamic_growth_steps``
finite steps it doubles it. Across workers the rule must hold for the global
batch: a step overflowed when *any* worker's gradients did, and then every
PS task must skip it for every variable and every worker's scale must halve.

Under ``prophet_tf.Strategy`` the LossScaleOptimizer's ``apply`` is replaced
(on that optimizer object only, see :func:`install`) by one that

1. unscales the gradients and hands them to the inner optimizer's ``apply``,
   so each is pushed the moment it exists, overflowed or not: pushes overlap
   backprop as without loss scaling;
2. sends this worker's verdict (all its gradients finite?) to every PS task
   and gets back every worker's (``Engine.step_verdict``): a PS task applies
   the step only when all are finite, and skips it otherwise
   (``prophet_tf.ps.verdicts``);
3. moves the loss scale by the global verdict exactly as Keras would, and on
   a skipped step takes back the inner optimizer's iteration, which counts
   applied steps only, as in single-process Keras.

The worker's weights are the PS's: nothing is applied here.
"""
from __future__ import annotations

import tensorflow as tf

__all__ = ["install", "is_loss_scale_optimizer"]

_INSTALLED = "_prophet_tf_loss_scaling"


def is_loss_scale_optimizer(optimizer) -> bool:
    import keras
    return isinstance(optimizer, keras.optimizers.LossScaleOptimizer)


def installed(optimizer) -> bool:
    """Whether :func:`install` replaced this optimizer's ``apply``."""
    return getattr(optimizer, _INSTALLED, False)


def install(optimizer, step_verdict) -> None:
    """Makes a Keras 3 ``LossScaleOptimizer`` decide each step with all workers.

    Args:
        optimizer: the LossScaleOptimizer (``model.optimizer``).
        step_verdict: ``(local_finite: tf.bool tensor) -> tf.bool tensor``,
            every worker's gradients of this step finite; called after the
            inner optimizer's ``apply``, which numbered the step.
    """
    if installed(optimizer):
        return
    from keras import ops
    from keras.src import backend

    def apply(grads, trainable_variables=None):
        if not optimizer.built:  # as LossScaleOptimizer.apply
            with backend.name_scope(optimizer.name, caller=optimizer):
                optimizer.build(trainable_variables)
            optimizer.built = True
        variables = trainable_variables or optimizer._trainable_variables
        scale = optimizer.dynamic_scale
        local_finite = optimizer.check_finite(grads)
        unscaled = [g if g is None or optimizer._overwrite_variable_with_gradient(v)
                    else ops.divide(g, scale) for g, v in zip(grads, variables)]
        optimizer.inner_optimizer.apply(unscaled, trainable_variables=trainable_variables)
        finite = step_verdict(local_finite)

        def applied():
            def grow():
                optimizer.step_counter.assign(0)
                optimizer.dynamic_scale.assign(ops.multiply(optimizer.dynamic_scale, 2.0))

            def count():
                optimizer.step_counter.assign_add(1)

            ops.cond(ops.equal(optimizer.step_counter, optimizer.dynamic_growth_steps - 1),
                     grow, count)

        def skipped():
            optimizer.step_counter.assign(0)
            optimizer.dynamic_scale.assign(ops.multiply(optimizer.dynamic_scale, 0.5))
            # The inner apply counted the step; Keras counts applied steps only
            # (the raw counter: with gradient accumulation `iterations` is derived).
            optimizer.inner_optimizer._iterations.assign_sub(1)

        ops.cond(finite, applied, skipped)

    optimizer.apply = apply
    setattr(optimizer, _INSTALLED, True)


def verdict_op(step: tf.Tensor, local_finite: tf.Tensor, ask) -> tf.Tensor:
    """``ask(step: int, finite: bool) -> bool`` run inside the step (a py_function)."""
    result = tf.py_function(lambda s, f: ask(int(s.numpy()), bool(f.numpy())),
                            [step, tf.cast(local_finite, tf.bool)], tf.bool)
    result.set_shape(())
    return result
