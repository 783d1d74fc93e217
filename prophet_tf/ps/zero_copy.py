"""Handing a PS task's arrays to TensorFlow and back without copying them.

``tf.constant(array)`` copies a numpy array twice: TensorFlow's own defensive
copy, then, as numpy's buffers are 16-byte aligned and TensorFlow's kernels
need 64, a second one into an aligned buffer. ``tensor.numpy()`` copies once
more: with large partitions, the busiest native frames of a PS task
(``docs/records/2026-12-06-apply-without-copies.md``).

So the sums are built in 64-byte aligned buffers (:func:`aligned_empty`),
given to the traced update through DLPack, which wraps the buffer as it is
(:func:`to_tensor`), and the new value is read as a view of the output
tensor (:func:`to_array`). Neither side is written afterwards: a sum is the
PS's own and is dropped after its update, and TensorFlow copies a variable's
buffer before an update if a tensor still shares it.
"""
from __future__ import annotations

import numpy as np

__all__ = ["ALIGNMENT", "aligned_empty", "to_tensor", "to_array"]

#: Bytes TensorFlow's CPU kernels expect a tensor's buffer to be aligned to
#: (Eigen's largest vector alignment). A DLPack tensor on a less aligned
#: buffer is not copied, and a kernel that relies on the alignment aborts.
ALIGNMENT = 64


def aligned_empty(shape, dtype) -> np.ndarray:
    """An uninitialised C-order array whose buffer starts on :data:`ALIGNMENT`."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    raw = np.empty(count * dtype.itemsize + ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start:start + count * dtype.itemsize].view(dtype).reshape(shape)


def to_tensor(array: np.ndarray):
    """``array`` as an eager tensor: its buffer itself when it is aligned, C-contiguous
    and writable (DLPack exports no read-only buffer), else a copy. The caller must
    not write ``array`` while the tensor lives."""
    import tensorflow as tf  # loaded by the first Register

    if (array.ctypes.data % ALIGNMENT == 0 and array.flags.c_contiguous
            and array.flags.writeable and array.size):
        try:
            return tf.experimental.dlpack.from_dlpack(array.__dlpack__())
        except BufferError:  # a dtype DLPack cannot describe
            pass
    return tf.constant(array)


def to_array(tensor) -> np.ndarray:
    """A tensor's value as a numpy array that views its buffer (a copy for a
    scalar: numpy cannot view a 0-d bfloat16 tensor). Not to be written."""
    if tensor.shape.rank == 0:
        return np.asarray(tensor.numpy())
    return np.asarray(tensor)
