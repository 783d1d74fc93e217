"""tf_keras (Keras 2) on the worker, Keras 3 on the parameter server.

A worker may train a `tf_keras` model (`import tf_keras`, or `tf.keras` under
`TF_USE_LEGACY_KERAS=1`); the PS rebuilds every optimizer with Keras 3. This
module recognises optimizers of either Keras and turns a tf_keras optimizer,
with its learning-rate schedule, into the `keras.optimizers.serialize()` dict
of the Keras 3 optimizer that computes the same update.

Only the built-in classes below convert: their update rules are the same in
both Keras versions (checked in tests/unit/test_keras_compat.py). Anything
else raises a `ValueError` naming it. Which optimizers and options the PS
applies at all is decided in `prophet_tf.optimizer_policy`. tf_keras is never imported here unless
the program already did.
"""
from __future__ import annotations

import inspect
import logging
import sys
from typing import Any, Callable

import numpy as np

from prophet_tf import optimizer_policy

logger = logging.getLogger(__name__)

__all__ = ["is_autocast_variable", "is_optimizer", "is_tf_keras_optimizer",
           "keras3_optimizer_config", "learning_rate_reader", "learning_rate_variable",
           "closure_contents", "search_closures"]

# tf_keras optimizers whose Keras 3 class of the same name applies the same update:
# those the PS supports (prophet_tf.optimizer_policy), but Lamb, which tf_keras lacks,
# and Nadam (below).
CONVERTIBLE_OPTIMIZERS = tuple(kind for kind in optimizer_policy.SUPPORTED_OPTIMIZERS
                               if kind not in ("Lamb", "Nadam"))
# tf_keras' Nadam counts its u_product's advances in a Python integer, which a
# compiled train step increments only while tracing: under `fit` it advances the
# product once per variable per step, Keras 3's once per step.
_NADAM = ("tf_keras' Nadam advances its momentum-schedule product (u_product) once per "
          "variable in each compiled train step (its counter is a Python integer, "
          "incremented only while tracing), Keras 3's Nadam once per step; the parameter "
          "server applies Keras 3's and cannot reproduce tf_keras'. Use "
          "keras.optimizers.Nadam (Keras 3) or another optimizer.")
CONVERTIBLE_SCHEDULES = ("ExponentialDecay", "PiecewiseConstantDecay", "PolynomialDecay",
                         "InverseTimeDecay", "CosineDecay", "CosineDecayRestarts")
# tf_keras config entries with no Keras 3 counterpart, dropped: jit_compile
# only says how the worker would run the update, which it never does (the PS
# applies it); is_legacy_optimizer is a serialization marker.
_DROPPED_OPTIONS = ("jit_compile", "is_legacy_optimizer")
# tf_keras options without a Keras 3 counterpart that get_config leaves out,
# with the value that computes what Keras 3 computes.
_HIDDEN_OPTIONS = {"adaptive_epsilon": False}
# tf_keras options the PS could apply but the worker's own apply cannot leave to it.
_WORKER_SIDE_OPTIONS = {
    "use_ema": "tf_keras' optimizer updates its moving averages inside its own "
               "apply_gradients on the worker, from the variables' values, which live on "
               "the PS mid-step; Keras 3 optimizers leave them to the PS. Use a Keras 3 "
               "optimizer with use_ema, or remove it",
}


def _tf_keras():
    """The tf_keras module if this program imported it, else None."""
    return sys.modules.get("tf_keras")


def is_tf_keras_optimizer(obj: Any) -> bool:
    """Whether `obj` is a tf_keras optimizer (current or legacy)."""
    tf_keras = _tf_keras()
    if tf_keras is None:
        return False
    return isinstance(obj, (tf_keras.optimizers.Optimizer,
                            tf_keras.optimizers.legacy.Optimizer))


