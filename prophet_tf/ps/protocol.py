"""The PS wire protocol: limits, gRPC options, and the hand-framed messages.

Large ``bytes`` fields skip the protobuf object model, which copies them
several times (see ``benchmarks/bench_transport.py``): a message is encoded as
its small fields, serialized by protobuf, followed by the hand-framed bulk
field; decoding walks the top-level fields and returns ``memoryview`` slices of
the input. Protobuf allows fields in any order and concatenated encodings
merge, so the result is a valid message for every protobuf implementation.

Every field number and wire type used here is read from the generated
descriptors (``ps_pb2``), so renumbering a field in ``ps.proto`` changes the
hand framing with it; ``tests/unit/test_protocol.py`` checks each hand-framed
message against the generated classes both ways.

Message size limit: :data:`MAX_MESSAGE_BYTES` (64 MiB) for receiving and
sending, on the server and on the client. A partition is at most
``max_partition_bytes`` (4 MiB by default) and the client cuts Register's
initial values into requests under the limit, so only a push block of more
than 64 MiB (the scheduler's choice) or a variable with a single row above the
limit hits it; gRPC answers such a message with RESOURCE_EXHAUSTED. The limit
also bounds what one request may pin in memory (thread pool size x 64 MiB).
"""

from __future__ import annotations

import struct
from typing import NamedTuple, Sequence

import numpy as np
from google.protobuf import descriptor as descriptor_lib
from google.protobuf.message import DecodeError

from prophet_tf import codec
from prophet_tf.ps.v1 import ps_pb2

__all__ = ["MAX_MESSAGE_BYTES", "MAX_CHUNK_BYTES", "SERVICE_NAME", "channel_options",
           "server_options", "encode_len_field_header", "parse_fields", "encode_push",
           "parse_push_request", "encode_pull_entry", "decode_pull_message",
           "decode_parameter_chunk", "PULL_PACK_BYTES",
           "tolerant_parser", "PulledChunk", "GradientChunk", "PushRequest",
           "encode_swap_version", "decode_swap_version"]

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# The largest partition one message may carry: the limit less what a message
# holds besides the chunk's bytes (ids, dtype, framing).
MAX_CHUNK_BYTES = MAX_MESSAGE_BYTES - 1024
SERVICE_NAME = ps_pb2.DESCRIPTOR.services_by_name["ParameterServer"].full_name


