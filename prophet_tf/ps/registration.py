"""Register: a worker's declaration of the model, checked and turned into partitions.

The first declaration defines the model (variables, sharding limit, optimizer);
every later one must declare the same model, or the job fails. A declaration
that is malformed on its own is rejected before it is compared with anything,
so garbage never counts as "another model". Worker 0 sends the initial values
of this PS's partitions with its Register.

The optimizer is rebuilt from the declared config under the one optimizer
policy (:mod:`prophet_tf.optimizer_policy`), one ``keras.Variable`` per owned
partition. Variable constraints are not carried over (not in the spec).

Keras, and TensorFlow under it, is imported by the first Register
(:func:`load_keras`), not with this module: a PS task listens, answers health
checks and watches for its workers without it, and one whose job never
starts spends no seconds of CPU and no hundreds of MB on it.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os

import grpc
import numpy as np

from prophet_tf import codec, keras_optimizer, optimizer_policy
from prophet_tf.ps import clipping, sharding, whole_apply
from prophet_tf.ps.errors import RpcError, invalid, short
from prophet_tf.ps.v1 import ps_pb2

__all__ = ["Part", "Model", "read", "optimized", "load_keras", "check_request", "define_model", "check_same_model",
           "check_initial_values", "not_found", "pulled_parts", "check_chunk_bytes"]

# Bounds on one declaration, checked before anything is planned or allocated.
_MAX_PARTITIONS = 1 << 16  # per model; also bounds the variables (>= 1 partition each)
_MAX_NAME_CHARS = 1024
_MAX_RANK = 254  # TensorFlow's own limit
_MAX_OPTIMIZER_CONFIG_CHARS = 1 << 20


@dataclasses.dataclass(eq=False)
class Part:
    """One owned partition. Fields below ``variable`` change under the state lock."""

    spec: ps_pb2.VariableSpec
    plan: sharding.Partition
    shape: tuple
    dtype: np.dtype
    variable: object  # keras.Variable holding elements [begin, end) (sharding.whole_shape)
    version: int = -1  # iterations applied; -1: no initial value yet
    # Workers in iteration `version`: worker -> (its gradient, a view of its
    # request, and its batch rows), or -> None once the sum is handed over.
    arrived: dict = dataclasses.field(default_factory=dict)
    encoded: bytes | None = None  # Pull answer of `version` (protocol.encode_pull_entry), shared
    failed: str | None = None
    apply_fn: object = None  # traced optimizer update of this partition
    # Lamb over a variable of several partitions: their count, and this one's two
    # traced phases (prophet_tf.ps.lamb); 1 and None otherwise.
    lamb_partitions: int = 1
    lamb: object = None
    # Adafactor over a variable of several partitions: the whole variable the
    # optimizer updates once all their sums are in (prophet_tf.ps.whole_apply).
    whole: object = None

    @property
    def name(self):
        return f"{self.spec.name!r} (key={self.plan.key}, partition={self.plan.partition})"


@dataclasses.dataclass
class Model:
    specs: list  # VariableSpec by key
    optimizer_config: dict  # as compared between workers (name removed)
    optimizer: object
    partitions: list  # full plan
    max_partition_bytes: int = 0
    parts: dict = None  # this PS's Part by (key, partition)
    # The workers scale their loss: a step is applied only when every
    # worker's gradients were finite (their verdicts, servicer.py).
    loss_scaling: bool = False
    # Every step's sums are scaled by one norm before the apply (clipping.py).
    global_clipnorm: float | None = None
    # Each variable's sums scaled by their norm before the apply (clipping.py).
    clipnorm: float | None = None
    # The clipping norms with partitions on several PS tasks, and the tasks
    # owning those partitions, which agree on them at PS task 0's address
    # (clipping.shared_groups, norm_sharing.py).
    norm_groups: tuple = ()
    norm_peers: list = dataclasses.field(default_factory=list)
    ps0_address: str = ""
    # The learning rate follows a schedule: a worker may not set it.
    learning_rate_is_schedule: bool = False


def load_keras():
    """Keras (imported with TensorFlow by the first call: seconds), which defining a
    model needs. The servicer calls it before taking the state lock, so that
    heartbeats and other workers' calls are not held up by the import."""
    import keras

    return keras


