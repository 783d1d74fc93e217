"""Which Keras optimizers prophet_tf trains with, and their Register config.

The one optimizer policy, used by the worker (``prophet_tf.Strategy``, before
it registers) and by the PS (when it rebuilds the optimizer): both run the
same checks on the same serialized config, so an optimizer is refused with the
same message on either side.

The PS applies the optimizer one partition at a time: before the update of a
partition for iteration k it sets the iteration counter to k and calls
``optimizer.apply`` for that partition alone, so what it supports is decided by
what such an update cannot see:

* :data:`ELEMENTWISE` optimizers update a row range from that range's rows
  only: exact on any partitioning.
* :data:`WHOLE_VARIABLE` optimizers (norms or factorisations over a tensor)
  are exact only while no variable is split into row ranges; the PS checks
  that at Register (:func:`check_partitioning`).
* Anything else is refused. ``Nadam`` keeps one ``u_product`` for all
  variables and advances it at every ``apply``: applied per partition it would
  advance once per partition instead of once per iteration.

A ``LossScaleOptimizer`` (the ``mixed_float16`` policy) is not itself sent:
the worker pushes the unscaled gradients for its inner optimizer and marks the
config with :data:`LOSS_SCALING_KEY`, so the PS accepts non-finite gradients
and applies or skips each step as all workers' verdict says
(:mod:`prophet_tf.loss_scaling`).

Gradient clipping happens on the PS, on the sum of all workers' gradients, as
single-process Keras clips the global batch's gradient: the worker's optimizer
does not clip (:func:`clip_on_the_ps`) and the PS's rebuilt optimizer clips
inside its ``optimizer.apply`` of each partition. ``clipvalue`` is element-wise,
so exact on any partitioning; ``clipnorm`` takes one variable's norm, so it is
exact while no variable is split into row ranges: the workers keep variables up
to ``max_partition_bytes`` whole (:func:`needs_whole_variables`) and the PS
refuses a split one (:func:`check_partitioning`).

``global_clipnorm`` needs one norm over every partition's summed gradient: the
PS's optimizer is rebuilt without it and :mod:`prophet_tf.ps.clipping` scales
each step's sums once all are complete (one PS task only).

Options refused (:data:`REFUSED_OPTIONS`): Keras accumulates gradients and
keeps the moving average inside ``optimizer.apply`` on the worker, before its
gradient reaches the PS, so each worker would do it on its own share of the
gradient rather than on the sum of all workers'.

This module imports neither TensorFlow nor Keras at import time (the PS checks
a config without TensorFlow); Keras is imported inside the functions that need
it.
"""

from __future__ import annotations

import json
from typing import Sequence

__all__ = ["NO_WEIGHT_DECAY_KEY", "LOSS_SCALING_KEY", "ELEMENTWISE", "WHOLE_VARIABLE",
           "SUPPORTED_OPTIMIZERS", "REFUSED_OPTIONS", "config_json", "parse_config", "comparable",
           "check_optimizer", "check_options", "check_partitioning", "rebuild", "loss_scaling",
           "CLIPPING_OPTIONS", "clips", "clip_on_the_ps", "clipped_on_the_ps",
           "check_worker_clipping", "needs_whole_variables", "global_clipnorm"]

#: Optional top-level key of the optimizer JSON: the variable keys the worker's
#: optimizer exempts from weight decay (``exclude_from_weight_decay`` is not
#: part of Keras' serialized config).
NO_WEIGHT_DECAY_KEY = "prophet_tf_no_weight_decay"
#: Optional top-level key of the optimizer JSON: true when the workers scale
#: the loss (a ``LossScaleOptimizer``): their gradients may overflow, and each
#: step is applied only when every worker's gradients were finite.
LOSS_SCALING_KEY = "prophet_tf_loss_scaling"

#: Optimizers whose update of a row range depends only on that range's rows.
ELEMENTWISE = ("SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "Ftrl",
               "Lion")
#: Optimizers that need a whole variable (norms/factorisations over it).
WHOLE_VARIABLE = ("Lamb", "Adafactor")
SUPPORTED_OPTIMIZERS = ELEMENTWISE + WHOLE_VARIABLE

_ON_THE_WORKER = ("Keras does it in optimizer.apply on each worker, to that worker's own "
                  "share of the gradient before the PS sums the shares")
#: Optimizer options prophet_tf cannot apply exactly, with the reason.
REFUSED_OPTIONS = {
    "use_ema": "the moving average would be kept on each worker, apart from the "
               "parameters the PS trains",
    "gradient_accumulation_steps": _ON_THE_WORKER,
}
#: The optimizer options that clip gradients (Keras 3 and tf_keras alike).
CLIPPING_OPTIONS = ("clipnorm", "clipvalue", "global_clipnorm")
_CLIPS_ON_THE_PS = "_prophet_tf_clips_on_the_ps"
_MAX_ECHO_CHARS = 200  # of a received config quoted in an error message


