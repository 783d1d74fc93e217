"""State of one PS task: its partitions, gradient sums and the Keras optimizer.

The servicer is plain Python: call ``Register``/``Push``/``Pull`` with a request
message and anything that has ``abort(code, details)`` (and, for ``Pull``,
``time_remaining()``/``is_active()``) and it works without a network;
``server.py`` wires it into gRPC.

Step rules for a partition at ``version`` v (v optimizer steps applied):

* a chunk for step ``v`` is summed in, once per worker; a second copy from the
  same worker (a retry, or twice in one request) is a duplicate;
* a chunk for step ``v - 1`` is a duplicate (every worker had to push it for v
  to exist);
* step ``< v - 1`` is "from the past" and step ``> v`` "too far ahead":
  FAILED_PRECONDITION;
* duplicates are ignored and counted in ``PushResponse.duplicates``.

A request is validated completely before anything changes; any error rejects
all of it. A gradient holding a NaN or an Inf is such an error (INVALID_ARGUMENT
naming the variable, partition and step): summed in, it would poison the
parameters for good, so training fails at once instead.

When all W workers have pushed step v of a partition, the sum goes to one
background thread that applies the optimizer (most urgent first: lowest step,
then lowest priority value) and publishes version v + 1.

Sums are accumulated in float32 for float16/bfloat16 gradients (so W low-
precision gradients do not lose bits; the optimizer casts the sum to the
variable dtype as Keras does), and in the gradient dtype for float32/float64
(integer-valued float32 sums are exact up to 2**24). Workers are summed in
arrival order.

Optimizer application: one Keras optimizer built on one ``keras.Variable`` per
owned partition. Before a partition's update for step k the iteration counter
is set to k and ``optimizer.apply`` runs for that partition alone (both in one
``tf.function`` traced per partition), so learning rate schedules, Adam's bias
correction, clipping by value and weight decay see exactly what single-process
Keras sees at step k. Applies run one at a time on the apply thread. A
learning rate changed on the workers (callbacks) arrives with each step's
pushes; schedules run here. Not carried over: variable constraints (not in
the spec). Options that couple
variables (``global_clipnorm``, EMA, gradient accumulation,
``LossScaleOptimizer``, Nadam's shared ``u_product``) are rejected at Register;
``clipnorm`` and whole-tensor optimizers (Lamb, Adafactor) are accepted only
when no variable is split.

Liveness: from Register on, each worker sends a Heartbeat about once a
second. A worker silent for ``worker_timeout_s`` is lost and the job fails:
every waiting Pull, later Push and Heartbeat answer carries the reason. A
worker that leaves normally says how many steps it pushed; a Pull for a
version it can never complete then fails instead of waiting.

Checkpoints (``checkpoint.py``) are taken on the apply thread when the last
partition reaches a version, and restored at the first Register: the one of
the workers' ``resume_step`` when they resume from their own backup, else the
newest.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import logging
import math
import os
import queue
import threading
import time
from typing import Callable, Iterator

import grpc
import keras
import numpy as np
import tensorflow as tf

from prophet_tf import codec
from prophet_tf.ps import checkpoint as checkpoint_lib
from prophet_tf.ps import sharding
from prophet_tf.ps.v1 import ps_pb2

__all__ = ["ParameterServerServicer", "NO_WEIGHT_DECAY_KEY", "encode_parameter_chunk"]

logger = logging.getLogger(__name__)

#: Optional top-level key of the optimizer JSON: the variable keys the worker's
#: optimizer exempts from weight decay (``exclude_from_weight_decay`` is not
#: part of Keras' serialized config). See ``client.optimizer_config_json``.
NO_WEIGHT_DECAY_KEY = "prophet_tf_no_weight_decay"

# Optimizers whose update of a row range depends only on that range's rows.
_ELEMENTWISE = {"SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax",
                "Ftrl", "Lion"}
# Optimizers that need a whole variable (norms/factorisations over it).
_WHOLE_VARIABLE = {"Lamb", "Adafactor"}
_SUM_DTYPES = {"float16": np.float32, "bfloat16": np.float32,
               "float32": np.float32, "float64": np.float64}
_PULL_POLL_SECONDS = 1.0
# Pulls one worker may have waiting at once (its engine needs one per PS). With
# W workers that is 4W threads of the server pool of 16 + 8W (server.py).
MAX_PULLS_PER_WORKER = 4


class RpcError(Exception):
    """A request error: the RPC is aborted with ``code`` and ``message``."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def _invalid(message):
    return RpcError(grpc.StatusCode.INVALID_ARGUMENT, message)


def _precondition(message):
    return RpcError(grpc.StatusCode.FAILED_PRECONDITION, message)


def encode_parameter_chunk(key: int, partition: int, version: int, dtype: str,
                           value: np.ndarray) -> bytes:
    """Serialized ``ParameterChunk``, built with one copy of the tensor bytes."""
    data = codec.as_bytes_view(value)
    head = ps_pb2.ParameterChunk(key=key, partition=partition, version=version,
                                 dtype=dtype).SerializeToString()
    return b"".join((head, codec.encode_len_field_header(5, data.nbytes), data))


@dataclasses.dataclass(eq=False)
class _Part:
    """One owned partition. Fields below ``variable`` change under the lock."""

    spec: ps_pb2.VariableSpec
    plan: sharding.Partition
    shape: tuple
    dtype: np.dtype
    variable: object  # keras.Variable holding rows [row_begin, row_end)
    cond: threading.Condition
    version: int = -1  # -1: no initial value yet
    arrived: set = dataclasses.field(default_factory=set)  # workers in step `version`
    acc: np.ndarray | None = None
    acc_owned: bool = False  # acc is our buffer (not a view of a request)
    encoded: bytes | None = None  # ParameterChunk of `version`, shared by pullers
    failed: str | None = None
    apply_fn: object = None  # traced optimizer update of this partition

    @property
    def name(self):
        return f"{self.spec.name!r} (key={self.plan.key}, partition={self.plan.partition})"


@dataclasses.dataclass
class _Model:
    specs: list  # VariableSpec by key
    optimizer_config: dict  # as compared between workers (name removed)
    optimizer: object
    partitions: list  # full plan
    max_partition_bytes: int = 0
    parts: dict = None  # this PS's _Part by (key, partition)


