"""The Keras side of the optimizer policy: the Register config, clipping, the rebuilt optimizer.

The policy itself, which both ends check (the worker before it registers, the
PS when it rebuilds the optimizer), is :mod:`prophet_tf.optimizer_policy`
(``LOSS_SCALING_KEY`` and ``needs_whole_variables`` below are its).

A ``LossScaleOptimizer`` (the ``mixed_float16`` policy) is not itself sent:
the worker pushes the unscaled gradients for its inner optimizer and marks the
config with ``LOSS_SCALING_KEY``, so the PS accepts non-finite gradients
and applies or skips each step as all workers' verdict says
(:mod:`prophet_tf.loss_scaling`).

Gradient clipping happens on the PS, on the sum of all workers' gradients, as
single-process Keras clips the global batch's gradient: the worker's optimizer
does not clip (:func:`leave_to_the_ps`) and the PS's rebuilt optimizer clips
inside its ``optimizer.apply`` of each partition. ``gradient_accumulation_steps``
likewise: the worker's optimizer hands the strategy every step's gradient, and
the PS's accumulates the sums (:mod:`prophet_tf.ps.accumulation`).

``clipvalue`` is element-wise, so exact on any partitioning. ``clipnorm`` (one
variable's norm) and ``global_clipnorm`` (one over all) need norms over several
partitions: the PS's optimizer is rebuilt without them and
:mod:`prophet_tf.ps.clipping` gives each partition's update its group's factor
once the norm's partitions are complete and the PS tasks agree on it
(:mod:`prophet_tf.ps.norm_sharing`); with gradient accumulation, the norm of the
accumulated average at every N-th step, as Keras clips.

This module imports neither TensorFlow nor Keras at import time; Keras is
imported inside the functions that need it.
"""
from __future__ import annotations

import json
from typing import Sequence

from prophet_tf import _keras_compat
from prophet_tf.optimizer_policy import (ACCUMULATION, CLIPPING_OPTIONS, LOSS_SCALING_KEY,
                                         MAX_ECHO_CHARS, NO_WEIGHT_DECAY_KEY, check_builtin,
                                         check_optimizer, check_options)

__all__ = ["config_json", "rebuild", "clips", "leave_to_the_ps", "left_to_the_ps",
           "clip_on_the_ps", "check_worker_optimizer", "steps_taken", "swap_at_finalize"]

_LEFT_TO_THE_PS = "_prophet_tf_left_to_the_ps"
_SWAPS_ON_THE_PS = "_prophet_tf_swaps_on_the_ps"


# --- the worker's side ---------------------------------------------------------


def config_json(optimizer, variables: Sequence | None = None, *,
                loss_scaling: bool = False) -> str:
    """The ``optimizer_config`` of Register for a Keras 3 or tf_keras optimizer.

    ``keras.optimizers.serialize`` leaves out ``exclude_from_weight_decay``;
    given the model's trainable variables (in key order), the keys the
    optimizer exempts from weight decay are added under
    :data:`NO_WEIGHT_DECAY_KEY`, so the PS decays exactly the same variables.
    ``loss_scale_factor`` is left out: the worker's ``optimizer.apply``
    unscales the gradient before it is pushed, so the PS must not again.
    ``loss_scaling``: the worker's optimizer is the inner optimizer of a
    ``LossScaleOptimizer`` (recorded under ``LOSS_SCALING_KEY``).

    A tf_keras (Keras 2) optimizer is described as the equivalent Keras 3
    optimizer (``prophet_tf._keras_compat``): the PS only knows Keras 3.

    Raises:
        ValueError: an optimizer or option this policy refuses, or a tf_keras
            optimizer, option or schedule without a Keras 3 equivalent; the
            message names it and the received value.
    """
    if _keras_compat.is_tf_keras_optimizer(optimizer):
        check_optimizer(type(optimizer).__name__)
        config = _keras_compat.keras3_optimizer_config(optimizer)
        decays = optimizer._use_weight_decay  # Takes the tf.Variable itself.
    else:
        import keras

        config = keras.optimizers.serialize(optimizer)
        check_builtin(config)
        check_optimizer(type(optimizer).__name__)
        decays = lambda v: optimizer._use_weight_decay(getattr(v, "value", v))  # noqa: E731
    check_options(config)
    config.get("config", {}).pop("loss_scale_factor", None)
    if variables is not None and getattr(optimizer, "weight_decay", None) is not None:
        exempt = [i for i, v in enumerate(variables) if not decays(v)]
        if exempt:
            config[NO_WEIGHT_DECAY_KEY] = exempt
    if loss_scaling:
        config[LOSS_SCALING_KEY] = True
    return json.dumps(config)


# --- the PS's side ---------------------------------------------------------------