def channel_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """gRPC channel options every worker uses to talk to a PS."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]


def server_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """gRPC server options of a PS task."""
    return channel_options(max_message_bytes) + [
        # Never share the port with another process (port 0 or not).
        ("grpc.so_reuseport", 0),
    ]


# --- protobuf wire format (https://protobuf.dev/programming-guides/encoding/) ---

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
_UINT64_MASK = (1 << 64) - 1
_FD = descriptor_lib.FieldDescriptor
_WIRE_TYPE_OF = {
    **dict.fromkeys((_FD.TYPE_INT32, _FD.TYPE_INT64, _FD.TYPE_UINT32, _FD.TYPE_UINT64,
                     _FD.TYPE_SINT32, _FD.TYPE_SINT64, _FD.TYPE_BOOL, _FD.TYPE_ENUM),
                    _VARINT),
    **dict.fromkeys((_FD.TYPE_DOUBLE, _FD.TYPE_FIXED64, _FD.TYPE_SFIXED64), _I64),
    **dict.fromkeys((_FD.TYPE_FLOAT, _FD.TYPE_FIXED32, _FD.TYPE_SFIXED32), _I32),
    **dict.fromkeys((_FD.TYPE_STRING, _FD.TYPE_BYTES, _FD.TYPE_MESSAGE), _LEN),
}


class _Fields:
    """Field numbers of one generated message, by name, and their wire types."""

    def __init__(self, message_class):
        fields = message_class.DESCRIPTOR.fields_by_name
        for name, field in fields.items():
            setattr(self, name, field.number)
        # Scalar fields only: a packed repeated scalar would be length-delimited.
        self.wire_types = {f.number: _WIRE_TYPE_OF[f.type] for f in fields.values()
                           if f.type in (_FD.TYPE_STRING, _FD.TYPE_BYTES, _FD.TYPE_MESSAGE)
                           or not _is_repeated(f)}


def _is_repeated(field) -> bool:
    is_repeated = getattr(field, "is_repeated", None)  # newer protobuf; label is deprecated
    return is_repeated if isinstance(is_repeated, bool) else field.label == _FD.LABEL_REPEATED


_GRADIENT_CHUNK = _Fields(ps_pb2.GradientChunk)
_PUSH_REQUEST = _Fields(ps_pb2.PushRequest)
_PARAMETER_CHUNK = _Fields(ps_pb2.ParameterChunk)


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


def parse_fields(data, repeated=(), *, types: dict[int, int] | None = None,
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
        types: field number -> the wire type (0 varint, 1 i64, 2 len, 5 i32)
            it must have, e.g. ``_Fields.wire_types``; another wire type is an
            error instead of a value of the wrong Python type.
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
    expected = types or {}
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


# --- PushRequest ---------------------------------------------------------------


def encode_push(worker_id: int, chunks: Sequence, learning_rate: float | None = None
                ) -> tuple[list, int]:
    """PushRequest wire bytes as a list of parts (headers and array views).

    ``chunks`` have ``key``, ``partition``, ``step`` (the iteration) and
    ``array``; the arrays are not copied (``b"".join(parts)`` is the message).

    Returns:
        ``(parts, total_bytes)``.
    """
    parts = [ps_pb2.PushRequest(worker_id=worker_id,
                                learning_rate=learning_rate).SerializeToString()]
    total = len(parts[0])
    for c in chunks:
        data = codec.as_bytes_view(c.array)
        head = ps_pb2.GradientChunk(key=c.key, step=c.step, partition=c.partition,
                                    dtype=codec.dtype_name(c.array.dtype),
                                    batch_rows=c.batch_rows
                                    ).SerializeToString()
        head += encode_len_field_header(_GRADIENT_CHUNK.data, data.nbytes)
        frame = encode_len_field_header(_PUSH_REQUEST.chunks, len(head) + data.nbytes)
        parts += (frame, head, data)
        total += len(frame) + len(head) + data.nbytes
    return parts, total


class GradientChunk(NamedTuple):
    key: int
    step: int  # the iteration the gradient belongs to
    partition: int
    dtype: str
    data: memoryview  # a slice of the received message: no copy
    batch_rows: int | None = None  # see GradientChunk.batch_rows


class PushRequest(NamedTuple):
    worker_id: int
    chunks: list
    malformed: str | None = None  # why the bytes are not a PushRequest
    learning_rate: float | None = None


def parse_push_request(message: bytes, max_chunks: int = 1 << 16) -> PushRequest:
    """A PushRequest whose chunk data are views of ``message``.

    Protobuf's ``chunk.data`` would copy every chunk once more. Malformed
    bytes give a request with ``malformed`` set, which the servicer rejects
    with INVALID_ARGUMENT (a raising deserializer would answer INTERNAL).
    Malformed also covers a known field with another wire type (it would
    reach the servicer as a value of the wrong type) and more than
    ``max_chunks`` chunks or 64 fields in a chunk: each field costs Python
    objects, and 64 MiB of 2-byte fields would build millions of them.
    """
    f, g = _PUSH_REQUEST, _GRADIENT_CHUNK
    try:
        top = parse_fields(message, repeated=(f.chunks,), max_fields=max_chunks + 64,
                           types=f.wire_types)
        if len(top[f.chunks]) > max_chunks:
            raise ValueError(f"more than {max_chunks} chunks")
        chunks = []
        for raw in top[f.chunks]:
            c = parse_fields(raw, max_fields=64, types=g.wire_types)
            chunks.append(GradientChunk(c.get(g.key, 0), c.get(g.step, 0),
                                        c.get(g.partition, 0), str(c.get(g.dtype, b""), "utf-8"),
                                        c.get(g.data, memoryview(b"")),
                                        c.get(g.batch_rows)))
        learning_rate = None
        if f.learning_rate in top:
            learning_rate = struct.unpack("<d", top[f.learning_rate])[0]
        return PushRequest(top.get(f.worker_id, 0), chunks, learning_rate=learning_rate)
    except (ValueError, TypeError, struct.error) as e:
        return PushRequest(0, [], f"{e} ({len(message)} bytes)")


# --- ParameterChunks (Pull's stream) ----------------------------------------------

#: A Pull message holds the most urgent partition ready to send and, after it,
#: the next ones ready (in the order asked) while they add at most this many
#: bytes: small partitions ride along instead of each paying a message's cost
#: at both ends, and no partition waits behind more than this.
PULL_PACK_BYTES = 16 * 1024
_PULL_ENTRY = ps_pb2.ParameterChunks.DESCRIPTOR.fields_by_name["chunks"].number


def encode_pull_entry(key: int, partition: int, version: int, dtype: str,
                      value: np.ndarray) -> bytes:
    """One ``ParameterChunks.chunks`` entry, built with one copy of the tensor
    bytes: on its own a whole Pull message, and entries joined make one."""
    data = codec.as_bytes_view(value)
    head = ps_pb2.ParameterChunk(key=key, partition=partition, version=version,
                                 dtype=dtype).SerializeToString()
    data_header = encode_len_field_header(_PARAMETER_CHUNK.data, data.nbytes)
    return b"".join((encode_len_field_header(_PULL_ENTRY, len(head) + len(data_header)
                                             + data.nbytes), head, data_header, data))


class PulledChunk(NamedTuple):
    """A partition's value as pulled: ``array`` is flat and read-only."""

    key: int
    partition: int
    version: int
    array: np.ndarray