class ParameterServerServicer:
    """Implements the ``prophet_tf.ps.v1.ParameterServer`` methods.

    Args:
        num_workers: W, the number of workers whose gradients make a step.
        ps_index: this task's index among the PS tasks.
        num_ps: number of PS tasks.
        max_partition_bytes: the sharding limit; must equal the workers'.
        max_chunk_bytes: largest partition this PS accepts (bounded by the
            message size limit); a variable with a bigger single row is
            rejected at Register.
        worker_timeout_s: a worker silent for this long after a Heartbeat is
            lost: the job fails (see ``failure``). Watching starts with a
            worker's first Heartbeat, so a client that never sends one (a
            tool, a test) is not watched.
        startup_timeout_s: once any worker has sent a Heartbeat, every other
            one must send its first within this long, or the job fails.
        checkpoint: save checkpoints by this policy, and restore the newest
            (or the one the workers resume from) at the first Register.
        on_failure: called once, on another thread, with the message when the
            job fails (a lost worker, a model conflict).
    """

    def __init__(self, num_workers: int, ps_index: int = 0, num_ps: int = 1,
                 max_partition_bytes: int = sharding.DEFAULT_MAX_PARTITION_BYTES,
                 max_chunk_bytes: int | None = None, worker_timeout_s: float = 10.0,
                 startup_timeout_s: float = 300.0,
                 checkpoint: checkpoint_lib.CheckpointPolicy | None = None,
                 on_failure: Callable[[str], None] | None = None):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1. Received: num_workers={num_workers}")
        if not 0 <= ps_index < num_ps:
            raise ValueError("ps_index must be in [0, num_ps). "
                             f"Received: ps_index={ps_index}, num_ps={num_ps}")
        if max_partition_bytes < 1:
            raise ValueError("max_partition_bytes must be >= 1. "
                             f"Received: max_partition_bytes={max_partition_bytes}")
        if not worker_timeout_s > 0:
            raise ValueError(f"worker_timeout_s must be > 0. Received: {worker_timeout_s!r}")
        self.num_workers = num_workers
        self.ps_index = ps_index
        self.worker_timeout_s = float(worker_timeout_s)
        if not startup_timeout_s > 0:
            raise ValueError(f"startup_timeout_s must be > 0. Received: {startup_timeout_s!r}")
        self.startup_timeout_s = float(startup_timeout_s)
        self._first_heartbeat: float | None = None
        self._on_failure = on_failure
        self._checkpointer = checkpoint_lib.Checkpointer(checkpoint) if checkpoint else None
        self.num_ps = num_ps
        self.max_partition_bytes = max_partition_bytes
        self.max_chunk_bytes = max_chunk_bytes
        self._lock = threading.Lock()  # model definition, versions, sums
        self._apply_lock = threading.Lock()  # the optimizer and the variables
        self._model: _Model | None = None
        # Set when the job can never make progress (a worker declared another
        # model, a worker was lost): every waiting and later Pull/Push and
        # every Heartbeat answer carries it.
        self._failure: str | None = None
        # Liveness: worker -> monotonic time of its last Heartbeat; workers
        # that left normally -> the number of steps they pushed.
        self._last_seen: dict[int, float] = {}
        self._steps_pushed: dict[int, int] = {}
        self._left: dict[int, int] = {}
        # The first Register's resume_step (all must send the same) and the
        # version the job starts from (a restored checkpoint's, or that step).
        self._requested_resume: int | None = None
        self._start_version = 0
        # version -> how many partitions reached it (a version is complete,
        # and may be checkpointed, when all have).
        self._at_version: dict[int, int] = {}
        self._stopping = threading.Event()
        self._watchdog = threading.Thread(target=self._watch_workers, daemon=True,
                                          name=f"prophet-tf-ps{ps_index}-watchdog")
        self._watchdog.start()
        # step -> the learning rate the workers trained that step with (set
        # by callbacks on the workers; absent: the optimizer's own).
        self._learning_rates: dict[int, float] = {}
        self._parts: dict[tuple[int, int], _Part] = {}
        self._pulls = collections.Counter()  # worker -> pulls in progress
        self._rejections = _RejectionLog()
        self._applies: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = itertools.count()
        self._closed = False
        self._apply_thread = threading.Thread(target=self._apply_loop, daemon=True,
                                              name=f"prophet-tf-ps{ps_index}-apply")
        self._apply_thread.start()

    # ------------------------------------------------------------------ RPCs

    def Register(self, request, context):
        return self._answer(self._register, "Register", request, context)

    def Push(self, request, context):
        return self._answer(self._push, "Push", request, context)

    def Heartbeat(self, request, context):
        return self._answer(self._heartbeat, "Heartbeat", request, context)

    def _answer(self, handler, rpc: str, request, context):
        """Runs a unary handler; its RpcError becomes the call's status."""
        try:
            return handler(request)
        except RpcError as e:
            self._rejections.log(rpc, request, e)
            context.abort(e.code, e.message)

    def Pull(self, request, context) -> Iterator[bytes]:
        """Yields serialized ``ParameterChunk`` messages (see server.py).

        A waiting pull holds one of the server's threads, so each worker may
        have at most MAX_PULLS_PER_WORKER in progress: no client can tie up
        the thread pool with pulls of versions that never come.
        """
        try:
            parts = self._pull_targets(request)
            self._begin_pull(request.worker_id)
        except RpcError as e:
            self._rejections.log("Pull", request, e)
            context.abort(e.code, e.message)
        try:
            for part in parts:
                try:
                    data = self._wait_version(part, request.min_version, context)
                except RpcError as e:
                    self._rejections.log("Pull", request, e)
                    context.abort(e.code, e.message)
                if data is None:  # the client went away
                    return
                yield data
        finally:
            with self._lock:
                self._pulls[request.worker_id] -= 1

    def _begin_pull(self, worker_id: int) -> None:
        with self._lock:
            if self._pulls[worker_id] >= MAX_PULLS_PER_WORKER:
                raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"worker {worker_id} already has {MAX_PULLS_PER_WORKER} pulls "
                               "in progress on this PS (the limit; a worker needs one). "
                               f"Received: a Pull from worker_id={worker_id}")
            self._pulls[worker_id] += 1

    # -------------------------------------------------------------- Register

    def _register(self, request):
        if getattr(request, "malformed", None):  # bytes that did not parse (server.py)
            raise _invalid(f"The request is not a RegisterRequest. Received: {request.malformed}")
        W = self.num_workers
        if request.num_workers != W:
            raise _invalid(f"This PS runs with num_workers={W}. "
                           f"Received: num_workers={request.num_workers}")
        if not 0 <= request.worker_id < W:
            raise _invalid(f"worker_id must be in [0, {W}). "
                           f"Received: worker_id={request.worker_id}")
        if request.initial_values and request.worker_id != 0:
            raise _invalid("Only worker 0 sends initial values. "
                           f"Received: {len(request.initial_values)} initial values "
                           f"from worker_id={request.worker_id}")
        self._check_declaration(request)
        if request.resume_step < 0:
            raise _invalid(f"resume_step must be >= 0. Received: resume_step={request.resume_step}")
        with self._lock:
            model = self._model
            if model is None:
                model = self._define_model(request)  # validates; installs nothing yet
                snapshot = self._choose_checkpoint(model, request.resume_step)
            else:
                try:
                    self._check_same_model(model, request)
                except RpcError as e:
                    self._failure = f"worker {request.worker_id} declared another model: {e.message}"
                    self._notify_all_locked()
                    raise
                self._check_same_resume(request)
            initial = self._check_initial_values(model, request.initial_values)
            if self._model is None:
                self._install_model(model)
                self._requested_resume = self._start_version = request.resume_step
                if snapshot is not None:
                    self._restore(snapshot)
                elif request.resume_step:
                    logger.warning("The workers resume at step %d and this PS has no "
                                   "checkpoint of it: worker 0's values become version %d; "
                                   "the optimizer's state starts afresh.",
                                   request.resume_step, request.resume_step)
            self._left.pop(request.worker_id, None)
        # Values are assigned outside the state lock (pulls and pushes of other
        # partitions go on); a partition that already has one keeps it, so a
        # retried Register is harmless.
        for part, array in initial:
            with self._apply_lock:
                if part.version >= 0:  # only changes under the apply lock before 0
                    continue
                part.variable.assign(array.reshape(part.shape))
                # A fresh PS takes the workers' step: they may resume from
                # their own backup (BackupAndRestore) without a PS checkpoint.
                version = self._start_version
                encoded = encode_parameter_chunk(part.plan.key, part.plan.partition, version,
                                                 part.spec.dtype, self._read(part))
                with self._lock:
                    part.encoded, part.version = encoded, version
                    self._count_version_locked(version)
                    part.cond.notify_all()
        with self._lock:
            parts = list(self._parts.values())
            version = self._start_version
        return ps_pb2.RegisterResponse(ps_index=self.ps_index, num_ps=self.num_ps,
                                       partitions=[p.plan.to_proto() for p in parts],
                                       version=version)

    def _check_declaration(self, request) -> None:
        """Rejects a declaration that is malformed on its own.

        Runs before the declaration defines the model or is compared with it,
        so garbage never counts as "another model" (which fails the job), and
        before anything is planned or allocated: the number of partitions and
        the bytes are computed from the shapes first.
        """
        variables = request.variables
        if len(variables) > _MAX_PARTITIONS:
            raise _invalid(f"Register declares more variables than a PS accepts "
                           f"({_MAX_PARTITIONS}). Received: {len(variables)} variables")
        _check_keys(variables)
        if request.max_partition_bytes < 0:
            raise _invalid("max_partition_bytes must be >= 0 (0: the PS's setting). "
                           f"Received: max_partition_bytes={request.max_partition_bytes}")
        limit = request.max_partition_bytes or self.max_partition_bytes
        total_bytes = total_partitions = 0
        for s in variables:
            what = f"Variable {s.key} ({_short(s.name)})"
            if len(s.name) > _MAX_NAME_CHARS:
                raise _invalid(f"{what} has a name of more than {_MAX_NAME_CHARS} characters. "
                               f"Received: {len(s.name)} characters")
            if s.dtype not in codec.SUPPORTED_DTYPES:
                raise _invalid(f"{what} has an unsupported dtype; expected one of "
                               f"{list(codec.SUPPORTED_DTYPES)}. Received: dtype={_short(s.dtype)}")
            if len(s.shape) > _MAX_RANK:
                raise _invalid(f"{what} has more than {_MAX_RANK} dimensions. "
                               f"Received: {len(s.shape)} dimensions")
            if any(d < 0 for d in s.shape):
                raise _invalid(f"{what} has a negative dimension. "
                               f"Received: shape={_short(list(s.shape))}")
            # numpy and TF need the product of the dimensions (zeros aside) in
            # an int64 even for an empty array.
            itemsize = codec.to_numpy_dtype(s.dtype).itemsize
            if itemsize * math.prod(max(d, 1) for d in s.shape) >= 2**63:
                raise _invalid(f"{what} has dimensions whose product overflows int64. "
                               f"Received: shape={_short(list(s.shape))}, dtype={s.dtype}")
            nbytes, pieces = _size_and_partitions(s, limit)
            total_bytes += nbytes
            total_partitions += pieces
            if total_partitions > _MAX_PARTITIONS:
                raise _invalid(
                    f"The model would be cut into more than {_MAX_PARTITIONS} partitions "
                    f"(at {what}: {pieces} of at most max_partition_bytes={limit}). Received: "
                    f"shape={_short(list(s.shape))}, dtype={s.dtype}")
        memory = _memory_bytes()
        if memory is not None and total_bytes > self.num_ps * memory:
            largest = max(variables, key=lambda s: _size_and_partitions(s, limit)[0])
            raise _invalid(
                f"The model has {total_bytes} bytes of parameters, more than {self.num_ps} PS "
                f"task(s) with this machine's memory ({memory} bytes) could hold. Received: "
                f"largest variable {largest.key} ({_short(largest.name)}) of "
                f"shape={_short(list(largest.shape))}, dtype={largest.dtype}")
        self._parse_optimizer_config(request.optimizer_config)

    def _define_model(self, request) -> _Model:
        specs = sorted(request.variables, key=lambda s: s.key)  # checked by _check_declaration
        limit = request.max_partition_bytes or self.max_partition_bytes
        partitions = sharding.plan(specs, self.num_ps, limit)
        owned = sum(p.nbytes for p in partitions if p.ps_index == self.ps_index)
        memory = _memory_bytes()
        if memory is not None and owned > memory:
            raise _invalid(f"This PS's partitions would take {owned} bytes, more than this "
                           f"machine's memory ({memory} bytes). Received: {len(specs)} "
                           f"variables of {sum(p.nbytes for p in partitions)} bytes")
        if self.max_chunk_bytes is not None:
            for p in partitions:
                if p.nbytes > self.max_chunk_bytes:
                    s = specs[p.key]
                    raise _invalid(
                        f"Variable {p.key} ({s.name!r}) has a row of {p.nbytes} bytes, more "
                        f"than one message may carry ({self.max_chunk_bytes}); partitions "
                        f"are row ranges. Received: shape={list(s.shape)}, dtype={s.dtype}")
        config = self._parse_optimizer_config(request.optimizer_config)
        optimizer, no_decay = self._build_optimizer(config, specs, partitions, limit)
        model = _Model(specs, _comparable(config), optimizer, partitions, limit)
        model.parts = self._make_parts(model, no_decay)
        return model

    def _parse_optimizer_config(self, text):
        if len(text) > _MAX_OPTIMIZER_CONFIG_CHARS:
            raise _invalid(f"optimizer_config is longer than {_MAX_OPTIMIZER_CONFIG_CHARS} "
                           f"characters. Received: {len(text)} characters")
        try:
            config = json.loads(text)
            if not isinstance(config, dict) or "class_name" not in config:
                raise ValueError("not a keras.optimizers.serialize() dict")
            if not isinstance(config.get("config", {}), dict):
                raise ValueError('its "config" is not a dict')
            exempt = config.get(NO_WEIGHT_DECAY_KEY) or []
            if not (isinstance(exempt, list) and all(type(k) is int for k in exempt)):
                raise ValueError(f"{NO_WEIGHT_DECAY_KEY} is not a list of variable keys")
        except (ValueError, RecursionError) as e:  # RecursionError: absurdly nested JSON
            raise _invalid("optimizer_config must be the JSON of "
                           f"keras.optimizers.serialize(optimizer) ({e}). "
                           f"Received: optimizer_config={text[:200]!r}") from None
        return config

    def _build_optimizer(self, config, specs, partitions, max_partition_bytes):
        config = json.loads(json.dumps(config))  # Keras mutates what it is given
        no_decay = set(config.pop(NO_WEIGHT_DECAY_KEY, None) or ())
        try:
            optimizer = keras.optimizers.deserialize(json.loads(json.dumps(config)))
            if not isinstance(optimizer, keras.optimizers.Optimizer):
                # keras.optimizers.deserialize only knows the classes in its
                # ALL_OBJECTS (Keras 3.15 leaves out Lamb and returns a str).
                optimizer = keras.saving.deserialize_keras_object(config)
        except Exception as e:  # Keras raises ValueError/TypeError for unknown classes
            raise _invalid(f"Cannot rebuild the optimizer on the PS: {e}. "
                           f"Received: optimizer_config={json.dumps(config)[:200]}") from None
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise _invalid("optimizer_config does not describe a Keras optimizer. "
                           f"Received: optimizer_config={json.dumps(config)[:200]}")
        kind = type(optimizer).__name__
        split = [specs[p.key] for p in partitions if p.partition == 1]
        if kind not in _ELEMENTWISE | _WHOLE_VARIABLE:
            raise _invalid(
                f"The PS applies the optimizer one partition at a time and supports "
                f"{sorted(_ELEMENTWISE | _WHOLE_VARIABLE)}; {kind} keeps state across "
                f"variables or is unknown to it. Received: optimizer={kind}")
        for option in ("global_clipnorm", "gradient_accumulation_steps"):
            if getattr(optimizer, option, None):
                raise _invalid(f"{option} couples all variables and cannot be applied per "
                               f"partition. Received: {option}={getattr(optimizer, option)}")
        if optimizer.use_ema:
            raise _invalid("use_ema is not supported by the PS (the average would live on "
                           "the PS, but Keras swaps it in on the worker). Received: use_ema=True")
        if split and (optimizer.clipnorm or kind in _WHOLE_VARIABLE):
            what = (f"clipnorm={optimizer.clipnorm}" if optimizer.clipnorm
                    else f"optimizer={kind}")
            raise _invalid(
                f"{what} needs whole variables but variable {split[0].key} "
                f"({split[0].name!r}) is split into row ranges (it is larger than "
                f"max_partition_bytes={max_partition_bytes}). Use clipvalue, an "
                f"elementwise optimizer, or a larger max_partition_bytes. Received: {what}")
        return optimizer, no_decay

    def _make_parts(self, model, no_decay):
        parts = {}
        for p in model.partitions:
            if p.ps_index != self.ps_index:
                continue
            spec = model.specs[p.key]
            dtype = codec.to_numpy_dtype(spec.dtype)
            shape = (p.num_rows, *spec.shape[1:]) if spec.shape else ()
            # Weight-decay exclusions arrive as keys (no_decay), so the name
            # only serves messages: the worker's leaf name, without "/" or ":".
            leaf = spec.name.rpartition("/")[2].partition(":")[0]
            variable = keras.Variable(np.zeros(shape, dtype), dtype=spec.dtype, trainable=True,
                                      name=leaf or f"variable_{p.key}")
            parts[p.key, p.partition] = _Part(spec, p, shape, dtype, variable,
                                              threading.Condition(self._lock))
        excluded = [part.variable for part in parts.values() if part.plan.key in no_decay]
        if excluded:
            model.optimizer.exclude_from_weight_decay(var_list=excluded)
        model.optimizer.build([part.variable for part in parts.values()])
        return parts

    def _check_same_model(self, model, request):
        limit = request.max_partition_bytes or self.max_partition_bytes
        if limit != model.max_partition_bytes:
            raise _invalid(f"The model was declared with max_partition_bytes="
                           f"{model.max_partition_bytes} (the workers' scheduler must be the "
                           f"same). Received: max_partition_bytes={limit}")
        specs = model.specs
        if len(request.variables) != len(specs):
            raise _invalid(f"The model was declared with {len(specs)} variables. "
                           f"Received: {len(request.variables)} variables")
        for s in request.variables:
            e = specs[s.key]
            if (s.name, list(s.shape), s.dtype) != (e.name, list(e.shape), e.dtype):
                raise _invalid(
                    f"Variable {s.key} differs from the first declaration: expected "
                    f"name={_short(e.name)}, shape={_short(list(e.shape))}, dtype={e.dtype}. "
                    f"Received: name={_short(s.name)}, shape={_short(list(s.shape))}, "
                    f"dtype={s.dtype}")
        config = _comparable(self._parse_optimizer_config(request.optimizer_config))
        if config != model.optimizer_config:
            raise _invalid(
                "The optimizer differs from the first declaration: expected "
                f"{json.dumps(model.optimizer_config, sort_keys=True)[:400]}. Received: "
                f"{json.dumps(config, sort_keys=True)[:400]}")

    def _check_initial_values(self, model, chunks):
        out, seen = [], set()
        for c in chunks:
            part = model.parts.get((c.key, c.partition))
            if part is None:
                raise self._not_found(model, c.key, c.partition)
            if (c.key, c.partition) in seen:
                raise _invalid("An initial value appears twice in one request. "
                               f"Received: key={c.key}, partition={c.partition}")
            seen.add((c.key, c.partition))
            out.append((part, self._check_chunk_bytes(part, c, "initial value")))
        return out

    def _install_model(self, model):
        self._model, self._parts = model, model.parts
        logger.info("Model defined: %d variables, %d partitions on PS %d (%d bytes), "
                    "optimizer %s", len(model.specs), len(self._parts), self.ps_index,
                    sum(p.plan.nbytes for p in self._parts.values()),
                    type(model.optimizer).__name__)

    def _not_found(self, model, key, partition):
        if not 0 <= key < len(model.specs):
            return RpcError(grpc.StatusCode.NOT_FOUND,
                            f"No variable with this key (keys are 0..{len(model.specs) - 1}). "
                            f"Received: key={key}, partition={partition}")
        owner = next((p.ps_index for p in model.partitions
                      if p.key == key and p.partition == partition), None)
        where = (f"it is owned by PS {owner}" if owner is not None
                 else "the variable has no such partition")
        return RpcError(grpc.StatusCode.NOT_FOUND,
                        f"Partition not on PS {self.ps_index}: {where}. "
                        f"Received: key={key}, partition={partition}")

    def _check_chunk_bytes(self, part, chunk, what):
        if chunk.dtype != part.spec.dtype:
            raise _invalid(f"Wrong dtype in the {what} of {part.name}: expected "
                           f"{part.spec.dtype}. Received: dtype={_short(chunk.dtype)}")
        data = chunk.data  # once: protobuf's messages copy the bytes at every access
        if len(data) != part.plan.nbytes:
            raise _invalid(f"Wrong byte size in the {what} of {part.name}: expected "
                           f"{part.plan.nbytes} bytes (rows {part.plan.row_begin}:"
                           f"{part.plan.row_end} of shape {list(part.spec.shape)}). "
                           f"Received: {len(data)} bytes")
        return codec.from_bytes(data, part.dtype)

    # ------------------------------------------------------------------ Push

    def _push(self, request):
        if getattr(request, "malformed", None):
            raise _invalid(f"The request is not a PushRequest. Received: {request.malformed}")
        if self._failure:
            raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, self._failure)
        W, wid = self.num_workers, request.worker_id
        if not 0 <= wid < W:
            raise _invalid(f"worker_id must be in [0, {W}). Received: worker_id={wid}")
        if not request.chunks:
            raise _invalid("A push carries at least one gradient chunk. "
                           f"Received: 0 chunks from worker_id={wid}")
        completed, duplicates = [], 0
        with self._lock:
            if self._model is None:
                raise _precondition("No model is registered on this PS yet; call Register "
                                    f"first. Received: Push from worker_id={wid}")
            accepted, seen = [], set()
            for c in request.chunks:  # 1. validate everything
                part = self._parts.get((c.key, c.partition))
                if part is None:
                    raise self._not_found(self._model, c.key, c.partition)
                array = self._check_chunk_bytes(part, c, "gradient")
                if part.failed:
                    raise RpcError(grpc.StatusCode.INTERNAL, part.failed)
                v, step = part.version, c.step
                if v < 0:
                    raise _precondition(f"{part.name} has no initial value yet (worker 0 "
                                        f"sends it at Register). Received: step={step}")
                if step == v:
                    duplicate = wid in part.arrived or (c.key, c.partition) in seen
                elif step == v - 1:
                    duplicate = True
                elif step < v:
                    raise _precondition(f"Gradient of {part.name} is from the past: the "
                                        f"partition is at version {v}, accepting step {v}. "
                                        f"Received: step={step}")
                else:
                    raise _precondition(f"Gradient of {part.name} is too far ahead: the "
                                        f"partition is at version {v}, accepting step {v}. "
                                        f"Received: step={step}")
                if not _all_finite(array):
                    # Summed in, one NaN would poison the parameters for good.
                    raise _invalid(f"Gradient of {part.name} at step {step} has "
                                   f"{_non_finite_count(array)} NaN or "
                                   f"Inf values (of {array.size}); the whole push is rejected "
                                   f"and nothing of it was summed. Received: worker_id={wid}, "
                                   f"step={step}")
                seen.add((c.key, c.partition))
                accepted.append((part, step, None if duplicate else array))
            learning_rate = _learning_rate_of(request)
            if learning_rate is not None:
                if not math.isfinite(learning_rate) or learning_rate < 0:
                    raise _invalid("learning_rate must be a finite number >= 0. "
                                   f"Received: learning_rate={learning_rate}")
                if isinstance(self._model.optimizer._learning_rate,
                              keras.optimizers.schedules.LearningRateSchedule):
                    raise _invalid("The optimizer's learning rate is a schedule; a worker "
                                   f"cannot set it. Received: learning_rate={learning_rate}")
            for part, step, array in accepted:  # 2. apply; nothing can fail here
                if learning_rate is not None:
                    self._learning_rates[step] = learning_rate
                if array is None:
                    duplicates += 1
                    continue
                self._accumulate(part, array)
                part.arrived.add(wid)
                if len(part.arrived) == W:
                    completed.append((part, step, part.acc))
                    part.acc, part.acc_owned = None, False
        for part, step, total in completed:
            self._applies.put((step, part.spec.priority, part.plan.key, part.plan.partition,
                               next(self._seq), part, total))
        return ps_pb2.PushResponse(duplicates=duplicates)

    @staticmethod
    def _accumulate(part, array):
        sum_dtype = _SUM_DTYPES[part.spec.dtype]
        if part.acc is None:
            if array.dtype == sum_dtype:
                part.acc, part.acc_owned = array, False  # a view of the request: no copy
            else:
                part.acc, part.acc_owned = array.astype(sum_dtype), True
        elif part.acc_owned:
            np.add(part.acc, array.astype(sum_dtype, copy=False), out=part.acc)
        else:
            part.acc, part.acc_owned = np.add(part.acc, array, dtype=sum_dtype), True

    # ----------------------------------------------------------------- apply

    def _apply_loop(self):
        while True:
            step, *_, part, total = self._applies.get()
            if part is None:
                return
            try:
                with self._apply_lock:
                    value = self._apply(part, step, total)
                    encoded = encode_parameter_chunk(part.plan.key, part.plan.partition,
                                                     step + 1, part.spec.dtype, value)
            except Exception as e:  # keep serving other partitions; report on this one
                logger.exception("Optimizer update of %s at step %d failed", part.name, step)
                with self._lock:
                    part.failed = (f"The optimizer update of {part.name} at step {step} "
                                   f"failed on the PS: {type(e).__name__}: {e}")
                    part.cond.notify_all()
                continue
            with self._lock:
                part.encoded, part.version = encoded, step + 1
                part.arrived = set()
                complete = self._count_version_locked(step + 1)
                part.cond.notify_all()
            if complete and self._checkpointer and self._checkpointer.due(step + 1):
                # Still on the apply thread: no partition moves past step + 1
                # until the snapshot is read.
                self._save_checkpoint(step + 1)

    def _apply(self, part, step, total):
        with self._lock:
            learning_rate = self._learning_rates.get(step)
            for old in [s for s in self._learning_rates if s < step - 2]:
                del self._learning_rates[old]
        if learning_rate is not None:
            self._model.optimizer.learning_rate = learning_rate  # Read inside apply_fn.
        if part.apply_fn is None:
            part.apply_fn = self._trace_apply(part)
        return np.asarray(part.apply_fn(total.reshape(part.shape), np.int64(step)))

    def _trace_apply(self, part):
        """The optimizer update of one partition as a tf.function.

        Traced once per partition (tens of ms), it then costs a fraction of
        eager Keras' Python overhead per call (about 4x less for Adam) and
        holds the GIL that much less, which the gRPC threads need.
        """
        optimizer, variable = self._model.optimizer, part.variable

        def apply(gradient, step):
            optimizer.iterations.assign(step)
            optimizer.apply([gradient], [variable])
            return variable.value.read_value()

        sum_dtype = tf.as_dtype(_SUM_DTYPES[part.spec.dtype])
        fn = tf.function(apply, autograph=False, input_signature=[
            tf.TensorSpec(part.shape, sum_dtype), tf.TensorSpec((), tf.int64)])
        # One trace per partition is by design; TF would warn about "retracing".
        fn._omit_frequent_tracing_warning = True
        return fn

    @staticmethod
    def _read(part):
        return np.asarray(part.variable.value.read_value())

    # ------------------------------------------------------------------ Pull

    def _pull_targets(self, request):
        if getattr(request, "malformed", None):  # bytes that did not parse (server.py)
            raise _invalid(f"The request is not a PullRequest. Received: {request.malformed}")
        if not 0 <= request.worker_id < self.num_workers:
            raise _invalid(f"worker_id must be in [0, {self.num_workers}). "
                           f"Received: worker_id={request.worker_id}")
        if request.min_version < 0:
            raise _invalid(f"min_version must be >= 0. Received: min_version={request.min_version}")
        with self._lock:
            if self._model is None:
                raise _precondition("No model is registered on this PS yet; call Register "
                                    f"first. Received: Pull from worker_id={request.worker_id}")
            if len(request.items) > len(self._parts):
                raise _invalid(f"A pull names at most the {len(self._parts)} partitions this PS "
                               f"owns. Received: {len(request.items)} items")
            parts = []
            for item in request.items:
                part = self._parts.get((item.key, item.partition))
                if part is None:
                    raise self._not_found(self._model, item.key, item.partition)
                parts.append(part)
        return parts

    def _wait_version(self, part, min_version, context):
        with self._lock:
            while part.version < min_version:
                if self._failure:
                    raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, self._failure)
                if part.failed:
                    raise RpcError(grpc.StatusCode.INTERNAL, part.failed)
                gone = self._departed_before(min_version)
                if gone is not None:
                    wid, steps = gone
                    raise RpcError(grpc.StatusCode.FAILED_PRECONDITION,
                                   f"Version {min_version} of {part.name} can never be "
                                   f"complete: worker {wid} left the job after pushing "
                                   f"{steps} steps. Received: min_version={min_version}")
                remaining = context.time_remaining()
                if remaining is not None and remaining <= 0:
                    raise RpcError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                   f"{part.name} is at version {part.version}, below the "
                                   f"requested one when the deadline expired. Received: "
                                   f"min_version={min_version}")
                if not context.is_active():
                    return None
                part.cond.wait(_PULL_POLL_SECONDS if remaining is None
                               else min(remaining, _PULL_POLL_SECONDS))
            return part.encoded

    # ------------------------------------------------------------- liveness

    def _heartbeat(self, request):
        if getattr(request, "malformed", None):  # bytes that did not parse (server.py)
            raise _invalid(f"The request is not a HeartbeatRequest. Received: {request.malformed}")
        wid = request.worker_id
        if not 0 <= wid < self.num_workers:
            raise _invalid(f"worker_id must be in [0, {self.num_workers}). Received: worker_id={wid}")
        if request.steps_pushed < 0:
            raise _invalid(f"steps_pushed must be >= 0. Received: steps_pushed={request.steps_pushed}")
        with self._lock:
            if self._failure:
                return ps_pb2.HeartbeatResponse(failure=self._failure)
            if self._first_heartbeat is None:
                self._first_heartbeat = time.monotonic()
            self._steps_pushed[wid] = request.steps_pushed
            if request.leaving:
                logger.info("Worker %d left after pushing %d steps", wid, request.steps_pushed)
                self._left[wid] = request.steps_pushed
                self._last_seen.pop(wid, None)
                self._notify_all_locked()  # pulls that now can never complete fail
            else:
                self._last_seen[wid] = time.monotonic()
                self._left.pop(wid, None)
        return ps_pb2.HeartbeatResponse()

    def _watch_workers(self):
        """Fails the job when a registered worker stops sending heartbeats."""
        period = min(1.0, self.worker_timeout_s / 4)
        while not self._stopping.wait(period):
            now = time.monotonic()
            with self._lock:
                if self._failure:
                    continue
                for wid, seen in sorted(self._last_seen.items()):
                    if now - seen > self.worker_timeout_s:
                        self._fail_job_locked(
                            f"Worker {wid} was lost: no heartbeat for {now - seen:.1f} s "
                            f"(limit {self.worker_timeout_s:g} s; it had pushed "
                            f"{self._steps_pushed.get(wid, 0)} steps). The job cannot go on.")
                        break
                else:
                    first = self._first_heartbeat
                    if first is not None and now - first > self.startup_timeout_s:
                        missing = [w for w in range(self.num_workers)
                                   if w not in self._last_seen and w not in self._left
                                   and w not in self._steps_pushed]
                        if missing:
                            self._fail_job_locked(
                                f"Worker {missing[0]} never connected: no heartbeat "
                                f"{now - first:.0f} s after the first worker's (limit "
                                f"{self.startup_timeout_s:g} s). The job cannot go on.")

    def _fail_job_locked(self, message: str) -> None:
        self._failure = message
        logger.error("%s", message)
        self._notify_all_locked()
        if self._on_failure is not None:
            threading.Thread(target=self._on_failure, args=(message,), daemon=True,
                             name="prophet-tf-ps-on-failure").start()

    def _notify_all_locked(self) -> None:
        for part in self._parts.values():
            part.cond.notify_all()

    def _departed_before(self, min_version: int) -> tuple[int, int] | None:
        """A worker that left before pushing step ``min_version - 1``, if any."""
        for wid, steps in sorted(self._left.items()):
            if steps < min_version:
                return wid, steps
        return None

    # ----------------------------------------------------------- checkpoints

    def _check_same_resume(self, request) -> None:
        if request.resume_step != self._requested_resume:
            raise _invalid(f"The first worker resumed from step {self._requested_resume}; every "
                           "worker must resume from the same step (restore the same backup). "
                           f"Received: resume_step={request.resume_step} from worker "
                           f"{request.worker_id}")

    def _signature(self, model) -> dict:
        return checkpoint_lib.model_signature(model.specs, model.partitions,
                                              type(model.optimizer).__name__,
                                              self.ps_index, self.num_ps)

    def _choose_checkpoint(self, model, resume_step: int):
        """The checkpoint to restore at the first Register, or None.

        Workers that resume from their own backup (``resume_step`` > 0) get
        the checkpoint of that very step, so both sides continue from the
        same point; workers starting afresh get the newest one.
        """
        if self._checkpointer is None:
            return None
        steps = self._checkpointer.steps()
        if not steps:
            return None
        if resume_step:
            if resume_step not in steps:
                logger.warning("No checkpoint of step %d (the workers' resume step) in %s; "
                               "have %s", resume_step, self._checkpointer.policy.directory, steps)
                return None
            step = resume_step
        else:
            step = steps[-1]
        try:
            snapshot = self._checkpointer.load(step)
        except ValueError as e:
            raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from None
        difference = checkpoint_lib.signature_difference(snapshot.signature,
                                                         self._signature(model))
        if difference:
            raise RpcError(grpc.StatusCode.FAILED_PRECONDITION,
                           f"The checkpoint of step {step} in "
                           f"{self._checkpointer.policy.directory} is of another model or "
                           f"cluster ({difference}). Use another --checkpoint-dir or remove "
                           f"it. Received: the model of worker 0")
        optimizer_vars = self._model_optimizer_variables(model)
        shapes = [tuple(v.shape) for v in optimizer_vars]
        if ([tuple(a.shape) for a in snapshot.optimizer_values] != shapes
                or len(snapshot.params) != len(model.parts)):
            raise RpcError(grpc.StatusCode.FAILED_PRECONDITION,
                           f"The checkpoint of step {step} does not fit the optimizer "
                           f"{type(model.optimizer).__name__}'s variables")
        return snapshot

    @staticmethod
    def _model_optimizer_variables(model):
        return list(model.optimizer.variables)

    def _restore(self, snapshot) -> None:
        """Installs ``snapshot``; called under the state lock right after the
        model is installed, when no push can have arrived and nothing applies
        (so the apply lock is not needed, and would invert the lock order)."""
        for (key, partition), part in self._parts.items():
            part.variable.assign(snapshot.params[key, partition].reshape(part.shape))
        for variable, value in zip(self._model_optimizer_variables(self._model),
                                   snapshot.optimizer_values):
            variable.assign(value)
        for part in self._parts.values():
            part.encoded = encode_parameter_chunk(part.plan.key, part.plan.partition,
                                                  snapshot.step, part.spec.dtype,
                                                  self._read(part))
            part.version = snapshot.step
        self._start_version = snapshot.step
        self._at_version = {snapshot.step: len(self._parts)}
        logger.info("Restored the checkpoint of step %d from %s", snapshot.step,
                    self._checkpointer.policy.directory)

    def _count_version_locked(self, version: int) -> bool:
        """Counts a partition reaching ``version``; True when all have."""
        count = self._at_version.get(version, 0) + 1
        self._at_version[version] = count
        self._at_version.pop(version - 1, None)
        return count == len(self._parts)

    def _save_checkpoint(self, step: int) -> None:
        with self._apply_lock:
            params = {k: self._read(part).copy() for k, part in self._parts.items()}
            variables = self._model_optimizer_variables(self._model)
            names = [v.path for v in variables]
            values = [np.array(v.numpy(), copy=True) for v in variables]
        try:
            self._checkpointer.save(checkpoint_lib.Snapshot(
                step, self._signature(self._model), params, names, values))
        except RuntimeError as e:
            with self._lock:
                self._fail_job_locked(str(e))

    # ------------------------------------------------------------- lifecycle

    def close(self):
        """Stops the apply thread after the queued updates, then writes checkpoints."""
        if not self._closed:
            self._closed = True
            self._stopping.set()
            self._applies.put((math.inf, 0, 0, 0, next(self._seq), None, None))
            self._apply_thread.join()
            if self._checkpointer:
                self._checkpointer.close()

    @property
    def failure(self) -> str | None:
        """Why the job can no longer make progress, or None."""
        with self._lock:
            return self._failure

    # Introspection (tests, checkpoints).
    def version(self, key: int, partition: int = 0) -> int:
        with self._lock:
            return self._parts[key, partition].version

    def value(self, key: int, partition: int = 0) -> np.ndarray:
        with self._apply_lock:
            return self._read(self._parts[key, partition]).copy()