def check_optimizer(kind: str) -> None:
    """Refuses an optimizer class the PS cannot apply one partition at a time.

    Args:
        kind: the class name (``type(optimizer).__name__``).

    Raises:
        ValueError: ``kind`` is not in :data:`SUPPORTED_OPTIMIZERS`; names it.
    """
    if kind not in SUPPORTED_OPTIMIZERS:
        raise ValueError(
            "The parameter server applies the optimizer one partition at a time and "
            f"supports the built-in Keras optimizers {list(SUPPORTED_OPTIMIZERS)}; {kind} "
            "keeps state across variables (Nadam's u_product, LossScaleOptimizer's "
            f"skipped iterations) or is unknown to it. Received: optimizer={kind}")


def _options(config: dict) -> dict:
    """The options of ``keras.optimizers.serialize(optimizer)``: its ``"config"``, or
    ``config`` itself when given those options directly."""
    return config.get("config", config)


def check_options(config: dict) -> None:
    """Refuses a serialized optimizer that sets an option of :data:`REFUSED_OPTIONS`.

    Args:
        config: ``keras.optimizers.serialize(optimizer)`` (or its ``"config"``).

    Raises:
        ValueError: names the first refused option and its value.
    """
    options = _options(config)
    for option, reason in REFUSED_OPTIONS.items():
        value = options.get(option)
        if value:
            raise ValueError(f"prophet_tf cannot apply the optimizer option {option}: "
                             f"{reason}. Remove it from the optimizer. "
                             f"Received: {option}={value!r}")


def needs_whole_variables(config: dict) -> bool:
    """Whether a parsed config's update reads each variable whole: a
    :data:`WHOLE_VARIABLE` optimizer, or ``clipnorm`` (one variable's norm).
    The workers then split only variables larger than ``max_partition_bytes``
    instead of spreading every large one over the PS tasks."""
    return config.get("class_name") in WHOLE_VARIABLE or bool(_options(config).get("clipnorm"))


