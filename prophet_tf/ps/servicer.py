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
all of it. When all W workers have pushed step v of a partition, the sum goes
to one background thread that applies the optimizer (most urgent first:
lowest step, then lowest priority value) and publishes version v + 1.

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
Keras sees at step k. Applies run one at a time on the apply thread. Not
carried over from the worker: variable constraints (not in the spec) and
learning-rate changes made during training (callbacks); schedules are. Options that couple
variables (``global_clipnorm``, EMA, gradient accumulation,
``LossScaleOptimizer``, Nadam's shared ``u_product``) are rejected at Register;
``clipnorm`` and whole-tensor optimizers (Lamb, Adafactor) are accepted only
when no variable is split.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import queue
import threading
from typing import Iterator

import grpc
import keras
import numpy as np
import tensorflow as tf

from prophet_tf import codec
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
    """

    def __init__(self, num_workers: int, ps_index: int = 0, num_ps: int = 1,
                 max_partition_bytes: int = sharding.DEFAULT_MAX_PARTITION_BYTES,
                 max_chunk_bytes: int | None = None):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1. Received: num_workers={num_workers}")
        if not 0 <= ps_index < num_ps:
            raise ValueError("ps_index must be in [0, num_ps). "
                             f"Received: ps_index={ps_index}, num_ps={num_ps}")
        if max_partition_bytes < 1:
            raise ValueError("max_partition_bytes must be >= 1. "
                             f"Received: max_partition_bytes={max_partition_bytes}")
        self.num_workers = num_workers
        self.ps_index = ps_index
        self.num_ps = num_ps
        self.max_partition_bytes = max_partition_bytes
        self.max_chunk_bytes = max_chunk_bytes
        self._lock = threading.Lock()  # model definition, versions, sums
        self._apply_lock = threading.Lock()  # the optimizer and the variables
        self._model: _Model | None = None
        # Set when a worker declared another model: the job can never make
        # progress, so every waiting and later Pull/Push fails with it.
        self._conflict: str | None = None
        # step -> the learning rate the workers trained that step with (set
        # by callbacks on the workers; absent: the optimizer's own).
        self._learning_rates: dict[int, float] = {}
        self._parts: dict[tuple[int, int], _Part] = {}
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

    @staticmethod
    def _answer(handler, rpc: str, request, context):
        """Runs a unary handler; its RpcError becomes the call's status."""
        try:
            return handler(request)
        except RpcError as e:
            logger.info("%s from worker %d rejected: %s", rpc, request.worker_id, e.message)
            context.abort(e.code, e.message)

    def Pull(self, request, context) -> Iterator[bytes]:
        """Yields serialized ``ParameterChunk`` messages (see server.py)."""
        try:
            parts = self._pull_targets(request)
        except RpcError as e:
            context.abort(e.code, e.message)
        for part in parts:
            try:
                data = self._wait_version(part, request.min_version, context)
            except RpcError as e:
                context.abort(e.code, e.message)
            if data is None:  # the client went away
                return
            yield data

    # -------------------------------------------------------------- Register

    def _register(self, request):
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
        _check_keys(request.variables)
        with self._lock:
            model = self._model
            if model is None:
                model = self._define_model(request)  # validates; installs nothing yet
            else:
                try:
                    self._check_same_model(model, request)
                except RpcError as e:
                    self._conflict = f"worker {request.worker_id} declared another model: {e.message}"
                    for part in self._parts.values():
                        part.cond.notify_all()
                    raise
            initial = self._check_initial_values(model, request.initial_values)
            if self._model is None:
                self._install_model(model)
        # Values are assigned outside the state lock (pulls and pushes of other
        # partitions go on); a partition that already has one keeps it, so a
        # retried Register is harmless.
        for part, array in initial:
            with self._apply_lock:
                if part.version >= 0:  # only changes under the apply lock before 0
                    continue
                part.variable.assign(array.reshape(part.shape))
                encoded = encode_parameter_chunk(part.plan.key, part.plan.partition, 0,
                                                 part.spec.dtype, self._read(part))
                with self._lock:
                    part.encoded, part.version = encoded, 0
                    part.cond.notify_all()
        with self._lock:
            parts = list(self._parts.values())
            version = min((max(p.version, 0) for p in parts), default=0)
        return ps_pb2.RegisterResponse(ps_index=self.ps_index, num_ps=self.num_ps,
                                       partitions=[p.plan.to_proto() for p in parts],
                                       version=version)

    def _define_model(self, request) -> _Model:
        specs = sorted(request.variables, key=lambda s: s.key)
        for s in specs:
            if s.dtype not in codec.SUPPORTED_DTYPES:
                raise _invalid(f"Variable {s.key} ({s.name!r}) has an unsupported dtype; "
                               f"expected one of {list(codec.SUPPORTED_DTYPES)}. "
                               f"Received: dtype={s.dtype!r}")
            if any(d < 0 for d in s.shape):
                raise _invalid(f"Variable {s.key} ({s.name!r}) has a negative dimension. "
                               f"Received: shape={list(s.shape)}")
        if request.max_partition_bytes < 0:
            raise _invalid("max_partition_bytes must be >= 0 (0: the PS's setting). "
                           f"Received: max_partition_bytes={request.max_partition_bytes}")
        limit = request.max_partition_bytes or self.max_partition_bytes
        partitions = sharding.plan(specs, self.num_ps, limit)
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
        try:
            config = json.loads(text)
            if not isinstance(config, dict) or "class_name" not in config:
                raise ValueError("not a keras.optimizers.serialize() dict")
        except ValueError as e:
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
                    f"name={e.name!r}, shape={list(e.shape)}, dtype={e.dtype}. Received: "
                    f"name={s.name!r}, shape={list(s.shape)}, dtype={s.dtype}")
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
                           f"{part.spec.dtype}. Received: dtype={chunk.dtype!r}")
        size = len(chunk.data)
        if size != part.plan.nbytes:
            raise _invalid(f"Wrong byte size in the {what} of {part.name}: expected "
                           f"{part.plan.nbytes} bytes (rows {part.plan.row_begin}:"
                           f"{part.plan.row_end} of shape {list(part.spec.shape)}). "
                           f"Received: {size} bytes")
        return codec.from_bytes(chunk.data, part.dtype)

    # ------------------------------------------------------------------ Push

    def _push(self, request):
        if getattr(request, "malformed", None):
            raise _invalid(f"The request is not a PushRequest. Received: {request.malformed}")
        if self._conflict:
            raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, self._conflict)
        W, wid = self.num_workers, request.worker_id
        if not 0 <= wid < W:
            raise _invalid(f"worker_id must be in [0, {W}). Received: worker_id={wid}")
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
                part.cond.notify_all()

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
        if not 0 <= request.worker_id < self.num_workers:
            raise _invalid(f"worker_id must be in [0, {self.num_workers}). "
                           f"Received: worker_id={request.worker_id}")
        if request.min_version < 0:
            raise _invalid(f"min_version must be >= 0. Received: min_version={request.min_version}")
        with self._lock:
            if self._model is None:
                raise _precondition("No model is registered on this PS yet; call Register "
                                    f"first. Received: Pull from worker_id={request.worker_id}")
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
                if self._conflict:
                    raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, self._conflict)
                if part.failed:
                    raise RpcError(grpc.StatusCode.INTERNAL, part.failed)
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

    # ------------------------------------------------------------- lifecycle

    def close(self):
        """Stops the apply thread after the queued updates."""
        if not self._closed:
            self._closed = True
            self._applies.put((math.inf, 0, 0, 0, next(self._seq), None, None))
            self._apply_thread.join()

    # Introspection (tests, checkpoints).
    def version(self, key: int, partition: int = 0) -> int:
        with self._lock:
            return self._parts[key, partition].version

    def value(self, key: int, partition: int = 0) -> np.ndarray:
        with self._apply_lock:
            return self._read(self._parts[key, partition]).copy()


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
                       f"Received: keys={[s.key for s in variables]}")


def _comparable(config):
    """The optimizer config as compared between workers (its name aside)."""
    config = json.loads(json.dumps(config))
    config.get("config", {}).pop("name", None)
    return config