def check_request(request, num_workers: int, num_ps: int, max_partition_bytes: int) -> None:
    """Rejects a RegisterRequest that is malformed on its own (INVALID_ARGUMENT).

    Runs before the declaration defines the model or is compared with it, and
    before anything is planned or allocated: the number of partitions and the
    bytes are computed from the shapes first.
    """
    if getattr(request, "malformed", None):  # bytes that did not parse (protocol.py)
        raise invalid(f"The request is not a RegisterRequest. Received: {request.malformed}")
    W = num_workers
    if request.num_workers != W:
        raise invalid(f"This PS runs with num_workers={W}. "
                      f"Received: num_workers={request.num_workers}")
    if not 0 <= request.worker_id < W:
        raise invalid(f"worker_id must be in [0, {W}). Received: worker_id={request.worker_id}")
    if request.initial_values and request.worker_id != 0:
        raise invalid("Only worker 0 sends initial values. "
                      f"Received: {len(request.initial_values)} initial values "
                      f"from worker_id={request.worker_id}")
    _check_declaration(request, num_ps, max_partition_bytes)
    if request.resume_step < 0:
        raise invalid(f"resume_step must be >= 0. Received: resume_step={request.resume_step}")


def _check_declaration(request, num_ps: int, max_partition_bytes: int) -> None:
    variables = request.variables
    if len(variables) > _MAX_PARTITIONS:
        raise invalid(f"Register declares more variables than a PS accepts "
                      f"({_MAX_PARTITIONS}). Received: {len(variables)} variables")
    _check_keys(variables)
    if request.max_partition_bytes < 0:
        raise invalid("max_partition_bytes must be >= 0 (0: the PS's setting). "
                      f"Received: max_partition_bytes={request.max_partition_bytes}")
    limit = request.max_partition_bytes or max_partition_bytes
    total_bytes = total_partitions = 0
    for s in variables:
        what = f"Variable {s.key} ({short(s.name)})"
        if len(s.name) > _MAX_NAME_CHARS:
            raise invalid(f"{what} has a name of more than {_MAX_NAME_CHARS} characters. "
                          f"Received: {len(s.name)} characters")
        if s.dtype not in codec.SUPPORTED_DTYPES:
            raise invalid(f"{what} has an unsupported dtype; expected one of "
                          f"{list(codec.SUPPORTED_DTYPES)}. Received: dtype={short(s.dtype)}")
        if len(s.shape) > _MAX_RANK:
            raise invalid(f"{what} has more than {_MAX_RANK} dimensions. "
                          f"Received: {len(s.shape)} dimensions")
        if any(d < 0 for d in s.shape):
            raise invalid(f"{what} has a negative dimension. "
                          f"Received: shape={short(list(s.shape))}")
        # numpy and TF need the product of the dimensions (zeros aside) in
        # an int64 even for an empty array.
        itemsize = codec.to_numpy_dtype(s.dtype).itemsize
        if itemsize * math.prod(max(d, 1) for d in s.shape) >= 2**63:
            raise invalid(f"{what} has dimensions whose product overflows int64. "
                          f"Received: shape={short(list(s.shape))}, dtype={s.dtype}")
        total_bytes += _nbytes(s)
    pieces = sharding.max_partitions(variables, num_ps, limit)
    if pieces > _MAX_PARTITIONS:
        raise invalid(
            f"The model would be cut into more than {_MAX_PARTITIONS} partitions "
            f"(up to {pieces} of at most max_partition_bytes={limit} over {num_ps} PS "
            f"task(s)). Received: {len(variables)} variables of {total_bytes} bytes")
    memory = _memory_bytes()
    if memory is not None and total_bytes > num_ps * memory:
        largest = max(variables, key=_nbytes)
        raise invalid(
            f"The model has {total_bytes} bytes of parameters, more than {num_ps} PS "
            f"task(s) with this machine's memory ({memory} bytes) could hold. Received: "
            f"largest variable {largest.key} ({short(largest.name)}) of "
            f"shape={short(list(largest.shape))}, dtype={largest.dtype}")
    _parse_optimizer_config(request.optimizer_config)


def _check_keys(variables) -> None:
    keys = sorted(s.key for s in variables)
    if not keys:
        raise invalid("Register declares no variables. Received: variables=[]")
    if keys != list(range(len(keys))):
        raise invalid("Variable keys must be 0..n-1, each once. "
                      f"Received: keys={short([s.key for s in variables])}")


def _nbytes(spec) -> int:
    """The bytes of a checked spec."""
    return codec.to_numpy_dtype(spec.dtype).itemsize * math.prod(spec.shape)


