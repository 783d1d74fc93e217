"""Tensor <-> bytes conversions used on the wire between workers and PS tasks.

Tensors travel as raw C-order little-endian bytes of a dtype named by a
numpy-style string (``float16``, ``bfloat16``, ``float32``, ``float64``).
Nothing here touches individual elements from Python:

* :func:`as_bytes_view` exposes an array's memory as a flat byte ``memoryview``
  (no copy for C-contiguous little-endian arrays, which is every array the
  project produces on x86/ARM hosts).
* :func:`from_bytes` wraps received bytes as an array (no copy; read-only).

It also holds the few protobuf *wire-format* helpers that let large ``bytes``
fields skip the protobuf object model, which copies them several times (see
``benchmarks/bench_transport.py``): a message is encoded as its small fields,
serialized by protobuf, followed by the hand-framed bulk field; decoding walks
the top-level fields and returns ``memoryview`` slices of the input. Protobuf
allows fields in any order and concatenated encodings merge, so the result is a
valid message for every protobuf implementation.
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
    "encode_len_field_header",
    "parse_fields",
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


# --- protobuf wire format (https://protobuf.dev/programming-guides/encoding/) ---

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
_WIRE_TYPES = {"varint": _VARINT, "i64": _I64, "len": _LEN, "i32": _I32}
_UINT64_MASK = (1 << 64) - 1


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        bits = value & 0x7F
        value >>= 7
        if value:
            out.append(bits | 0x80)
        else:
            out.append(bits)
            return bytes(out)


def encode_len_field_header(field_number: int, length: int) -> bytes:
    """Tag and length prefix of a length-delimited field (bytes/string/message)."""
    return _varint((field_number << 3) | _LEN) + _varint(length)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("Truncated protobuf varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            # A 10th byte carries one bit of a 64-bit value; protobuf drops the rest.
            return result & _UINT64_MASK, pos
        shift += 7
        if shift > 63:
            raise ValueError("Malformed protobuf varint (more than 10 bytes)")


def parse_fields(data, repeated=(), *, types: dict[int, str] | None = None,
                 max_fields: int | None = None) -> dict[int, object]:
    """Decodes the top level of a protobuf message without copying bulk fields.

    Varint fields decode to ``int`` (int32/int64 two's complement is folded to
    a signed value); length-delimited and fixed32/64 fields to ``memoryview``
    slices of ``data`` (decode a double with ``struct.unpack("<d", view)``). For
    a scalar field the last occurrence wins, as in protobuf; a field number in
    ``repeated`` collects a list.

    Args:
        data: the message bytes (bytes-like).
        repeated: field numbers that collect every occurrence in a list.
        types: field number -> the wire type it must have (``"varint"``,
            ``"i64"``, ``"len"`` or ``"i32"``); another wire type is an error
            instead of a value of the wrong Python type.
        max_fields: the most fields (occurrences, any number) accepted; each
            costs Python time and memory, so untrusted input must be capped
            before a 64 MiB message of 2-byte fields builds millions of them.

    Raises:
        ValueError: the bytes are not a well-formed protobuf message, or break
            ``types``/``max_fields``.
    """
    buf = memoryview(data).cast("B") if not isinstance(data, memoryview) else data
    if buf.format != "B" or buf.ndim != 1:
        buf = buf.cast("B")
    expected = {number: _WIRE_TYPES[name] for number, name in (types or {}).items()}
    fields: dict[int, object] = {number: [] for number in repeated}
    pos, end, count = 0, len(buf), 0
    while pos < end:
        count += 1
        if max_fields is not None and count > max_fields:
            raise ValueError(f"More than {max_fields} protobuf fields in one message")
        tag, pos = _read_varint(buf, pos)
        number, wire_type = tag >> 3, tag & 7
        if not 0 < number < 1 << 29:  # protobuf's range; protobuf rejects others too
            raise ValueError(f"Invalid protobuf field number {number}")
        if number in expected and wire_type != expected[number]:
            raise ValueError(f"Protobuf field {number} has wire type {wire_type}, "
                             f"expected {expected[number]}")
        if wire_type == _VARINT:
            value, pos = _read_varint(buf, pos)
            if value >= 1 << 63:
                value -= 1 << 64
        elif wire_type == _LEN:
            length, pos = _read_varint(buf, pos)
            if length > end - pos:
                raise ValueError(
                    f"Truncated protobuf field {number}: needs {length} bytes, "
                    f"{end - pos} left")
            value, pos = buf[pos:pos + length], pos + length
        elif wire_type in (_I64, _I32):
            width = 8 if wire_type == _I64 else 4
            if pos + width > end:
                raise ValueError(f"Truncated protobuf field {number}")
            value, pos = buf[pos:pos + width], pos + width
        else:
            raise ValueError(f"Unsupported protobuf wire type {wire_type} in field {number}")
        if number in repeated:
            fields[number].append(value)
        else:
            fields[number] = value
    if pos != end:
        raise ValueError("Truncated protobuf message")
    return fields


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
