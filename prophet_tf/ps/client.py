"""The worker's side of the PS protocol: :class:`PSClient` and :func:`variable_specs`.

Tensors never go through per-element Python work (framing in
:mod:`prophet_tf.ps.protocol`): a push block is framed by hand around
``memoryview``\\ s of the gradient arrays and joined into one ``bytes`` (the
only copy on the client); a pulled chunk is decoded into a read-only array that
views the received message (no copy).

Errors from the PS arrive as ``grpc.RpcError`` with the server's status code
and message (``INVALID_ARGUMENT``, ``NOT_FOUND``, ``FAILED_PRECONDITION``,
``DEADLINE_EXCEEDED``, ``RESOURCE_EXHAUSTED``...).
"""

from __future__ import annotations

import dataclasses
from concurrent import futures
from typing import Iterable, Iterator, Mapping, Sequence

import grpc
import numpy as np

from prophet_tf import codec, optimizer_policy
from prophet_tf.ps import health, sharding
from prophet_tf.ps import security as security_lib
from prophet_tf.ps.protocol import (MAX_MESSAGE_BYTES, SERVICE_NAME, PulledChunk,
                                    channel_options, decode_pull_message, encode_push,
                                    encode_swap_version)
from prophet_tf.ps.v1 import ps_pb2

__all__ = ["PSClient", "Chunk", "PulledChunk", "register_all", "variable_specs"]

_REQUEST_OVERHEAD = 64 * 1024  # room for specs and framing next to the bulk bytes


@dataclasses.dataclass(frozen=True)
class Chunk:
    """A gradient (or initial value) for rows of one partition, to push."""

    key: int
    partition: int
    step: int  # the iteration
    array: np.ndarray
    batch_rows: int | None = None  # rows of this worker's share (GradientChunk.batch_rows)