def rebuild(config: dict):
    """The Keras 3 optimizer of a parsed config, checked against this policy.

    Returns:
        ``(optimizer, no_decay)``: the optimizer (not built) and the set of
        variable keys exempt from weight decay (:func:`loss_scaling` reads
        the rest of what the worker added).

    Raises:
        ValueError: Keras cannot rebuild it, or this policy refuses it.
    """
    import keras

    check_builtin(config)  # before Keras imports whatever module it names
    check_options(config)  # as sent: the norm clipping is dropped below
    config = json.loads(json.dumps(config))  # Keras mutates what it is given
    no_decay = set(config.pop(NO_WEIGHT_DECAY_KEY, None) or ())
    config.pop(LOSS_SCALING_KEY, None)
    if isinstance(config.get("config"), dict):
        # Applied per partition it would take each partition's norm for the
        # step's or the variable's: prophet_tf.ps.clipping gives the factors.
        config["config"].pop("global_clipnorm", None)
        config["config"].pop("clipnorm", None)
    try:
        optimizer = keras.optimizers.deserialize(json.loads(json.dumps(config)))
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            # keras.optimizers.deserialize only knows the classes in its
            # ALL_OBJECTS (Keras 3.15 leaves out Lamb and returns a str).
            optimizer = keras.saving.deserialize_keras_object(config)
    except Exception as e:  # Keras raises ValueError/TypeError for unknown classes
        raise ValueError(f"Cannot rebuild the optimizer on the PS: {e}. Received: "
                         f"optimizer_config={json.dumps(config)[:MAX_ECHO_CHARS]}") from None
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ValueError("optimizer_config does not describe a Keras optimizer. Received: "
                         f"optimizer_config={json.dumps(config)[:MAX_ECHO_CHARS]}")
    check_optimizer(type(optimizer).__name__)
    return optimizer, no_decay


def clips(optimizer) -> bool:
    """Whether a Keras 3 or tf_keras optimizer sets a clipping option."""
    return any(getattr(optimizer, option, None) for option in CLIPPING_OPTIONS)


def leave_to_the_ps(optimizer) -> None:
    """Makes a worker's Keras 3 optimizer hand the strategy every step's gradient,
    unclipped: the PS clips, accumulates and keeps the moving averages of the sum of
    all workers'.

    Keras 3 clips inside ``optimizer.apply``, before the strategy receives the
    gradients, with ``gradient_accumulation_steps`` hands them over only every
    N-th step, and with ``use_ema`` updates its averages from the variables (whose
    next values are the PS's to compute). On this object only (and on a
    ``LossScaleOptimizer``'s inner optimizer): ``_clip_gradients`` returns the
    gradients as they are, and ``_backend_apply_gradients`` runs Keras' own path
    without accumulation and averages (its accumulators and averages stay, for
    saved models). Before the step is traced. tf_keras hands the strategy its
    gradients before it clips them, so it needs nothing (its ``use_ema`` is
    refused: ``_keras_compat``).
    """
    for opt in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        if opt is None or not hasattr(opt, "_clip_gradients") or left_to_the_ps(opt):
            continue
        opt._clip_gradients = lambda grads: grads
        if getattr(opt, "gradient_accumulation_steps", None) or getattr(opt, "use_ema", False):
            opt._backend_apply_gradients = _every_step(opt)
        setattr(opt, _LEFT_TO_THE_PS, True)


# The name of leave_to_the_ps before it left accumulation to the PS too.
clip_on_the_ps = leave_to_the_ps


def _every_step(opt):
    """``opt._backend_apply_gradients`` without accumulation and moving averages:
    Keras' own branch for an optimizer without ``gradient_accumulation_steps`` or
    ``use_ema``. The options themselves stay set: the worker registers them with
    the PS."""

    def apply_every_step(grads, trainable_variables):
        grads = opt._clip_gradients(grads)
        opt._apply_weight_decay(trainable_variables)
        opt._backend_update_step(grads, trainable_variables, opt.learning_rate)

    return apply_every_step


def steps_taken(optimizer) -> int:
    """The optimizer's raw step count: with ``gradient_accumulation_steps`` Keras'
    ``iterations`` is it divided by the steps."""
    counter = optimizer._iterations if hasattr(optimizer, "_iterations") else optimizer.iterations
    return int(counter.numpy())


def left_to_the_ps(optimizer) -> bool:
    """Whether :func:`leave_to_the_ps` was applied to ``optimizer``."""
    return getattr(optimizer, _LEFT_TO_THE_PS, False)


def check_worker_optimizer(optimizer) -> None:
    """Refuses a Keras 3 optimizer that clipped or accumulated a worker's own gradients.

    ``model.fit``/``train_on_batch`` make the worker's optimizer leave both to
    the PS (:func:`leave_to_the_ps`); a custom loop's ``optimizer.apply`` does
    them before the strategy sees the gradients.

    Raises:
        ValueError: names the optimizer and its clipping or accumulation options.
    """
    if (optimizer is None or _keras_compat.is_tf_keras_optimizer(optimizer)
            or left_to_the_ps(optimizer)):
        return
    options = {o: getattr(optimizer, o) for o in CLIPPING_OPTIONS + (ACCUMULATION, "use_ema")
               if getattr(optimizer, o, None)}
    if not options:
        return
    raise ValueError(
        "The PS clips, accumulates and averages (use_ema) the sum of all workers' "
        "gradients and the weights, but this optimizer's own apply would clip or accumulate "
        "this worker's share first, or average the weights mid-step: train "
        "with model.fit/train_on_batch, or call "
        "prophet_tf.keras_optimizer.leave_to_the_ps(optimizer) before the first step. "
        f"Received: {type(optimizer).__name__} {optimizer.name!r} with {options}")


def swap_at_finalize(optimizer, swap) -> None:
    """With ``use_ema``: the worker's ``optimizer.finalize_variable_values`` (which
    Keras' ``fit`` calls at its end, to overwrite the variables with their moving
    averages) calls ``swap()`` instead, which has the PS do it
    (``prophet_tf.ps.ema``). Nothing without ``use_ema``."""
    if not getattr(optimizer, "use_ema", False) or getattr(optimizer, _SWAPS_ON_THE_PS, False):
        return
    optimizer.finalize_variable_values = lambda var_list: swap()
    setattr(optimizer, _SWAPS_ON_THE_PS, True)
