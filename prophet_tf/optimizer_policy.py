"""The optimizer policy: which Keras optimizers and options prophet_tf trains with.

One policy for both ends, read from the serialized optimizer (the JSON of
``keras.optimizers.serialize``) that a worker sends at Register: the worker
checks it before it registers, the PS when it rebuilds the optimizer, so an
optimizer is refused with the same message on either side. This module imports
neither TensorFlow nor Keras: the PS, the engine and the tf_keras conversion
(:mod:`prophet_tf._keras_compat`) all read it; :mod:`prophet_tf.keras_optimizer`
is its Keras side.

The PS applies the optimizer one partition at a time: before the update of a
partition for iteration k it sets the iteration counter to k and calls
``optimizer.apply`` for that partition alone, so what it supports is decided by
what such an update cannot see:

* :data:`ELEMENTWISE` optimizers update an element range from that range
  alone: exact on any partitioning.
* :data:`WHOLE_VARIABLE` optimizers (norms or factorisations over a tensor)
  keep each variable's partitions on one PS task; of them, :data:`TWO_PHASE`
  ones (Lamb: a norm of the weights and one of the update) are applied in
  two phases over a variable cut into several partitions
  (:mod:`prophet_tf.ps.lamb`), the others (Adafactor's factored moments) are
  applied to a cut variable whole, once all its partitions' sums of a step are
  in (:mod:`prophet_tf.ps.whole_apply`, :func:`applies_whole`).
* :data:`PER_ITERATION`: elementwise, but with state shared by all variables
  that every ``apply`` advances (Nadam's ``u_product``); the PS rewinds it
  before each partition's update, so it advances once per iteration
  (:mod:`prophet_tf.per_iteration`).
* Anything else is refused.

Options: ``gradient_accumulation_steps`` is accumulated on the PS
(:mod:`prophet_tf.ps.accumulation`); ``clipnorm`` and ``global_clipnorm`` take
their norms over all partitions there (:mod:`prophet_tf.ps.clipping`), with or
without accumulation; ``use_ema``'s moving averages are kept per partition there
and swapped in at the end of ``fit`` (:mod:`prophet_tf.ps.ema`). An option the PS
could not apply exactly would be in :data:`REFUSED_OPTIONS` (none is now).
"""
from __future__ import annotations

import json
from typing import Sequence

__all__ = ["NO_WEIGHT_DECAY_KEY", "LOSS_SCALING_KEY", "ELEMENTWISE", "WHOLE_VARIABLE", "TWO_PHASE",
           "PER_ITERATION", "SUPPORTED_OPTIMIZERS", "UNSUPPORTED_OPTIMIZERS",
           "REFUSED_OPTIONS", "CLIPPING_OPTIONS", "ACCUMULATION", "MAX_ECHO_CHARS",
           "check_optimizer", "check_builtin", "check_options", "needs_whole_variables", "applies_whole",
           "parse_config", "comparable", "global_clipnorm", "clipnorm",
           "loss_scaling"]

#: Optional top-level key of the optimizer JSON: the variable keys the worker's
#: optimizer exempts from weight decay (``exclude_from_weight_decay`` is not
#: part of Keras' serialized config).
NO_WEIGHT_DECAY_KEY = "prophet_tf_no_weight_decay"
#: Optional top-level key of the optimizer JSON: true when the workers scale
#: the loss (a ``LossScaleOptimizer``): their gradients may overflow, and each
#: step is applied only when every worker's gradients were finite.
LOSS_SCALING_KEY = "prophet_tf_loss_scaling"

#: Optimizers whose update of an element range depends only on that range.
ELEMENTWISE = ("SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "Ftrl",
               "Lion")
#: Optimizers that need a whole variable (norms/factorisations over it).
WHOLE_VARIABLE = ("Lamb", "Adafactor")
#: Whole-variable optimizers the PS applies in two phases over a cut variable.
TWO_PHASE = ("Lamb",)
#: Elementwise optimizers with state shared by all variables that every
#: ``apply`` advances (prophet_tf.per_iteration).
PER_ITERATION = ("Nadam",)
SUPPORTED_OPTIMIZERS = ELEMENTWISE + WHOLE_VARIABLE + PER_ITERATION
#: Keras 3 built-in optimizers the PS cannot apply, with the reason.
UNSUPPORTED_OPTIMIZERS = {
    "Muon": "it chooses between its own update and AdamW's for each variable by the "
            "variable's path and shape, and orthogonalizes each matrix's update whole; the "
            "PS holds partitions under names of its own",
    "MultiOptimizer": "it routes the variables to several optimizers; the PS rebuilds one",
    "ScheduleFreeAdamW": "it starts its momentum from the variables' values when it is "
                         "built, which Keras' own fit loses (it builds the optimizer in a "
                         "stateless scope: single-process training starts from zeros) and "
                         "the PS cannot follow either way (it builds on zeros, before the "
                         "chief's values arrive)",
}