def is_optimizer(obj: Any) -> bool:
    """Whether `obj` is a Keras 3 or a tf_keras optimizer."""
    if is_tf_keras_optimizer(obj):
        return True
    keras = sys.modules.get("keras")
    return keras is not None and isinstance(obj, keras.optimizers.Optimizer)


def is_autocast_variable(variable: Any) -> bool:
    """Whether `variable` is tf_keras's mixed-precision AutoCastVariable."""
    return any(cls.__name__ == "AutoCastVariable" and cls.__module__.startswith("tf_keras.")
               for cls in type(variable).__mro__)


def _check_current(optimizer) -> str:
    """The class name of a convertible tf_keras optimizer; raises for any other."""
    tf_keras = _tf_keras()
    kind = type(optimizer).__name__
    if isinstance(optimizer, tf_keras.optimizers.legacy.Optimizer):
        raise ValueError(
            "prophet_tf.Strategy does not support the legacy tf_keras optimizers "
            f"(tf_keras.optimizers.legacy.*); use tf_keras.optimizers.{kind} instead. "
            f"Received: optimizer={type(optimizer).__module__}.{kind}")
    if kind == "Nadam" and type(optimizer) is getattr(tf_keras.optimizers, kind, None):
        raise ValueError(f"{_NADAM} Received: optimizer={type(optimizer).__module__}.{kind}")
    if kind not in CONVERTIBLE_OPTIMIZERS or type(optimizer) is not getattr(
            tf_keras.optimizers, kind, None):
        raise ValueError(
            "The parameter server rebuilds a tf_keras optimizer as the Keras 3 optimizer "
            f"of the same class and supports the built-in {list(CONVERTIBLE_OPTIMIZERS)} "
            "(not subclasses or wrappers such as LossScaleOptimizer). "
            f"Received: optimizer={type(optimizer).__module__}.{kind}")
    return kind


def keras3_optimizer_config(optimizer) -> dict:
    """The Keras 3 `keras.optimizers.serialize()` dict equivalent to a tf_keras optimizer.

    Args:
      optimizer: a `tf_keras.optimizers.Optimizer` of a class in
        `CONVERTIBLE_OPTIMIZERS`, with a float learning rate or a schedule of
        a class in `CONVERTIBLE_SCHEDULES`.

    Returns:
      `{"module": "keras.optimizers", "class_name": ..., "config": {...},
      "registered_name": None}`, JSON-serializable.

    Raises:
      ValueError: the optimizer, one of its options or its schedule has no
        Keras 3 equivalent; the message names it.
    """
    import keras

    kind = _check_current(optimizer)
    for option, neutral in _HIDDEN_OPTIONS.items():
        value = getattr(optimizer, option, neutral)
        if value != neutral:
            raise ValueError(f"Keras 3's {kind} has no option {option}, so the parameter "
                             f"server cannot apply it. Received: {option}={value!r}")
    for option, reason in _WORKER_SIDE_OPTIONS.items():
        if getattr(optimizer, option, False):
            raise ValueError(f"prophet_tf cannot train with tf_keras' {kind}({option}=...): "
                             f"{reason}. Received: {option}={getattr(optimizer, option)!r}")
    learning_rate = _learning_rate_config(optimizer)  # Before get_config, which may fail on it.
    config = {key: _plain(value) for key, value in optimizer.get_config().items()
              if key not in _DROPPED_OPTIONS}
    config["learning_rate"] = learning_rate
    target = getattr(keras.optimizers, kind)
    _check_arguments(target, config, f"optimizer {kind}")
    logger.debug("tf_keras optimizer %s described to the PS as Keras 3: %s", kind, config)
    return {"module": "keras.optimizers", "class_name": kind, "config": config,
            "registered_name": None}


