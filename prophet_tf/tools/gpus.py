"""Which GPU each worker of `prophet-tf launch --gpus N` gets (CUDA_VISIBLE_DEVICES).

Standard library only: the launcher never imports TensorFlow.
"""
from __future__ import annotations

import re

__all__ = ["CUDA_DEVICES_ENV", "gpu_devices"]

CUDA_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"
# What CUDA accepts in CUDA_VISIBLE_DEVICES: an index, or a GPU or MIG UUID (or its prefix).
_CUDA_DEVICE = re.compile(r"^(\d+|GPU-[0-9a-fA-F-]+|MIG-[0-9a-zA-Z/-]+)$")


def gpu_devices(num_gpus: int, visible: str | None) -> list[str]:
    """The device of each of `num_gpus` workers, one per GPU.

    Args:
      num_gpus: how many GPUs (and workers).
      visible: the caller's CUDA_VISIBLE_DEVICES, or None when it is unset.

    Returns:
      The first `num_gpus` entries of `visible`, else "0".."num_gpus-1".

    Raises:
      ValueError: num_gpus < 1; `visible` empty, malformed, naming a device
        twice, or naming fewer than `num_gpus` devices.
    """
    if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or num_gpus < 1:
        raise ValueError(f"--gpus must be an integer >= 1. Received: --gpus {num_gpus!r}")
    if visible is None:
        return [str(i) for i in range(num_gpus)]
    received = f"Received: {CUDA_DEVICES_ENV}={visible!r}, --gpus {num_gpus}"
    if not visible.strip():
        # CUDA reads an empty list as "no GPU", so no worker would get one.
        raise ValueError(f"{CUDA_DEVICES_ENV} is set but empty, which hides every GPU; unset it "
                         f"or list the GPUs to use. {received}")
    devices = [d.strip() for d in visible.split(",")]
    for device in devices:
        if not _CUDA_DEVICE.match(device):
            raise ValueError(f"{CUDA_DEVICES_ENV} must be a comma-separated list of GPU indices "
                             f"or UUIDs, e.g. 0,1,3; {device!r} is neither. {received}")
    duplicates = sorted({d for d in devices if devices.count(d) > 1})
    if duplicates:
        raise ValueError(f"{CUDA_DEVICES_ENV} names a device twice ({', '.join(duplicates)}); "
                         f"one worker per GPU needs distinct devices. {received}")
    if len(devices) < num_gpus:
        raise ValueError(f"--gpus {num_gpus} needs {num_gpus} devices but {CUDA_DEVICES_ENV} "
                         f"names {len(devices)}. {received}")
    return devices[:num_gpus]