class PSClient:
    """A worker's link to one PS task: two gRPC connections, pushes on one.

    Args:
        address: the PS task's ``host:port``.
        worker_id: this worker's index in ``[0, num_workers)``.
        num_workers: W.
        max_message_bytes: per-message limit (the server's is
            :data:`prophet_tf.ps.protocol.MAX_MESSAGE_BYTES`).
        options: extra gRPC channel options.
        security: token and TLS settings; default from the environment
            (:func:`prophet_tf.ps.security.client_security`).

    Raises:
        prophet_tf.ps.security.SecurityError: the token/TLS settings are unusable.
    """

    def __init__(self, address: str, worker_id: int, num_workers: int, *,
                 max_message_bytes: int = MAX_MESSAGE_BYTES, options: Sequence = (),
                 security: security_lib.ClientSecurity | None = None, shapers=None):
        self.address = address
        self.worker_id = worker_id
        self.num_workers = num_workers
        self.max_message_bytes = max_message_bytes
        self._security = security_lib.client_security() if security is None else security
        # The bench's fallback link shaping, (push, pull) token buckets or None;
        # made by the caller (prophet_tf.ps.shaping.from_env).
        self._shapers = shapers
        # Two TCP connections: pushes on one, everything else (pulls above all)
        # on the other. A push's answer, and the HTTP/2 window updates that let
        # the next push flow, then never queue behind megabytes of pulled
        # parameters in one connection's socket buffers, which would idle the
        # push link. A local subchannel pool each keeps gRPC from sharing one
        # connection between the two channels.
        opts = channel_options(max_message_bytes) + list(options) + [
            ("grpc.use_local_subchannel_pool", 1)]
        self._channel = security_lib.create_channel(address, opts, security=self._security)
        self._push_channel = security_lib.create_channel(address, opts, security=self._security)
        method = f"/{SERVICE_NAME}/"
        self._register = self._channel.unary_unary(
            method + "Register", request_serializer=ps_pb2.RegisterRequest.SerializeToString,
            response_deserializer=ps_pb2.RegisterResponse.FromString)
        self._push = self._push_channel.unary_unary(
            method + "Push", request_serializer=b"".join,
            response_deserializer=ps_pb2.PushResponse.FromString)
        self._pull = self._channel.unary_stream(
            method + "Pull", request_serializer=ps_pb2.PullRequest.SerializeToString,
            response_deserializer=decode_pull_message)
        self._heartbeat = self._channel.unary_unary(
            method + "Heartbeat", request_serializer=ps_pb2.HeartbeatRequest.SerializeToString,
            response_deserializer=ps_pb2.HeartbeatResponse.FromString)
        self._owed = self._channel.unary_unary(
            method + "Owed", request_serializer=ps_pb2.OwedRequest.SerializeToString,
            response_deserializer=ps_pb2.OwedResponse.FromString)
        self._gather = self._channel.unary_unary(
            method + "Gather", request_serializer=ps_pb2.GatherRequest.SerializeToString,
            response_deserializer=ps_pb2.GatherResponse.FromString)
        self._verdict = self._channel.unary_unary(
            method + "Verdict", request_serializer=ps_pb2.GatherRequest.SerializeToString,
            response_deserializer=ps_pb2.GatherResponse.FromString)
        self._swap = self._channel.unary_unary(
            method + "SwapAverages", request_serializer=ps_pb2.GatherRequest.SerializeToString,
            response_deserializer=ps_pb2.GatherResponse.FromString)
        self._read_state = self._channel.unary_stream(
            method + "ReadOptimizerState",
            request_serializer=ps_pb2.OptimizerStateRequest.SerializeToString,
            response_deserializer=ps_pb2.OptimizerSlot.FromString)
        self._write_state = self._channel.stream_unary(
            method + "WriteOptimizerState",
            request_serializer=ps_pb2.OptimizerSlot.SerializeToString,
            response_deserializer=ps_pb2.OptimizerStateWritten.FromString)

    def wait_ready(self, timeout: float) -> None:
        """Blocks until the PS reports SERVING through grpc.health.v1.

        Raises:
            TimeoutError: (:class:`prophet_tf.ps.health.NotServingError`) not
                SERVING within ``timeout`` seconds; names the address and the
                last answer.
            prophet_tf.ps.health.HealthCheckRefused: the PS refused the check
                (e.g. UNAUTHENTICATED: this worker lacks the PS's token).
        """
        health.wait_serving(self.address, timeout, service=SERVICE_NAME,
                            security=self._security)

    def register(self, variables: Sequence, optimizer_config: str,
                 initial_values: Mapping[int, np.ndarray] | None = None, *,
                 max_partition_bytes: int = sharding.DEFAULT_MAX_PARTITION_BYTES,
                 resume_step: int = 0, ps0_address: str = "",
                 timeout: float | None = None) -> ps_pb2.RegisterResponse:
        """Declares the model; worker 0 also sends this PS's initial values.

        The initial values go in as many Register calls as the message limit
        needs (the PS ignores a value it already has, so a retry is safe).

        Args:
            variables: ``ps_pb2.VariableSpec`` list (see :func:`variable_specs`).
            optimizer_config: see :func:`prophet_tf.keras_optimizer.config_json`.
            initial_values: key -> full array; only from worker 0.
            max_partition_bytes: the workers' sharding limit; the PS's
                partitions are checked against the same plan.
            resume_step: iterations this worker's own state has trained (restored
                from a backup); 0 for a fresh start.
            ps0_address: PS task 0's ``host:port`` as this worker dials it (the
                PS tasks agree on global_clipnorm's norm there).
            timeout: seconds per call.

        Returns:
            The PS's last RegisterResponse (its partitions and the version
            the job starts from: 0, ``resume_step`` or a restored checkpoint's).

        Raises:
            grpc.RpcError: the PS rejected the declaration.
            ValueError: the PS's partitions differ from this worker's plan (the
                two run with different ``max_partition_bytes`` or PS counts).
        """
        variables = list(variables)
        request = dict(worker_id=self.worker_id, num_workers=self.num_workers,
                       variables=variables, optimizer_config=optimizer_config,
                       max_partition_bytes=max_partition_bytes, resume_step=resume_step,
                       ps0_address=ps0_address)
        response = self._register(ps_pb2.RegisterRequest(**request), timeout=timeout)
        spread = not optimizer_policy.needs_whole_variables(
            optimizer_policy.parse_config(optimizer_config))
        expected = sharding.owned_by(
            sharding.plan(variables, response.num_ps, max_partition_bytes, spread=spread),
            response.ps_index)
        got = [(p.key, p.partition, p.ps_index, p.begin, p.end) for p in response.partitions]
        if got != [(p.key, p.partition, p.ps_index, p.begin, p.end) for p in expected]:
            raise ValueError(
                f"PS {response.ps_index} at {self.address} owns other partitions than this "
                f"worker's plan (max_partition_bytes={max_partition_bytes}, num_ps="
                f"{response.num_ps}); start every task with the same settings. Received: "
                f"{len(response.partitions)} partitions, expected {len(expected)}")
        if initial_values is None:
            return response
        batch, size = [], 0
        limit = self.max_message_bytes - _REQUEST_OVERHEAD - 64 * len(variables)
        for p in expected:
            value = sharding.elements(np.asarray(initial_values[p.key]), p)
            if batch and size + value.nbytes > limit:
                response = self._register(
                    ps_pb2.RegisterRequest(**request, initial_values=batch), timeout=timeout)
                batch, size = [], 0
            batch.append(ps_pb2.ParameterChunk(
                key=p.key, partition=p.partition, version=0,
                dtype=codec.dtype_name(value.dtype), data=codec.as_bytes_view(value).tobytes()))
            size += value.nbytes
        if batch:
            response = self._register(
                ps_pb2.RegisterRequest(**request, initial_values=batch), timeout=timeout)
        return response

    def push_future(self, chunks: Sequence[Chunk], timeout: float | None = None,
                    learning_rate: float | None = None) -> grpc.Future:
        """Sends one block of gradient chunks as one PushRequest, without waiting.

        The request is serialized now: the chunks' arrays may be reused as
        soon as this returns. The future's result is the PushResponse (its
        ``duplicates``: chunks the PS had already counted, i.e. retries); its
        exception a ``grpc.RpcError`` when the PS rejected the block (nothing
        of it was used). `learning_rate`: see PushRequest.

        Raises:
            ValueError: the block exceeds ``max_message_bytes``.
        """
        parts, total = encode_push(self.worker_id, chunks, learning_rate)
        if total > self.max_message_bytes:
            raise ValueError(f"A push block may carry at most {self.max_message_bytes} bytes; "
                             f"split it. Received: {len(chunks)} chunks, {total} bytes")
        if shaper := self._shaper(0):
            shaper.consume(total)
        return self._push.future(parts, timeout=timeout)

    def pull(self, items: Iterable, min_version: int,
             timeout: float | None = None) -> Iterator[PulledChunk]:
        """Streams partitions (``(key, partition)`` pairs or Partitions) in order.

        Each arrives once its version is ``>= min_version``; the whole call
        ends with DEADLINE_EXCEEDED after ``timeout`` seconds. Closing the
        iterator early cancels the call.
        """
        request = ps_pb2.PullRequest(worker_id=self.worker_id, min_version=min_version, items=[
            ps_pb2.KeyPartition(key=k, partition=p) for k, p in map(_key_partition, items)])
        call = self._pull(request, timeout=timeout)
        shaper = self._shaper(1)
        try:
            for message in call:  # one or more partitions each (PULL_PACK_BYTES)
                for chunk in message:
                    if shaper:
                        shaper.consume(chunk.array.nbytes)
                    yield chunk
        finally:
            call.cancel()

    def _shaper(self, direction: int):
        """The link shaping the client was given (0: push, 1: pull), or None."""
        return self._shapers[direction] if self._shapers else None

    def heartbeat(self, steps_pushed: int, leaving: bool = False,
                  timeout: float | None = None) -> str:
        """Tells the PS this worker is alive (or leaving after ``steps_pushed``).

        Returns:
            The job's failure message ("" while the job is healthy).
        """
        request = ps_pb2.HeartbeatRequest(worker_id=self.worker_id, steps_pushed=steps_pushed,
                                          leaving=leaving)
        return self._heartbeat(request, timeout=timeout).failure

    def owed(self, max_version: int, workers: Iterable[int],
             timeout: float | None = None) -> int:
        """Partitions of ``max_version`` or older that ``workers``' pulls asked
        this PS for and it has not sent yet."""
        request = ps_pb2.OwedRequest(worker_id=self.worker_id, max_version=max_version,
                                     workers=list(workers))
        return self._owed(request, timeout=timeout).partitions

    def gather(self, round_id: int, payload: bytes, timeout: float | None = None) -> list[bytes]:
        """One all-gather round: every worker's payload of ``round_id``, in worker order."""
        request = ps_pb2.GatherRequest(worker_id=self.worker_id, round=round_id, payload=payload)
        return list(self._gather(request, timeout=timeout).payloads)

    def verdict_future(self, step: int, finite: bool, timeout: float | None = None):
        """Sends this worker's verdict of ``step`` (a loss-scaled model); the
        future's result is every worker's (:func:`verdicts`)."""
        request = ps_pb2.GatherRequest(worker_id=self.worker_id, round=step,
                                       payload=b"\x01" if finite else b"\x00")
        return self._verdict.future(request, timeout=timeout)

    def swap_averages_future(self, swap: int, version: int, timeout: float | None = None):
        """use_ema's end of fit: this worker's call of swap round ``swap`` at
        ``version`` (``ema.py``); the future completes once the PS has swapped."""
        request = ps_pb2.GatherRequest(worker_id=self.worker_id, round=swap,
                                       payload=encode_swap_version(version))
        return self._swap.future(request, timeout=timeout)

    def read_optimizer_state(self, min_version: int, timeout: float | None = None) -> list:
        """The optimizer's slots (``OptimizerSlot``) of this PS's partitions at ``min_version``."""
        request = ps_pb2.OptimizerStateRequest(worker_id=self.worker_id, min_version=min_version)
        return list(self._read_state(request, timeout=timeout))

    def write_optimizer_state(self, slots: Iterable, timeout: float | None = None) -> int:
        """Sends whole-variable slots; the PS keeps its rows. Returns how many it set."""
        return self._write_state(iter(slots), timeout=timeout).slots

    def close(self) -> None:
        self._channel.close()
        self._push_channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def register_all(clients: Sequence[PSClient], *args, **kwargs) -> list[ps_pb2.RegisterResponse]:
    """``client.register(*args, **kwargs)`` on every PS task at once, their answers in
    the clients' order: a PS imports TensorFlow at its first Register (seconds), so
    the tasks do it together, not one after another.

    Raises:
        The first client's (in order) exception, once every call has ended.
    """
    kwargs.setdefault("ps0_address", clients[0].address)  # the clients are in task order
    with futures.ThreadPoolExecutor(len(clients), thread_name_prefix="prophet-tf-register") as pool:
        calls = [pool.submit(client.register, *args, **kwargs) for client in clients]
    return [call.result() for call in calls]


def verdicts(response) -> list[bool]:
    """Every worker's verdict in a Verdict answer, in worker order (True: finite)."""
    return [p == b"\x01" for p in response.payloads]


def _key_partition(item):
    if isinstance(item, tuple):
        return item
    return item.key, item.partition


def variable_specs(variables: Sequence) -> list[ps_pb2.VariableSpec]:
    """Specs for Keras/TF variables: key = position, priority = position.

    ``name`` is the Keras variable path (``v.path``), or the TF name.
    """
    return [ps_pb2.VariableSpec(key=i, name=getattr(v, "path", None) or v.name,
                                shape=[int(d) for d in v.shape],
                                dtype=codec.dtype_name(v.dtype), priority=i)
            for i, v in enumerate(variables)]