class _RejectionLog:
    """Logs rejected requests, at most one per RPC kind every INTERVAL_S.

    A client sending bad requests in a loop must not fill the disk or slow the
    PS with log lines; the count of those left out is logged with the next.
    """

    INTERVAL_S = 5.0

    def __init__(self):
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._skipped = collections.Counter()

    def log(self, rpc: str, request, error: RpcError) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(rpc, -math.inf) < self.INTERVAL_S:
                self._skipped[rpc] += 1
                return
            self._last[rpc] = now
            skipped = self._skipped.pop(rpc, 0)
        logger.info("%s from worker %s rejected: %s%s", rpc, getattr(request, "worker_id", "?"),
                    error.message,
                    f" ({skipped} more {rpc} rejections not logged)" if skipped else "")


def _learning_rate_of(request) -> float | None:
    """A push's learning rate: None when the worker sent none."""
    if isinstance(request, ps_pb2.PushRequest):  # Parsed by protobuf (tests, other clients).
        return request.learning_rate if request.HasField("learning_rate") else None
    return request.learning_rate


def _check_keys(variables):
    keys = sorted(s.key for s in variables)
    if not keys:
        raise _invalid("Register declares no variables. Received: variables=[]")
    if keys != list(range(len(keys))):
        raise _invalid("Variable keys must be 0..n-1, each once. "
                       f"Received: keys={_short([s.key for s in variables])}")


