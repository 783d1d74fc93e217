"""The hand-framed PS messages against the generated protobuf classes, both ways.

Every message ``prophet_tf.ps.protocol`` frames or parses by hand must be what
protobuf itself would read and write; the field numbers come from the
generated descriptors, so a renumbered field in ``ps.proto`` moves with them.
"""

import struct
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from prophet_tf.ps import protocol
from prophet_tf.ps.client import Chunk
from prophet_tf.ps.v1 import ps_pb2

GRAD = np.arange(12, dtype=np.float32).reshape(3, 4)
HALF = np.array([1.5, -2.0], ml_dtypes.bfloat16)


def fields(chunk):
    return (chunk.key, chunk.step, chunk.partition, chunk.dtype, bytes(chunk.data))


@pytest.mark.parametrize("learning_rate", [None, 0.0, 0.125])
def test_an_encoded_push_parses_with_protobuf(learning_rate):
    chunks = [Chunk(3, 1, 2**40, GRAD[1:]), Chunk(0, 0, 7, HALF)]
    parts, size = protocol.encode_push(5, chunks, learning_rate)
    wire = b"".join(parts)
    assert len(wire) == size
    reference = ps_pb2.PushRequest.FromString(wire)
    assert reference.worker_id == 5
    assert [fields(c) for c in reference.chunks] == [
        (3, 2**40, 1, "float32", GRAD[1:].tobytes()), (0, 7, 0, "bfloat16", HALF.tobytes())]
    assert reference.HasField("learning_rate") == (learning_rate is not None)
    if learning_rate is not None:
        assert reference.learning_rate == learning_rate


@pytest.mark.parametrize("learning_rate", [None, 0.0, 0.125])
def test_a_protobuf_push_parses_by_hand(learning_rate):
    message = ps_pb2.PushRequest(worker_id=6, learning_rate=learning_rate, chunks=[
        ps_pb2.GradientChunk(key=2, step=9, partition=4, dtype="float32",
                             data=GRAD.tobytes()),
        ps_pb2.GradientChunk(key=1, step=9, partition=0, dtype="bfloat16",
                             data=HALF.tobytes())])
    parsed = protocol.parse_push_request(message.SerializeToString())
    assert parsed.malformed is None
    assert parsed.worker_id == 6
    assert parsed.learning_rate == learning_rate
    assert [fields(c) for c in parsed.chunks] == [fields(c) for c in message.chunks]


def test_a_hand_encoded_push_parses_by_hand():
    parts, _ = protocol.encode_push(1, [Chunk(0, 2, 3, GRAD)], 0.5)
    parsed = protocol.parse_push_request(b"".join(parts))
    assert parsed.malformed is None and parsed.learning_rate == 0.5
    assert [fields(c) for c in parsed.chunks] == [(0, 3, 2, "float32", GRAD.tobytes())]


def test_a_push_field_of_the_wrong_wire_type_is_malformed():
    # learning_rate is a double (fixed 64 bits); sent as a varint it must not parse.
    number = ps_pb2.PushRequest.DESCRIPTOR.fields_by_name["learning_rate"].number
    parsed = protocol.parse_push_request(bytes([number << 3 | 0, 1]))
    assert parsed.malformed and "wire type 0" in parsed.malformed, parsed.malformed


def test_pull_entries_alone_and_joined_parse_with_protobuf_as_pull_messages():
    one = protocol.encode_pull_entry(2, 1, 9, "bfloat16", HALF)
    two = protocol.encode_pull_entry(3, 0, 9, "float32", GRAD)
    chunk = ps_pb2.ParameterChunk(key=2, partition=1, version=9, dtype="bfloat16",
                                  data=HALF.tobytes())
    assert ps_pb2.ParameterChunks.FromString(one) == ps_pb2.ParameterChunks(chunks=[chunk])
    joined = ps_pb2.ParameterChunks.FromString(one + two)
    assert [(c.key, c.partition) for c in joined.chunks] == [(2, 1), (3, 0)]
    assert joined.chunks[1].data == GRAD.tobytes()