def decode_parameter_chunk(message) -> PulledChunk:
    """A ParameterChunk whose array views ``message`` (no copy)."""
    f = _PARAMETER_CHUNK
    fields = parse_fields(message)
    dtype = bytes(fields.get(f.dtype, b"")).decode()
    return PulledChunk(fields.get(f.key, 0), fields.get(f.partition, 0),
                       fields.get(f.version, 0), codec.from_bytes(fields.get(f.data, b""), dtype))


def decode_pull_message(message: bytes) -> list[PulledChunk]:
    """The partitions of one Pull message (``ParameterChunks``), in order, whose
    arrays view ``message`` (no copy)."""
    entries = parse_fields(message, repeated=(_PULL_ENTRY,), types={_PULL_ENTRY: _LEN})[
        _PULL_ENTRY]
    return [decode_parameter_chunk(entry) for entry in entries]


# --- other requests, parsed by protobuf ---------------------------------------------


class _Malformed:
    """Bytes that did not parse: ``malformed`` says why; other fields read as
    those of an empty message with ``worker_id=-1``."""

    def __init__(self, empty, reason: str):
        self._empty, self.malformed = empty, reason

    def __getattr__(self, name):
        return getattr(self._empty, name)


def tolerant_parser(message_class, max_fields: int = 1 << 17):
    """A request deserializer that never raises.

    gRPC Python (1.85) leaks about 19 KB and answers INTERNAL for every request
    whose deserializer raises; the servicer rejects ``malformed`` requests with
    INVALID_ARGUMENT instead. Counting the fields first bounds what protobuf
    would build from a message of millions of tiny repeated items.
    """
    def parse(message: bytes):
        try:
            parse_fields(message, max_fields=max_fields)
            return message_class.FromString(message)
        except (DecodeError, ValueError) as e:
            return _Malformed(message_class(worker_id=-1), f"{e} ({len(message)} bytes)")
    return parse


def encode_swap_version(version: int) -> bytes:
    """A SwapAverages payload: the version every worker swaps at (little-endian int64)."""
    return struct.pack("<q", version)


def decode_swap_version(payload: bytes) -> int:
    """The version of a SwapAverages payload.

    Raises:
        ValueError: not 8 bytes; says how many.
    """
    if len(payload) != 8:
        raise ValueError("A SwapAverages payload is the version to swap at (8 bytes). "
                         f"Received: {len(payload)} bytes")
    return struct.unpack("<q", payload)[0]