#: Optimizer options prophet_tf cannot apply exactly, with the reason.
REFUSED_OPTIONS: dict[str, str] = {}
#: The optimizer options that clip gradients (Keras 3 and tf_keras alike).
CLIPPING_OPTIONS = ("clipnorm", "clipvalue", "global_clipnorm")
#: Keras 3's option to apply the average of every N steps' gradients.
ACCUMULATION = "gradient_accumulation_steps"
MAX_ECHO_CHARS = 200  # of a received config quoted in an error message


def check_optimizer(kind: str) -> None:
    """Refuses an optimizer class the PS cannot apply one partition at a time.

    Args:
        kind: the class name (``type(optimizer).__name__``).

    Raises:
        ValueError: ``kind`` is not in :data:`SUPPORTED_OPTIMIZERS`; names it.
    """
    if kind in UNSUPPORTED_OPTIMIZERS:
        raise ValueError(f"The parameter server cannot apply {kind}: "
                         f"{UNSUPPORTED_OPTIMIZERS[kind]}. Received: optimizer={kind}")
    if kind not in SUPPORTED_OPTIMIZERS:
        raise ValueError(
            "The parameter server applies the optimizer one partition at a time and "
            f"supports the built-in Keras optimizers {list(SUPPORTED_OPTIMIZERS)}; {kind} "
            "keeps state across variables (LossScaleOptimizer's skipped iterations) or is "
            f"unknown to it. Received: optimizer={kind}")


def check_builtin(config: dict) -> None:
    """Refuses a serialized optimizer that is not one of Keras' own classes.

    The PS rebuilds the optimizer from its serialized config by class name, so a
    subclass (even one named ``SGD``) or a registered custom class would be rebuilt
    as the built-in class of that name, or not at all: its own update would be
    silently lost.

    Raises:
        ValueError: names the class and where it comes from.
    """
    module, name = config.get("module"), config.get("class_name")
    registered = config.get("registered_name")
    if module == "keras.optimizers" and registered is None:
        return
    raise ValueError(
        "The parameter server rebuilds the optimizer from keras.optimizers.serialize() by "
        "class name and applies Keras' own optimizer classes only; a subclass or a custom "
        "class (registered or not) would be rebuilt as another class or not at all. Use "
        f"the built-in keras.optimizers class with your settings. Received: optimizer "
        f"class_name={name!r}, module={module!r}, registered_name={registered!r}")


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
    """Whether a parsed config's update reads each variable whole (a
    :data:`WHOLE_VARIABLE` optimizer). The workers then split only variables
    larger than ``max_partition_bytes`` instead of spreading every large one over
    the PS tasks."""
    return config.get("class_name") in WHOLE_VARIABLE


def applies_whole(kind: str) -> bool:
    """Whether the PS applies a variable cut into several partitions whole, once
    each partition's sum of a step is in: a :data:`WHOLE_VARIABLE` optimizer not
    in :data:`TWO_PHASE` (:mod:`prophet_tf.ps.whole_apply`)."""
    return kind in WHOLE_VARIABLE and kind not in TWO_PHASE


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
                         f"Received: optimizer_config={text[:MAX_ECHO_CHARS]!r}") from None
    return config


def comparable(config: dict) -> dict:
    """The optimizer config as compared between workers (its name aside)."""
    config = json.loads(json.dumps(config))
    config.get("config", {}).pop("name", None)
    return config


def global_clipnorm(config: dict) -> float | None:
    """The ``global_clipnorm`` of a parsed config (None: not set).

    Raises:
        ValueError: it is set and not a positive number; names the value.
    """
    return _norm_option(config, "global_clipnorm")


def clipnorm(config: dict) -> float | None:
    """The ``clipnorm`` of a parsed config (None: not set).

    Raises:
        ValueError: it is set and not a positive number; names the value.
    """
    return _norm_option(config, "clipnorm")


def _norm_option(config: dict, option: str) -> float | None:
    # The PS clips by it (prophet_tf.ps.clipping); Keras would silently not clip by 0
    # or less.
    value = _options(config).get(option)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{option} must be a positive number. Received: {option}={value!r}")
    return float(value)


def loss_scaling(config: dict) -> bool:
    """Whether the workers of a parsed config scale their loss (:data:`LOSS_SCALING_KEY`)."""
    return bool(config.get(LOSS_SCALING_KEY, False))