def _memory_bytes() -> int | None:
    """This machine's physical memory, or None when the OS does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _parse_optimizer_config(text: str) -> dict:
    if len(text) > _MAX_OPTIMIZER_CONFIG_CHARS:
        raise invalid(f"optimizer_config is longer than {_MAX_OPTIMIZER_CONFIG_CHARS} "
                      f"characters. Received: {len(text)} characters")
    try:
        return optimizer_policy.parse_config(text)
    except ValueError as e:
        raise invalid(str(e)) from None


def define_model(request, ps_index: int, num_ps: int, max_partition_bytes: int,
                 max_chunk_bytes: int | None) -> Model:
    """The model of a checked first declaration, with this PS's parts (not installed).
    """
    specs = sorted(request.variables, key=lambda s: s.key)  # checked by check_request
    limit = request.max_partition_bytes or max_partition_bytes
    config = _parse_optimizer_config(request.optimizer_config)
    partitions = sharding.plan(specs, num_ps, limit,
                               spread=not optimizer_policy.needs_whole_variables(config))
    owned = sum(p.nbytes for p in partitions if p.ps_index == ps_index)
    memory = _memory_bytes()
    if memory is not None and owned > memory:
        raise invalid(f"This PS's partitions would take {owned} bytes, more than this "
                      f"machine's memory ({memory} bytes). Received: {len(specs)} "
                      f"variables of {sum(p.nbytes for p in partitions)} bytes")
    if max_chunk_bytes is not None:
        for p in partitions:
            if p.nbytes > max_chunk_bytes:
                s = specs[p.key]
                raise invalid(
                    f"Variable {p.key} ({s.name!r}) has a partition of {p.nbytes} bytes, "
                    f"more than one message may carry ({max_chunk_bytes}); declare a "
                    f"smaller max_partition_bytes. Received: max_partition_bytes={limit}, "
                    f"shape={list(s.shape)}, dtype={s.dtype}")
    try:
        optimizer, no_decay = keras_optimizer.rebuild(config)
        global_clipnorm = optimizer_policy.global_clipnorm(config)
        clipnorm = optimizer_policy.clipnorm(config)
        shared, peers = clipping.shared_groups(partitions, per_variable=bool(clipnorm)) \
            if global_clipnorm or clipnorm else ((), [])
        if shared:
            clipping.check_placement(True, num_ps, request.ps0_address,
                                     f"global_clipnorm={global_clipnorm!r}" if global_clipnorm
                                     else f"clipnorm={clipnorm!r}")
    except ValueError as e:
        raise invalid(str(e)) from None
    keras = load_keras()
    model = Model(specs, optimizer_policy.comparable(config), optimizer, partitions, limit,
                  loss_scaling=optimizer_policy.loss_scaling(config),
                  global_clipnorm=global_clipnorm,
                  clipnorm=clipnorm, norm_groups=shared, norm_peers=peers,
                  ps0_address=request.ps0_address,
                  learning_rate_is_schedule=isinstance(
                      optimizer._learning_rate, keras.optimizers.schedules.LearningRateSchedule))
    model.parts = _make_parts(model, no_decay, ps_index)
    return model


def _make_parts(model: Model, no_decay: set, ps_index: int) -> dict:
    keras = load_keras()
    parts = {}
    # Lamb over a cut variable takes its ratio over all of its partitions (lamb.py).
    kind = type(model.optimizer).__name__
    two_phase = kind in optimizer_policy.TWO_PHASE
    counts = collections.Counter(q.key for q in model.partitions)
    wholes = {}  # key -> the WholeVariable of a cut one applied whole
    for p in sharding.owned_by(model.partitions, ps_index):
        spec = model.specs[p.key]
        dtype = codec.to_numpy_dtype(spec.dtype)
        shape = sharding.whole_shape(p, spec.shape)
        # Weight-decay exclusions arrive as keys (no_decay), so the name
        # only serves messages: the worker's leaf name, without "/" or ":".
        leaf = spec.name.rpartition("/")[2].partition(":")[0]
        variable = keras.Variable(np.zeros(shape, dtype), dtype=spec.dtype, trainable=True,
                                  name=leaf or f"variable_{p.key}")
        whole = None
        if counts[p.key] > 1 and optimizer_policy.applies_whole(kind):
            whole = wholes.get(p.key)
            if whole is None:
                whole = wholes[p.key] = whole_apply.WholeVariable(keras.Variable(
                    np.zeros(spec.shape, dtype), dtype=spec.dtype, trainable=True,
                    name=variable.name), counts[p.key])
        parts[p.key, p.partition] = Part(spec, p, shape, dtype, variable,
                                         lamb_partitions=counts[p.key] if two_phase else 1,
                                         whole=whole)
    excluded = [optimized(part) for part in parts.values() if part.plan.key in no_decay]
    if excluded:
        model.optimizer.exclude_from_weight_decay(var_list=excluded)
    # A cut variable applied whole once (at its first partition).
    model.optimizer.build([optimized(part) for part in parts.values()
                           if part.whole is None or part.plan.partition == 0])
    return parts


def read(part: Part) -> np.ndarray:
    """The partition's current value (call under the apply lock)."""
    # .numpy() first: np.asarray of a 0-d bfloat16 tensor raises.
    return np.asarray(part.variable.value.read_value().numpy())


