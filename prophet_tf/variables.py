"""The trainable variable whose every read waits for its pulled version.

A `PSVariable` is a `tf.Variable` whose value lives on the parameter server.
The worker keeps a staged copy per key inside the op library; every read is an
`AwaitParam(key, step)` op that completes as soon as the version for the
current training step has been delivered, so layer 0's forward can start while
later layers' parameters are still on the wire. The variable's own storage is
never read after creation.

Versions: version 0 is the initial value (staged locally at creation, and
replaced by the chief's when training starts); version k is the value after k
optimizer steps. A read in training iteration k asks for version k; a read
outside training asks for the latest iteration, which makes evaluate, predict, save and
get_weights see the latest parameters.

Devices: the staging area is host memory, and `AwaitParam`, the step counter
it reads and the variable itself are on the host CPU (the strategy creates the
variable there); a model computing on a GPU gets each read copied to it by
TensorFlow, and its gradient flows back to the variable's handle on the host.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf
from tensorflow.python.eager import record
from tensorflow.python.ops import resource_variable_ops

from prophet_tf import _native


class PSVariable(resource_variable_ops.ResourceVariable):
    """A ResourceVariable whose reads go through `AwaitParam`.

    Instances are made by `adopt`, never constructed directly.
    """

    @classmethod
    def adopt(cls, variable: tf.Variable, key: int, step_variable: tf.Variable) -> "PSVariable":
        """Turns a freshly created ResourceVariable into a PSVariable.

        Stages its initial value as version 0 of `key`.
        """
        initial = variable.read_value().numpy()
        variable.__class__ = cls
        variable._native_key = key
        variable._ps_step = step_variable
        variable._ps_managed = False  # True once training through the PS began.
        _native.declare_param(key, initial.dtype, initial.shape)
        _native.deliver(key, 0, initial)
        return variable

    @property
    def native_key(self) -> int:
        """The op library's key of this variable (its creation index); the PS key is its
        position among the trained variables."""
        return self._native_key

    def initial_numpy(self) -> np.ndarray:
        """Version 0 as staged locally: the value worker 0 registers with the PS.

        Read at version 0 explicitly: in eager mode the step counter has
        already moved on to the step being traced.
        """
        return _native.await_param(0, key=self._native_key, dtype=self.dtype,
                                   shape=self.shape).numpy()

    def _read_variable_op(self, no_copy=False):
        del no_copy  # The staged tensor is shared, never copied.
        resource_variable_ops.variable_accessed(self)
        # await_param runs on the host CPU; the step is read where it lives, the host.
        value = _native.await_param(self._ps_step.read_value(), key=self._native_key,
                                    dtype=self.dtype, shape=self.shape)
        # Gradients flow to the variable's handle as through ReadVariableOp.
        record.record_operation("AwaitParam", [value], [self.handle],
                                backward_function=lambda x: [x],
                                forward_function=lambda x: [x])
        return value

    def _serialize_to_tensors(self):
        # tf.train.Checkpoint reads the handle directly; give it the staged value.
        return {"VARIABLE_VALUE": self.read_value()}

    def _restore_from_tensors(self, restored_tensors):
        return self.assign(restored_tensors["VARIABLE_VALUE"])

    def assign(self, value, use_locking=None, name=None, read_value=True):
        value = self._staged_assign(lambda: tf.convert_to_tensor(value, dtype=self.dtype))
        return value if read_value else None

    def assign_add(self, delta, use_locking=None, name=None, read_value=True):
        value = self._staged_assign(lambda: self.read_value() + tf.cast(delta, self.dtype))
        return value if read_value else None

    def assign_sub(self, delta, use_locking=None, name=None, read_value=True):
        value = self._staged_assign(lambda: self.read_value() - tf.cast(delta, self.dtype))
        return value if read_value else None

    def _staged_assign(self, compute):
        if not tf.executing_eagerly():
            raise NotImplementedError(
                f"Assigning the trainable variable {self.name!r} inside a tf.function is not "
                "supported under prophet_tf.Strategy: its value lives on the parameter "
                "server, which applies the optimizer. (Keras variable constraints do this; "
                "remove the constraint.)")
        if self._ps_managed:
            raise NotImplementedError(
                f"Assigning the trainable variable {self.name!r} after training through the "
                "parameter server started is not supported; set or load weights before the "
                "first fit().")
        value = compute()
        if not self._shape.is_compatible_with(value.shape):
            raise ValueError(f"Cannot assign to {self.name!r}: its shape is {self._shape}. "
                             f"Received: value.shape={value.shape}")
        _native.deliver(self._native_key, 0, np.asarray(value.numpy(), dtype=self.dtype.as_numpy_dtype))
        return value