# Bounds on one declaration, checked before anything is planned or allocated.
_MAX_PARTITIONS = 1 << 16  # per model; also bounds the variables (>= 1 partition each)
_MAX_NAME_CHARS = 1024
_MAX_RANK = 254  # TensorFlow's own limit
_MAX_OPTIMIZER_CONFIG_CHARS = 1 << 20
_MAX_ECHO_CHARS = 200  # of a received value quoted in an error message

# Exponent bits of NaN/Inf in the 2-byte float types: testing them on a uint16
# view is ~10x faster than np.isfinite, which has no vector loop for these.
_NON_FINITE_BITS = {codec.to_numpy_dtype("float16"): np.uint16(0x7C00),
                    codec.to_numpy_dtype("bfloat16"): np.uint16(0x7F80)}


def _all_finite(array: np.ndarray) -> bool:
    """Whether ``array`` holds no NaN or Inf.

    ``np.isfinite(a).all()`` for float32/float64: ~30 us per MB here, faster
    than ``np.isfinite(a.sum())`` (~50 us per MB), which would also need a
    fallback when finite values overflow the sum.
    """
    mask = _NON_FINITE_BITS.get(array.dtype)
    if mask is None:
        return bool(np.isfinite(array).all())
    return not np.any((array.view(np.uint16) & mask) == mask)


