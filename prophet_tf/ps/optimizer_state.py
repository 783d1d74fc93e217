"""The optimizer's state of one PS task, read for a saved model and written back to resume.

A saved Keras model holds its optimizer's variables; under prophet_tf the
trained ones live here, one set per partition. Keras 3 optimizers keep each
kind of slot as a list indexed like their variables (``Adam._momentums``,
``SGD.momentums``, ``Adagrad._accumulators``, ...): :func:`slot_lists` finds
those lists, so the PS and the worker, whose optimizers are the same class,
name every slot the same way. A slot of partition p covers its elements
``[begin, end)`` of the variable flattened; the worker joins the partitions.
A variable cut into partitions but applied whole (``whole_apply.py``) has
whole slots, sent once, as partition 0's.
"""
from __future__ import annotations

import numpy as np

from prophet_tf import codec
from prophet_tf.ps import registration, sharding
from prophet_tf.ps.errors import invalid
from prophet_tf.ps.v1 import ps_pb2

__all__ = ["slot_lists", "read", "write"]


def slot_lists(optimizer) -> dict[str, list]:
    """``{attribute: [slot variable or None per optimizer variable]}`` of a built optimizer
    (None also for a placeholder that holds no state)."""
    variables = list(getattr(optimizer, "_trainable_variables", None) or [])
    found = {}
    for name, value in sorted(vars(optimizer).items()):
        if name == "_trainable_variables" or not isinstance(value, (list, tuple)):
            continue
        if len(value) == len(variables) and variables and all(
                v is None or hasattr(v, "assign") for v in value):
            # Adafactor's unfactored variables keep integer placeholders (Variable(0))
            # in its factored slots' lists: no state, and not a parameter dtype.
            value = [v if v is not None and _dtype(v) in codec.SUPPORTED_DTYPES else None
                     for v in value]
            if any(v is not None for v in value):
                found[name] = value
    return found


def _dtype(variable) -> str:
    dtype = variable.dtype  # a str for Keras 3, a tf.DType for tf_keras
    return getattr(dtype, "name", dtype)


def read(parts: dict, optimizer, version: int) -> list[ps_pb2.OptimizerSlot]:
    """Every slot of every partition (call under the apply lock)."""
    slots = slot_lists(optimizer)
    out = []
    for (key, partition), part in sorted(parts.items()):
        if part.whole is not None and partition != 0:
            continue  # the whole variable's slots go with partition 0
        index = optimizer._get_variable_index(registration.optimized(part))
        for name, values in slots.items():
            if values[index] is None:
                continue
            array = np.asarray(values[index].numpy())
            out.append(ps_pb2.OptimizerSlot(
                key=key, partition=partition, slot=name, begin=part.plan.begin,
                dtype=codec.dtype_name(array.dtype), shape=list(array.shape),
                data=array.tobytes(), version=version))
    return out


def write(parts: dict, optimizer, messages) -> int:
    """Sets this PS's elements of each whole-variable slot received; returns how many were set.

    Raises:
        RpcError: an unknown slot or key, or a shape that does not fit the variable.
    """
    slots = slot_lists(optimizer)
    by_key: dict[int, list] = {}
    for part in parts.values():
        by_key.setdefault(part.plan.key, []).append(part)
    count = 0
    for message in messages:
        if getattr(message, "malformed", None):  # bytes that did not parse (protocol.py)
            raise invalid(f"The request is not an OptimizerSlot. Received: {message.malformed}")
        if message.slot not in slots:
            raise invalid(f"The optimizer {type(optimizer).__name__} has no slot "
                          f"{message.slot!r}; it has {sorted(slots)}. "
                          f"Received: slot={message.slot!r}")
        try:
            array = np.frombuffer(message.data, codec.to_numpy_dtype(message.dtype)).reshape(
                tuple(message.shape))
        except (ValueError, TypeError, KeyError) as e:
            raise invalid(f"Optimizer slot {message.slot!r} of variable {message.key} does not "
                          f"parse: {e}. Received: dtype={message.dtype!r}, "
                          f"shape={list(message.shape)}, {len(message.data)} bytes") from None
        for part in by_key.get(message.key, []):
            if part.whole is not None and part.plan.partition != 0:
                continue  # one slot for the whole variable, set at partition 0
            variable = slots[message.slot][optimizer._get_variable_index(
                registration.optimized(part))]
            if variable is None:
                continue
            if part.whole is not None or part.shape == tuple(part.spec.shape):
                # The whole variable: the slot as it is (a factored slot, as
                # Adafactor's, has a shape of its own).
                expected, values = tuple(variable.shape), array
            else:
                expected = tuple(part.spec.shape)
                values = sharding.elements(array, part.plan) if array.shape == expected else None
            if array.shape != expected:
                raise invalid(f"Optimizer slot {message.slot!r} of variable {message.key} "
                              f"partition {part.plan.partition} needs the whole slot of shape "
                              f"{expected}. Received: shape {array.shape}")
            variable.assign(values.astype(variable.dtype))
            count += 1
    return count