def _learning_rate_config(optimizer):
    """A float, or the Keras 3 serialized schedule."""
    tf_keras = _tf_keras()
    rate = optimizer._learning_rate
    if not isinstance(rate, tf_keras.optimizers.schedules.LearningRateSchedule):
        return float(_plain(rate))
    kind = type(rate).__name__
    if kind not in CONVERTIBLE_SCHEDULES or type(rate) is not getattr(
            tf_keras.optimizers.schedules, kind, None):
        raise ValueError(
            "The parameter server runs the learning-rate schedule as the Keras 3 schedule "
            f"of the same class and supports the built-in {list(CONVERTIBLE_SCHEDULES)}. "
            "Use one of those, or a float learning rate changed by a callback. "
            f"Received: learning_rate={type(rate).__module__}.{kind}")
    import keras
    config = {key: _plain(value) for key, value in rate.get_config().items()}
    if config.get("name") is None:  # tf_keras's default; Keras 3 wants its own string.
        config.pop("name", None)
    _check_arguments(getattr(keras.optimizers.schedules, kind), config, f"schedule {kind}")
    return {"module": "keras.optimizers.schedules", "class_name": kind, "config": config,
            "registered_name": None}


def _check_arguments(cls, config: dict, what: str) -> None:
    """Raises unless every entry of `config` is an argument of `cls`."""
    accepted = inspect.signature(cls.__init__).parameters
    unknown = sorted(key for key in config if key not in accepted)
    if unknown:
        raise ValueError(f"Keras 3's {what} has no option {unknown[0]!r}, so the parameter "
                         "server cannot apply it. Received: "
                         + ", ".join(f"{k}={config[k]!r}" for k in unknown))


def _plain(value):
    """JSON-ready Python values for numpy scalars/arrays and eager tensors."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if hasattr(value, "numpy") and callable(value.numpy):
        value = value.numpy()
    if isinstance(value, (np.ndarray, np.generic)):
        return value.tolist()
    return value


def closure_contents(obj) -> list:
    """What the closure cells of function ``obj`` hold (empty cells left out)."""
    contents = []
    for cell in getattr(obj, "__closure__", None) or ():
        try:
            contents.append(cell.cell_contents)
        except ValueError:  # An empty cell.
            pass
    return contents


def search_closures(fn, match: Callable[[Any], Any], follow: Callable[[Any], bool] = None,
                    limit: int = 32):
    """The first non-None ``match(obj)`` over ``fn`` and what it wraps or closes over.

    tf.distribute and autograph wrap the functions Keras hands a strategy, so
    what is sought (the optimizer of an update, the model of a step) sits a
    few levels deep: each object's ``__wrapped__`` and the contents of its
    closure cells (those for which ``follow`` is true; default all) are
    searched, at most ``limit`` objects. None when nothing matches.
    """
    pending, seen = [fn], set()
    while pending:
        obj = pending.pop()
        if id(obj) in seen or len(seen) > limit:
            continue
        seen.add(id(obj))
        found = match(obj)
        if found is not None:
            return found
        if getattr(obj, "__wrapped__", None) is not None:
            pending.append(obj.__wrapped__)
        pending.extend(c for c in closure_contents(obj) if follow is None or follow(c))
    return None


def learning_rate_variable(optimizer):
    """The optimizer's plain learning-rate variable; None for a schedule (the PS runs it).

    Works for Keras 3 (`keras.Variable`) and tf_keras (`tf.Variable`) alike:
    callbacks such as LearningRateScheduler assign that variable.
    """
    import tensorflow as tf
    # Unsupported optimizers (legacy tf_keras ones) have none; they are
    # rejected with a clear error when the strategy registers the model.
    variable = getattr(optimizer, "_learning_rate", None)
    keras = sys.modules.get("keras")
    if keras is not None and isinstance(variable, keras.Variable):
        return variable
    if is_tf_keras_optimizer(optimizer) and isinstance(variable, tf.Variable):
        return variable
    return None


def learning_rate_reader(optimizer) -> Callable[[], float] | None:
    """Reads the optimizer's plain learning rate now; None for a schedule."""
    variable = learning_rate_variable(optimizer)
    return None if variable is None else (lambda: float(variable.numpy()))