def check_partitioning(kind: str, split: Sequence, max_partition_bytes: int,
                       config: dict | None = None) -> None:
    """Refuses a whole-variable optimizer or ``clipnorm`` when a variable is split.

    Args:
        kind: the optimizer's class name.
        split: ``VariableSpec``\\ s of the variables cut into several partitions.
        max_partition_bytes: the limit that cut them.
        config: the serialized optimizer (for ``clipnorm``); None: not checked.

    Raises:
        ValueError: ``kind`` is in :data:`WHOLE_VARIABLE`, or ``config`` sets
            ``clipnorm``, and ``split`` is not empty.
    """
    clipnorm = _options(config or {}).get("clipnorm")
    if split and clipnorm:
        raise ValueError(
            f"clipnorm clips each variable by the norm of its whole summed gradient but "
            f"variable {split[0].key} ({split[0].name!r}) is split into row ranges, "
            f"applied one at a time (it is larger than max_partition_bytes="
            f"{max_partition_bytes}). Use clipvalue, or a max_partition_bytes that keeps "
            f"every variable whole. Received: clipnorm={clipnorm!r}")
    if split and kind in WHOLE_VARIABLE:
        raise ValueError(
            f"optimizer={kind} needs whole variables but variable {split[0].key} "
            f"({split[0].name!r}) is split into row ranges (it is larger than "
            f"max_partition_bytes={max_partition_bytes}). Use an elementwise optimizer "
            f"({', '.join(ELEMENTWISE)}) or a larger max_partition_bytes. "
            f"Received: optimizer={kind}")


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
    ``LossScaleOptimizer`` (recorded under :data:`LOSS_SCALING_KEY`).

    A tf_keras (Keras 2) optimizer is described as the equivalent Keras 3
    optimizer (``prophet_tf._keras_compat``): the PS only knows Keras 3.

    Raises:
        ValueError: an optimizer or option this policy refuses, or a tf_keras
            optimizer, option or schedule without a Keras 3 equivalent; the
            message names it and the received value.
    """
    from prophet_tf import _keras_compat

    check_optimizer(type(optimizer).__name__)
    if _keras_compat.is_tf_keras_optimizer(optimizer):
        config = _keras_compat.keras3_optimizer_config(optimizer)
        decays = optimizer._use_weight_decay  # Takes the tf.Variable itself.
    else:
        import keras

        config = keras.optimizers.serialize(optimizer)
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


def parse_config(text: str) -> dict:
    """The dict of a Register ``optimizer_config``, checked for shape only.

    Raises:
        ValueError: not the JSON of ``keras.optimizers.serialize()`` (with an
            optional :data:`NO_WEIGHT_DECAY_KEY` list of ints); quotes the text.
    """
    try:
        config = json.loads(text)
        if not isinstance(config, dict) or "class_name" not in config:
            raise ValueError("not a keras.optimizers.serialize() dict")
        if not isinstance(config.get("config", {}), dict):
            raise ValueError('its "config" is not a dict')
        exempt = config.get(NO_WEIGHT_DECAY_KEY) or []
        if not (isinstance(exempt, list) and all(type(k) is int for k in exempt)):
            raise ValueError(f"{NO_WEIGHT_DECAY_KEY} is not a list of variable keys")
        if type(config.get(LOSS_SCALING_KEY, False)) is not bool:
            raise ValueError(f"{LOSS_SCALING_KEY} is not true or false")
    except (ValueError, RecursionError) as e:  # RecursionError: absurdly nested JSON
        raise ValueError("optimizer_config must be the JSON of "
                         f"keras.optimizers.serialize(optimizer) ({e}). "
                         f"Received: optimizer_config={text[:_MAX_ECHO_CHARS]!r}") from None
    return config


def comparable(config: dict) -> dict:
    """The optimizer config as compared between workers (its name aside)."""
    config = json.loads(json.dumps(config))
    config.get("config", {}).pop("name", None)
    return config


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

    config = json.loads(json.dumps(config))  # Keras mutates what it is given
    no_decay = set(config.pop(NO_WEIGHT_DECAY_KEY, None) or ())
    config.pop(LOSS_SCALING_KEY, None)
    if isinstance(config.get("config"), dict):
        # Applied per partition it would take each partition's norm for the
        # step's: prophet_tf.ps.clipping scales the sums before the apply.
        config["config"].pop("global_clipnorm", None)
    try:
        optimizer = keras.optimizers.deserialize(json.loads(json.dumps(config)))
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            # keras.optimizers.deserialize only knows the classes in its
            # ALL_OBJECTS (Keras 3.15 leaves out Lamb and returns a str).
            optimizer = keras.saving.deserialize_keras_object(config)
    except Exception as e:  # Keras raises ValueError/TypeError for unknown classes
        raise ValueError(f"Cannot rebuild the optimizer on the PS: {e}. Received: "
                         f"optimizer_config={json.dumps(config)[:_MAX_ECHO_CHARS]}") from None
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ValueError("optimizer_config does not describe a Keras optimizer. Received: "
                         f"optimizer_config={json.dumps(config)[:_MAX_ECHO_CHARS]}")
    check_optimizer(type(optimizer).__name__)
    check_options(config)
    return optimizer, no_decay


def clips(optimizer) -> bool:
    """Whether a Keras 3 or tf_keras optimizer sets a clipping option."""
    return any(getattr(optimizer, option, None) for option in CLIPPING_OPTIONS)


def clip_on_the_ps(optimizer) -> None:
    """Makes a worker's Keras 3 optimizer push unclipped gradients.

    Keras 3 clips inside ``optimizer.apply``, before the strategy receives
    the gradients; the PS clips their sum instead. Replaces ``_clip_gradients``
    on this object only (and on a ``LossScaleOptimizer``'s inner optimizer);
    before the step is traced. tf_keras hands the strategy its gradients before
    it clips them, so it needs nothing.
    """
    for opt in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        if opt is not None and hasattr(opt, "_clip_gradients") and not clipped_on_the_ps(opt):
            opt._clip_gradients = lambda grads: grads
            setattr(opt, _CLIPS_ON_THE_PS, True)


def clipped_on_the_ps(optimizer) -> bool:
    """Whether :func:`clip_on_the_ps` was applied to ``optimizer``."""
    return getattr(optimizer, _CLIPS_ON_THE_PS, False)


def check_worker_clipping(optimizer) -> None:
    """Refuses a Keras 3 optimizer that clipped a worker's own gradients.

    ``model.fit``/``train_on_batch`` make the worker's optimizer leave clipping
    to the PS (:func:`clip_on_the_ps`); a custom loop's ``optimizer.apply``
    clips before the strategy sees the gradients.

    Raises:
        ValueError: names the optimizer and its clipping options.
    """
    from prophet_tf import _keras_compat

    if (optimizer is None or _keras_compat.is_tf_keras_optimizer(optimizer)
            or not clips(optimizer) or clipped_on_the_ps(optimizer)):
        return
    options = {o: getattr(optimizer, o) for o in CLIPPING_OPTIONS if getattr(optimizer, o, None)}
    raise ValueError(
        "The PS clips the sum of all workers' gradients, but this optimizer's own apply "
        "already clipped this worker's share: train with model.fit/train_on_batch, or call "
        "prophet_tf.keras_optimizer.clip_on_the_ps(optimizer) before the first step. "
        f"Received: {type(optimizer).__name__} {optimizer.name!r} with {options}")


def global_clipnorm(config: dict) -> float | None:
    """The ``global_clipnorm`` of a parsed config (None: not set).

    Raises:
        ValueError: it is set and not a positive number; names the value.
    """
    value = config.get("config", {}).get("global_clipnorm")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"global_clipnorm must be a positive number. "
                         f"Received: global_clipnorm={value!r}")
    return float(value)


def loss_scaling(config: dict) -> bool:
    """Whether the workers of a parsed config scale their loss (:data:`LOSS_SCALING_KEY`)."""
    return bool(config.get(LOSS_SCALING_KEY, False))
