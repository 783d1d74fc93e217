"""Which device a worker computes on: `Strategy(device=...)` and `prophet-tf doctor`.

The model's forward and backward run on the compute device. AwaitParam and
PushGrad have CPU kernels only and work in host memory (the staging area, the
gradient queue), so they and the parameters' own variables stay on the
compute device's host CPU; TensorFlow copies each parameter read to the
compute device and each gradient back.
"""
from __future__ import annotations

import os

import tensorflow as tf

from prophet_tf import environment

#: Read when `Strategy(device=None)`; unset or empty: `default_device()`.
DEVICE_ENV = environment.DEVICE

__all__ = ["DEVICE_ENV", "default_device", "resolve", "host_of", "canonical"]


def canonical(name: str) -> str:
    """`name` with every field filled in, as TensorFlow's runtime names devices
    ("/job:localhost/replica:0/task:0/device:GPU:0")."""
    spec = tf.DeviceSpec.from_string(name)
    if spec.device_type:
        # DeviceSpec upper-cases only CPU and GPU; the runtime's types are upper case.
        spec = spec.replace(device_type=spec.device_type.upper())
    full = tf.DeviceSpec(job="localhost", replica=0, task=0, device_type="CPU", device_index=0)
    return full.make_merged_spec(spec).to_string()


def default_device() -> str:
    """The first GPU TensorFlow sees, else the CPU."""
    gpus = tf.config.list_logical_devices("GPU")
    return canonical((gpus or tf.config.list_logical_devices("CPU"))[0].name)


def host_of(device: str) -> str:
    """The CPU of the task that owns `device`: where the op library's ops run."""
    return tf.DeviceSpec.from_string(device).replace(device_type="CPU",
                                                     device_index=0).to_string()


def resolve(device=None) -> str:
    """The canonical name of the device a worker computes on.

    Args:
      device: a TensorFlow device string ("/gpu:1", "/cpu:0",
        "/job:localhost/replica:0/task:0/device:GPU:0", ...) or a
        `tf.config.LogicalDevice`; None reads PROPHET_TF_DEVICE, else
        `default_device()`.

    Raises:
      ValueError: `device` is malformed or names no device of this process;
        the message names what was received and lists the devices there are.
    """
    if device is None:
        from_env = os.environ.get(DEVICE_ENV, "")
        if not from_env:
            return default_device()
        return _existing(from_env, f"{DEVICE_ENV}={from_env!r}")
    return _existing(device, f"device={device!r}")


def _existing(device, received: str) -> str:
    if isinstance(device, tf.config.LogicalDevice):
        device = device.name
    if not isinstance(device, str) or not device.strip():
        raise ValueError("The compute device must be a TensorFlow device string such as "
                         f"'/gpu:0' or '/cpu:0'. Received: {received}")
    try:
        name = canonical(device.strip())
    except ValueError as e:
        raise ValueError(f"The compute device is not a TensorFlow device string "
                         f"({str(e).rstrip('.')}); write it like '/gpu:0' or '/cpu:0'. "
                         f"Received: {received}") from None
    local = [d.name for d in tf.config.list_logical_devices()]
    if name in {canonical(d) for d in local}:
        return name
    hint = ""
    if tf.DeviceSpec.from_string(name).device_type == "GPU" and \
            not tf.config.list_logical_devices("GPU"):
        hint = (" TensorFlow sees no GPU" + ("" if tf.test.is_built_with_cuda() else
                                            " (this TensorFlow is built without CUDA)") + ".")
    raise ValueError(f"The compute device {name} does not exist in this process; "
                     f"TensorFlow's devices here: {', '.join(local)}.{hint} Received: {received}")
