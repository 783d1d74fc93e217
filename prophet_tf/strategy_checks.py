"""What prophet_tf.Strategy checks of what Keras and TensorFlow hand it: the data of a
train step, input options, XLA, a LossScaleOptimizer's own apply, an optimizer's
reduction of its gradients, the variables it may adopt and the optimizer behind an
update."""
from __future__ import annotations

import sys

import tensorflow as tf
from tensorflow.python.distribute import distribute_lib
from tensorflow.python.ops import control_flow_util

from prophet_tf import _keras_compat, loss_scaling

__all__ = ["FLOAT_DTYPES", "rows_of", "check_replication_mode", "reject_xla",
           "unhandled_loss_scale_optimizer", "reduces_gradients", "is_plain_resource_variable",
           "may_become_ps_variable", "optimizer_of"]

#: The dtypes of variables the PS trains.
FLOAT_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)


def rows_of(args) -> tf.Tensor:
    """The rows of a step's batch: the first dimension of its first tensor."""
    flat = tf.nest.flatten(args)
    if not flat:
        raise ValueError("A Keras train step under prophet_tf.Strategy needs a batch of data. "
                         f"Received: args={args!r}")
    return tf.shape(flat[0], out_type=tf.int64)[0]


def check_replication_mode(options) -> None:
    if options is not None and options.experimental_replication_mode == \
            distribute_lib.InputReplicationMode.PER_REPLICA:
        raise NotImplementedError(
            "prophet_tf.Strategy has one replica per worker: InputReplicationMode.PER_REPLICA "
            "does not apply. Received: experimental_replication_mode=PER_REPLICA")


def reject_xla() -> None:
    if control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
        raise ValueError("prophet_tf's ops have no XLA kernels: compile the model with "
                         "jit_compile=False (the default under a tf.distribute strategy). "
                         "Received: jit_compile=True")


def unhandled_loss_scale_optimizer():
    """The Keras LossScaleOptimizer whose own ``apply`` is running (on this
    thread's stack, while tracing), unless loss_scaling.install replaced it."""
    for frame in _callers():
        owner = frame.f_locals.get("self")
        if loss_scaling.is_loss_scale_optimizer(owner) and not loss_scaling.installed(owner):
            return owner
    return None


def _callers():
    """This thread's stack frames, innermost first, from the checker that asks (or its
    caller) up: the checkers look for names and objects their own frames do not hold."""
    frame = sys._getframe(2)
    while frame is not None:
        yield frame
        frame = frame.f_back


#: The functions through which Keras 3 (``_all_reduce_sum_gradients``) and tf_keras
#: (``all_reduce_sum_gradients``, ``_all_reduce_sum_fn``) all-reduce an optimizer's
#: gradients.
_GRADIENT_REDUCTIONS = frozenset({"_all_reduce_sum_gradients", "all_reduce_sum_gradients",
                                  "_all_reduce_sum_fn"})


def reduces_gradients() -> bool:
    """Whether the all-reduce being served is an optimizer's, of its gradients (one of
    :data:`_GRADIENT_REDUCTIONS` is on this thread's stack, while tracing), not one a
    layer or the user's step function asked for."""
    return any(frame.f_code.co_name in _GRADIENT_REDUCTIONS for frame in _callers())


def differentiates_all_reduce() -> bool:
    """Whether the all-reduce being served is the gradient of a forward one, as TensorFlow's
    ``ReplicaContext.all_reduce`` defines it (an all-reduce of the upstream gradients, made
    by a function inside its ``grad_wrapper``), while the tape's gradient is traced."""
    return any(".grad_wrapper.<locals>." in frame.f_code.co_qualname
               and frame.f_code.co_filename.endswith("distribute_lib.py")
               for frame in _callers())


def is_plain_resource_variable(variable) -> bool:
    from tensorflow.python.ops import resource_variable_ops
    return type(variable) is resource_variable_ops.ResourceVariable


#: The start of the names of the variables the strategy makes for itself (step
#: records, metric shadows): never the model's.
INTERNAL_NAME = "prophet_tf_"


def is_internal(creator_kwargs: dict) -> bool:
    """Whether a variable created with these arguments is one of the strategy's own."""
    return str(creator_kwargs.get("name") or "").startswith(INTERNAL_NAME)


def made_by_an_optimizer() -> bool:
    """Whether the variable being created is an optimizer's (its slots, its step count):
    a Keras 3 or tf_keras optimizer's method is on this thread's stack."""
    return any(_keras_compat.is_optimizer(frame.f_locals.get("self")) for frame in _callers())


def may_become_ps_variable(creator_kwargs: dict) -> bool:
    """Whether a variable created with these arguments can be adopted (trainable, float),
    decided before it exists; the adoption itself checks the variable it gets."""
    trainable = creator_kwargs.get("trainable")
    if trainable is None:  # tf.Variable's default
        trainable = creator_kwargs.get("synchronization") != tf.VariableSynchronization.ON_READ
    if not trainable:
        return False
    dtype = creator_kwargs.get("dtype")
    if dtype is None:
        dtype = getattr(creator_kwargs.get("initial_value"), "dtype", None)
    return dtype is None or tf.as_dtype(dtype).base_dtype in FLOAT_DTYPES


def optimizer_of(update_fn):
    """The Keras 3 or tf_keras optimizer whose update step `update_fn` is (a closure over it).

    tf.distribute wraps the function (autograph), so closures are searched a
    few levels deep.
    """
    optimizer = _keras_compat.search_closures(
        update_fn, lambda obj: obj if _keras_compat.is_optimizer(obj) else None)
    if optimizer is not None:
        return optimizer
    raise ValueError("prophet_tf.Strategy trains with a Keras optimizer through "
                     f"model.compile/fit or optimizer.apply. Received: update function {update_fn!r}")