def _non_finite_count(array: np.ndarray) -> int:
    mask = _NON_FINITE_BITS.get(array.dtype)
    if mask is None:
        return array.size - int(np.count_nonzero(np.isfinite(array)))
    return int(np.count_nonzero((array.view(np.uint16) & mask) == mask))


def _short(value) -> str:
    """``repr(value)``, cut to a length that fits an error message (a long
    string or list is cut before its repr is built)."""
    if isinstance(value, (str, list)) and len(value) > _MAX_ECHO_CHARS:
        unit = "characters" if isinstance(value, str) else "items"
        return f"{repr(value[:_MAX_ECHO_CHARS])[:_MAX_ECHO_CHARS]}... ({len(value)} {unit})"
    text = repr(value)
    return text if len(text) <= _MAX_ECHO_CHARS else f"{text[:_MAX_ECHO_CHARS]}..."


def _size_and_partitions(spec, max_partition_bytes: int) -> tuple[int, int]:
    """(bytes, partitions) of a checked spec, as ``sharding.plan`` would cut it."""
    shape = [int(d) for d in spec.shape]
    rows = shape[0] if shape else 1
    row_bytes = codec.to_numpy_dtype(spec.dtype).itemsize * math.prod(shape[1:])
    if not rows:
        return 0, 1
    rows_per_part = max(1, max_partition_bytes // row_bytes) if row_bytes else rows
    return rows * row_bytes, -(-rows // rows_per_part)


def _memory_bytes() -> int | None:
    """This machine's physical memory, or None when the OS does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _comparable(config):
    """The optimizer config as compared between workers (its name aside)."""
    config = json.loads(json.dumps(config))
    config.get("config", {}).pop("name", None)
    return config