def test_a_pull_message_decodes_to_its_partitions_in_order_as_views():
    message = ps_pb2.ParameterChunks(chunks=[
        ps_pb2.ParameterChunk(key=k, partition=k + 1, version=5, dtype="float32",
                              data=(GRAD * k).tobytes()) for k in (4, 0, 2)]).SerializeToString()
    pulled = protocol.decode_pull_message(message)
    assert [(c.key, c.partition, c.version) for c in pulled] == [(4, 5, 5), (0, 1, 5), (2, 3, 5)]
    np.testing.assert_array_equal(pulled[2].array, (GRAD * 2).reshape(-1))
    assert not pulled[0].array.flags.writeable  # a view of the message


def test_a_pull_message_whose_entry_is_not_a_message_is_an_error():
    with pytest.raises(ValueError, match="wire type 0"):
        protocol.decode_pull_message(bytes([1 << 3 | 0, 1]))


def test_a_protobuf_parameter_chunk_decodes_by_hand():
    message = ps_pb2.ParameterChunk(key=4, partition=3, version=2**33, dtype="float32",
                                    data=GRAD.tobytes()).SerializeToString()
    pulled = protocol.decode_parameter_chunk(message)
    assert pulled[:3] == (4, 3, 2**33)
    np.testing.assert_array_equal(pulled.array, GRAD.reshape(-1))
    assert not pulled.array.flags.writeable  # a view of the message


def test_gradient_and_parameter_chunks_number_partition_from_their_own_descriptors():
    # The two messages number `partition` differently: each parser must use its own.
    gradient = ps_pb2.GradientChunk.DESCRIPTOR.fields_by_name["partition"].number
    parameter = ps_pb2.ParameterChunk.DESCRIPTOR.fields_by_name["partition"].number
    assert gradient != parameter
    [pulled] = protocol.decode_pull_message(protocol.encode_pull_entry(1, 5, 7, "float32", GRAD))
    assert (pulled.key, pulled.partition, pulled.version) == (1, 5, 7)


@pytest.mark.parametrize("message", [
    ps_pb2.RegisterRequest(worker_id=1, num_workers=2, optimizer_config="{}", resume_step=3,
                           variables=[ps_pb2.VariableSpec(key=0, name="v", shape=[2, 3],
                                                          dtype="float32")]),
    ps_pb2.PullRequest(worker_id=1, min_version=4,
                       items=[ps_pb2.KeyPartition(key=0, partition=1)]),
    ps_pb2.HeartbeatRequest(worker_id=1, steps_pushed=8, leaving=True),
], ids=["register", "pull", "heartbeat"])
def test_the_tolerant_parser_reads_what_protobuf_writes(message):
    parsed = protocol.tolerant_parser(type(message))(message.SerializeToString())
    assert parsed == message


def test_the_tolerant_parser_marks_garbage_instead_of_raising():
    parsed = protocol.tolerant_parser(ps_pb2.PullRequest)(b"\x12\xff\x01abc")
    assert parsed.malformed and "(6 bytes)" in parsed.malformed
    assert parsed.worker_id == -1


def test_parse_fields_reads_a_double_and_keeps_64_bit_varints():
    message = ps_pb2.PushRequest(worker_id=-1, learning_rate=2.5).SerializeToString()
    top = protocol.parse_fields(message)
    assert top[1] == -1
    assert struct.unpack("<d", top[3])[0] == 2.5


def test_limits_and_options_agree():
    assert protocol.MAX_CHUNK_BYTES < protocol.MAX_MESSAGE_BYTES
    assert protocol.SERVICE_NAME == "prophet_tf.ps.v1.ParameterServer"
    channel = dict(protocol.channel_options())
    server = dict(protocol.server_options())
    for name in ("grpc.max_receive_message_length", "grpc.max_send_message_length"):
        assert channel[name] == server[name] == protocol.MAX_MESSAGE_BYTES
    assert server["grpc.so_reuseport"] == 0


def test_the_client_and_the_optimizer_policy_stay_light():
    """The worker's client never imports the server; the policy imports no TF/Keras."""
    code = ("import sys, prophet_tf.ps.client, prophet_tf.keras_optimizer; "
            "print(sorted(m for m in ('prophet_tf.ps.server', 'tensorflow', 'keras') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip() == "[]", out
