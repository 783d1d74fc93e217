"""Tensor <-> bytes conversions used on the wire between workers and PS tasks.

Tensors travel as raw C-order little-endian bytes of a dtype named by a
numpy-style string (``float16``, ``bfloat16``, ``float32``, ``float64``).
Nothing here touches individual elements from Python:

* :func:`as_bytes_view` exposes an array's memory as a flat byte ``memoryview``
  (no copy for C-contiguous little-endian arrays, which is every array the
  project produces on x86/ARM hosts).
* :func:`from_bytes` wraps received bytes as an array (no copy; read-only).

The protobuf framing of the PS messages is in :mod:`prophet_tf.ps.protocol`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

import ml_dtypes
import numpy as np

__all__ = [
    "SUPPORTED_DTYPES",
    "to_numpy_dtype",
    "dtype_name",
    "as_bytes_view",
    "from_bytes",
    "tune_allocator",
]

logger = logging.getLogger(__name__)

#: dtype name -> numpy dtype (little-endian). bfloat16 comes from ml_dtypes,
#: the same type TensorFlow and JAX use for ``.numpy()`` of bfloat16 tensors.
_DTYPES: dict[str, np.dtype] = {
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),
}
SUPPORTED_DTYPES: tuple[str, ...] = tuple(_DTYPES)


def to_numpy_dtype(name: str) -> np.dtype:
    """Returns the numpy dtype for a wire dtype name.

    Raises:
        ValueError: the name is not one of :data:`SUPPORTED_DTYPES`.
    """
    try:
        return _DTYPES[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"Unsupported dtype; expected one of {list(SUPPORTED_DTYPES)}. "
            f"Received: dtype={name!r}") from None


def dtype_name(dtype) -> str:
    """Returns the wire name of a numpy/TF/Keras dtype (or dtype name).

    Raises:
        ValueError: the dtype is not one of :data:`SUPPORTED_DTYPES`.
    """
    name = getattr(dtype, "name", dtype)  # tf.DType and np.dtype both have .name
    if not isinstance(name, str):
        name = np.dtype(dtype).name
    to_numpy_dtype(name)
    return name


def as_bytes_view(array: np.ndarray) -> memoryview:
    """Returns a flat, C-order, little-endian byte view of ``array``.

    No copy when the array is C-contiguous and little-endian (the normal case);
    otherwise one contiguous copy is made.
    """
    array = np.asarray(array)
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    array = np.ascontiguousarray(array)
    # Viewing as uint8 also makes the buffer exportable for ml_dtypes types,
    # whose own buffer format code memoryview does not understand.
    return memoryview(array.reshape(-1).view(np.uint8))


def from_bytes(data, dtype, shape=None) -> np.ndarray:
    """Wraps raw little-endian bytes as an array without copying.

    Args:
        data: a bytes-like object (bytes, memoryview, ...). The result keeps it
            alive and is read-only when ``data`` is.
        dtype: wire dtype name or numpy dtype.
        shape: optional target shape; its element count must match.

    Raises:
        ValueError: the byte count does not fit the dtype/shape.
    """
    dt = to_numpy_dtype(dtype) if isinstance(dtype, str) else np.dtype(dtype)
    nbytes = memoryview(data).nbytes
    if shape is not None:
        expected = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        if nbytes != expected:
            raise ValueError(
                f"Expected {expected} bytes for shape {tuple(shape)} of {dt.name}. "
                f"Received: {nbytes} bytes")
    elif nbytes % dt.itemsize:
        raise ValueError(
            f"Byte count is not a multiple of {dt.name}'s item size {dt.itemsize}. "
            f"Received: {nbytes} bytes")
    array = np.frombuffer(data, dtype=dt)
    return array if shape is None else array.reshape(shape)


# --- allocator -------------------------------------------------------------

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def tune_allocator(mmap_threshold: int = 32 << 20, trim_threshold: int = 1 << 30) -> bool:
    """Makes glibc keep freed transfer buffers for reuse. Process-wide.

    Every message received or sent is a fresh multi-MiB buffer. By default
    glibc may serve such buffers with ``mmap`` and give freed memory back to
    the OS, so each step page-faults its buffers in again: on the reference
    machine that was most of the PS's CPU time (kernel time 2.5 s per 2 GB
    received) and halved gRPC throughput. With buffers up to
    ``mmap_threshold`` (glibc's maximum, 32 MiB) taken from the heap and up to
    ``trim_threshold`` of free heap kept, they are recycled. Called by the PS
    main; workers may call it too. A no-op (returning False) without glibc.
    """
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, mmap_threshold) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, trim_threshold) == 1 and ok
    if not ok:
        logger.debug("mallopt refused the allocator settings")
    return ok