def optimized(part: Part):
    """The variable the optimizer updates for ``part``: its own, or the whole one it
    is a partition of (its slots are that variable's)."""
    return part.variable if part.whole is None else part.whole.variable


def check_same_model(model: Model, request, max_partition_bytes: int) -> None:
    """Rejects a declaration of another model than ``model`` (INVALID_ARGUMENT)."""
    limit = request.max_partition_bytes or max_partition_bytes
    if limit != model.max_partition_bytes:
        raise invalid(f"The model was declared with max_partition_bytes="
                      f"{model.max_partition_bytes} (the workers' scheduler must be the "
                      f"same). Received: max_partition_bytes={limit}")
    specs = model.specs
    if len(request.variables) != len(specs):
        raise invalid(f"The model was declared with {len(specs)} variables. "
                      f"Received: {len(request.variables)} variables")
    for s in request.variables:
        e = specs[s.key]
        if (s.name, list(s.shape), s.dtype) != (e.name, list(e.shape), e.dtype):
            raise invalid(
                f"Variable {s.key} differs from the first declaration: expected "
                f"name={short(e.name)}, shape={short(list(e.shape))}, dtype={e.dtype}. "
                f"Received: name={short(s.name)}, shape={short(list(s.shape))}, "
                f"dtype={s.dtype}")
    config = optimizer_policy.comparable(_parse_optimizer_config(request.optimizer_config))
    if config != model.optimizer_config:
        raise invalid(
            "The optimizer differs from the first declaration: expected "
            f"{json.dumps(model.optimizer_config, sort_keys=True)[:400]}. Received: "
            f"{json.dumps(config, sort_keys=True)[:400]}")


def check_initial_values(model: Model, chunks, ps_index: int) -> list:
    """``[(part, array)]`` of Register's initial values, every one checked."""
    out, seen = [], set()
    for c in chunks:
        part = model.parts.get((c.key, c.partition))
        if part is None:
            raise not_found(model, c.key, c.partition, ps_index)
        if (c.key, c.partition) in seen:
            raise invalid("An initial value appears twice in one request. "
                          f"Received: key={c.key}, partition={c.partition}")
        seen.add((c.key, c.partition))
        out.append((part, check_chunk_bytes(part, c, "initial value")))
    return out


def not_found(model: Model, key: int, partition: int, ps_index: int) -> RpcError:
    """The NOT_FOUND error of a chunk naming a partition this PS does not own."""
    if not 0 <= key < len(model.specs):
        return RpcError(grpc.StatusCode.NOT_FOUND,
                        f"No variable with this key (keys are 0..{len(model.specs) - 1}). "
                        f"Received: key={key}, partition={partition}")
    owner = next((p.ps_index for p in model.partitions
                  if p.key == key and p.partition == partition), None)
    where = (f"it is owned by PS {owner}" if owner is not None
             else "the variable has no such partition")
    return RpcError(grpc.StatusCode.NOT_FOUND,
                    f"Partition not on PS {ps_index}: {where}. "
                    f"Received: key={key}, partition={partition}")


def check_chunk_bytes(part: Part, chunk, what: str) -> np.ndarray:
    """The chunk's data as an array of the partition's dtype (a view, no copy)."""
    if chunk.dtype != part.spec.dtype:
        raise invalid(f"Wrong dtype in the {what} of {part.name}: expected "
                      f"{part.spec.dtype}. Received: dtype={short(chunk.dtype)}")
    data = chunk.data  # once: protobuf's messages copy the bytes at every access
    if len(data) != part.plan.nbytes:
        raise invalid(f"Wrong byte size in the {what} of {part.name}: expected "
                      f"{part.plan.nbytes} bytes (elements {part.plan.begin}:"
                      f"{part.plan.end} of shape {list(part.spec.shape)}). "
                      f"Received: {len(data)} bytes")
    return codec.from_bytes(data, part.dtype)


def pulled_parts(model: Model, items, ps_index: int) -> list:
    """The parts a PullRequest's ``items`` name, in their order.

    Raises:
      RpcError: more items than this PS owns partitions, or one it does not own.
    """
    if len(items) > len(model.parts):
        raise invalid(f"A pull names at most the {len(model.parts)} partitions this PS "
                      f"owns. Received: {len(items)} items")
    parts = []
    for item in items:
        part = model.parts.get((item.key, item.partition))
        if part is None:
            raise not_found(model, item.key, item.partition, ps_index)
        parts.append(part)
    return parts
