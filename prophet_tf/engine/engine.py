"""The worker's background engine: gradients out, parameters in.

Threads (all daemons; any failure aborts the op runtime, so a waiting
AwaitParam fails with the message instead of hanging):

- pump: takes ready gradients from the op library (`PushGrad` enqueued them),
  tells the scheduler about each partition, and queues each block the
  scheduler releases on its PS link; on the first gradient of step k it asks
  every PS for version k+1.
- one sender per PS task: pushes its link's blocks in order, each as one
  asynchronous RPC, at most two on the wire; a finished push tells the
  scheduler (`on_sent`), which may release more.
- one puller per PS task: streams the task's partitions of a version in
  priority order and delivers each parameter once all its partitions are in.

Keys: the op library knows a variable by its creation index (`ps_key`); the
PS knows the trained variables by their position in `trainable_variables`
(which is also their priority). The engine maps between the two.
"""
from __future__ import annotations

import atexit
import enum
import logging
import os
import queue
import threading
import time
from typing import Callable, Sequence

import grpc
import numpy as np

from prophet_tf import _native, codec, progress
from prophet_tf.engine import timeline as timeline_lib
from prophet_tf import cluster as cluster_lib
from prophet_tf.engine import schedulers
from prophet_tf.ps import sharding
from prophet_tf.ps.client import Chunk, PSClient, variable_specs

logger = logging.getLogger(__name__)

SCHEDULER_ENV = "PROPHET_TF_SCHEDULER"


class EngineStamp(enum.IntEnum):
    """Engine events in the op library's stamp buffer (kinds >= 16).

    Like the ops' own stamps, they name a variable by its op-library key.
    """

    PUSH_BEGIN = 16  # step = training step
    PUSH_END = 17
    PULL_RECEIVED = 18  # one partition of version `step` arrived


class Engine:
    """Moves one worker's gradients to the PS and the new parameters back.

    Args:
      config: the resolved cluster; this task must be a worker.
      scheduler: scheduler name, optionally with options ("bytescheduler:
        credit_bytes=8000000"); None reads PROPHET_TF_SCHEDULER, else "fifo".
      scheduler_options: options of the scheduler (see its class).
      rpc_timeout_s: deadline of each RPC; a wait for a version is renewed
        after it while the heartbeats say every task is alive.
      timeline: where to write the Chrome-trace timeline (see
        prophet_tf.engine.timeline); None reads PROPHET_TF_TIMELINE; "" disables.
      make_shapers: called once per PS link for the link shaping its client
        applies (see prophet_tf.bench.shaping.from_env); None: no shaping.

    Raises:
      ValueError: an unknown scheduler or option, or a bad timeout.
    """

    #: Pushes on the wire per PS link: two hide the gap between transfers.
    MAX_RPCS_PER_LINK = 2
    #: Seconds between heartbeats to each PS (its --worker-timeout is 10 s).
    HEARTBEAT_INTERVAL_S = 1.0
    #: A PS that answers no heartbeat for this long is lost.
    PS_TIMEOUT_S = 10.0
    #: How long shutdown waits for each thread once the channels are closed.
    JOIN_TIMEOUT_S = 10.0

    def __init__(self, config: cluster_lib.ClusterConfig, scheduler: str | None = None, *,
                 scheduler_options: dict | None = None, rpc_timeout_s: float = 120.0,
                 timeline: str | None = None, make_shapers=None):
        spec = scheduler if scheduler is not None else os.environ.get(SCHEDULER_ENV, "fifo")
        name, options = schedulers.parse_scheduler(spec)
        options.update(scheduler_options or {})
        schedulers.validate_scheduler(name, **options)
        if not isinstance(rpc_timeout_s, (int, float)) or rpc_timeout_s <= 0:
            raise ValueError(f"rpc_timeout_s must be a positive number of seconds. "
                             f"Received: rpc_timeout_s={rpc_timeout_s!r}")
        self.scheduler_name, self.scheduler_options = name, options
        self.config = config
        self.rpc_timeout_s = float(rpc_timeout_s)
        self.timeline = os.environ.get(timeline_lib.TIMELINE_ENV, "") if timeline is None \
            else timeline
        self._make_shapers = make_shapers
        self._started = False
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._threads: list[threading.Thread] = []

    @property
    def worker_id(self) -> int:
        return self.config.task_index

    # -- start ---------------------------------------------------------------------------

    def start(self, variables: Sequence, optimizer_config: str,
              learning_rate: Callable[[], float] | None = None, resume_step: int = 0) -> int:
        """Registers the trained variables with every PS, stages the first version, starts threads.

        Args:
          variables: the trained PSVariables in trainable_variables order.
          optimizer_config: JSON the PS rebuilds the Keras optimizer from.
          learning_rate: reads the worker optimizer's current learning rate
            (None when it is a schedule, which the PS computes itself); read
            when each step's first gradient arrives and sent with its pushes,
            so callbacks that change it reach the PS.
          resume_step: steps this worker's own state already trained (its
            optimizer's restored iteration count); 0 for a fresh start.

        Returns:
          The step training starts from: 0, ``resume_step``, or the step of
          the checkpoint the PS tasks restored.
        """
        if self._started:
            raise RuntimeError("the engine was already started")
        self._scheduler = schedulers.make_scheduler(self.scheduler_name, **self.scheduler_options)
        self._partition_bytes = (self._scheduler.partition_bytes
                                 or schedulers.DEFAULT_PARTITION_BYTES)
        self._native_keys = [v.ps_key for v in variables]
        self._ps_key_of = {k: i for i, k in enumerate(self._native_keys)}
        self._specs = specs = variable_specs(variables)
        self._plan = sharding.plan(specs, self.config.num_ps, self._partition_bytes)
        self._partitions_of: dict[int, list[sharding.Partition]] = {}
        for p in self._plan:
            self._partitions_of.setdefault(p.key, []).append(p)
        self._row_bytes = [
            int(np.prod(s.shape[1:], dtype=np.int64)) * _itemsize(s.dtype) if s.shape else
            _itemsize(s.dtype) for s in specs]
        self._recorder = timeline_lib.Recorder(
            self.worker_id, {k: v.name for k, v in zip(self._native_keys, specs)}) \
            if self.timeline else None
        codec.tune_allocator()  # Recycle transfer buffers instead of page-faulting them in.
        self._clients = [PSClient(address, self.worker_id, self.config.num_workers,
                                  shapers=self._make_shapers() if self._make_shapers else None)
                         for address in self.config.ps]
        for client in self._clients:
            client.wait_ready(self.rpc_timeout_s)
        # Heartbeats start before Register: registering may wait for worker
        # 0's values, and a worker that dies meanwhile must be noticed too.
        self._last_step = -1
        for i in range(len(self._clients)):
            self._spawn(f"prophet-tf-heartbeat-{i}", self._heartbeat, i)
        try:
            self.start_step = start = self._register(variables, optimizer_config, resume_step)
        except BaseException:
            self._stop.set()  # No heartbeats for a worker that will not train.
            raise
        self._lock = threading.Lock()  # The scheduler, the gradients, the in-flight counts.
        self._idle = threading.Condition(self._lock)
        self._grads: dict[tuple[int, int], list] = {}  # (ps key, step) -> [Grad, unsent parts]
        self._arrived_of_step: dict[int, int] = {}  # step -> gradients arrived so far
        self._rpcs = [0] * len(self._clients)
        self._rpc_free = [threading.Condition(self._lock) for _ in self._clients]
        self._send_queues = [queue.Queue() for _ in self._clients]
        self._pull_queues = [queue.Queue() for _ in self._clients]
        self._assembly: dict[tuple[int, int], list] = {}
        self._assembly_lock = threading.Lock()
        self._last_step = start - 1
        self._plan_version = None
        self._learning_rate = learning_rate
        self._step_learning_rates: dict[int, float] = {}
        # The first version comes from the PS, so every worker starts from
        # the same values (worker 0's, or a checkpoint's).
        for ps_index in range(len(self._clients)):
            self._pull_version(ps_index, start)
        self._spawn("prophet-tf-pump", self._pump)
        for i in range(len(self._clients)):
            self._spawn(f"prophet-tf-send-{i}", self._sender, i)
            self._spawn(f"prophet-tf-pull-{i}", self._puller, i)
        self._started = True
        # Push the last step's gradients before the interpreter exits, or the
        # other workers would wait for them in vain.
        atexit.register(self.shutdown)
        logger.info("worker %d: training %d variables through %d PS task(s), scheduler %s%s",
                    self.worker_id, len(specs), len(self._clients), self.scheduler_name,
                    f", from step {start}" if start else "")
        return start

    def _register(self, variables, optimizer_config: str, resume_step: int) -> int:
        """Declares the model to every PS; returns the step training starts from."""
        initial = None
        if self.worker_id == 0:
            # Version 0, staged at creation (in eager mode the step counter
            # has already moved on to the step being traced).
            initial = {i: _native.await_param(0, key=v.ps_key, dtype=v.dtype,
                                              shape=v.shape).numpy()
                       for i, v in enumerate(variables)}
        versions = [client.register(self._specs, optimizer_config, initial,
                                    timeout=self.rpc_timeout_s, resume_step=resume_step,
                                    max_partition_bytes=self._partition_bytes).version
                    for client in self._clients]
        if len(set(versions)) != 1:
            raise RuntimeError(
                "The PS tasks start from different steps (restored different checkpoints: "
                "checkpoint by steps, not seconds, with several PS tasks). Received: "
                + ", ".join(f"PS {i} at step {v}" for i, v in enumerate(versions)))
        return versions[0]

    def _spawn(self, name, target, *args):
        thread = threading.Thread(target=self._guard, args=(target, *args), name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _guard(self, target, *args):
        try:
            target(*args)
        except BaseException as e:  # noqa: BLE001 - any failure must reach the training thread.
            if not self._stop.is_set():
                self._fail(e)

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
            message = f"prophet_tf engine on worker {self.worker_id} failed: {error}"
            logger.error(message)
            _native.abort(message)
        self._stop.set()

    # -- gradients out -------------------------------------------------------------------

    def _pump(self):
        """Ready gradients -> scheduler -> per-link send queues."""
        while not self._stop.is_set():
            grad = _native.next_grad(0.1)
            if grad is None:
                continue
            key = self._ps_key_of.get(grad.key)
            if key is None:
                _native.release_grad(grad.handle)
                raise RuntimeError(f"a gradient arrived for unregistered variable key {grad.key}")
            if grad.step > self._last_step:
                # First gradient of a new step: the PS will have step+1 soon.
                self._last_step = grad.step
                progress.report(step=grad.step + 1)  # For `prophet-tf launch`.
                if self._learning_rate is not None:
                    with self._lock:
                        self._step_learning_rates[grad.step] = float(self._learning_rate())
                        self._step_learning_rates.pop(grad.step - 8, None)
                for q in self._pull_queues:
                    q.put(grad.step + 1)
                self._record_plan()
            partitions = self._partitions_of[key]
            priority = self._specs[key].priority
            with self._lock:
                if (key, grad.step) in self._grads:
                    # Its buffer may still be read by a sender: never replace it.
                    _native.release_grad(grad.handle)
                    raise RuntimeError(f"a second gradient arrived for variable key {grad.key} "
                                       f"at step {grad.step}")
                self._grads[key, grad.step] = [grad, len(partitions)]
                for p in partitions:
                    self._scheduler.add(schedulers.ReadyItem(
                        key=key, partition=p.partition, ps_index=p.ps_index, step=grad.step,
                        priority=priority, nbytes=p.nbytes, ready_ns=grad.ready_ns))
                arrived = self._arrived_of_step.pop(grad.step, 0) + 1
                if arrived == len(self._specs):
                    # The step's backprop is over (the last step of fit too):
                    # nothing is held back for gradients that will not come.
                    self._scheduler.flush()
                else:
                    self._arrived_of_step[grad.step] = arrived
                self._drain_locked()

    def _drain_locked(self) -> None:
        while block := self._scheduler.next_block(time.monotonic_ns()):
            self._send_queues[block[0].ps_index].put(block)

    def _sender(self, ps_index: int):
        """Pushes one link's blocks in order, at most MAX_RPCS_PER_LINK at a time."""
        client = self._clients[ps_index]
        while not self._stop.is_set():
            try:
                block = self._send_queues[ps_index].get(timeout=0.1)
            except queue.Empty:
                continue
            with self._lock:
                while self._rpcs[ps_index] >= self.MAX_RPCS_PER_LINK and not self._stop.is_set():
                    self._rpc_free[ps_index].wait(0.1)
                self._rpcs[ps_index] += 1
                chunks = [Chunk(item.key, item.partition, item.step, self._rows(item))
                          for item in block]
                steps = {item.step for item in block}
                learning_rate = self._step_learning_rates.get(block[0].step) \
                    if len(steps) == 1 else None
            for key, step in {(item.key, item.step) for item in block}:
                _native.stamp(self._native_keys[key], step, EngineStamp.PUSH_BEGIN)
            start = time.monotonic_ns()
            future = client.push_future(chunks, timeout=self.rpc_timeout_s,  # Serialized here.
                                        learning_rate=learning_rate)
            self._release(block)
            future.add_done_callback(
                lambda f, block=block, start=start: self._pushed(f, ps_index, block, start))

    def _rows(self, item: schedulers.ReadyItem) -> np.ndarray:
        flat = self._grads[item.key, item.step][0].view()
        shape = self._specs[item.key].shape
        if not shape:
            return flat
        p = self._partitions_of[item.key][item.partition]
        return flat.reshape(shape)[p.row_begin:p.row_end]

    def _release(self, block) -> None:
        """Returns the gradient buffers whose every partition has been serialized."""
        with self._lock:
            for item in block:
                entry = self._grads[item.key, item.step]
                entry[1] -= 1
                if entry[1] == 0:
                    del self._grads[item.key, item.step]
                    _native.release_grad(entry[0].handle)

    def _pushed(self, future, ps_index: int, block, start: int) -> None:
        end = time.monotonic_ns()
        try:
            future.result()
        except Exception as e:  # noqa: BLE001 - reported to the training thread.
            if not self._stop.is_set():
                self._fail(RuntimeError(
                    f"push to PS {ps_index} at {self._clients[ps_index].address} failed: "
                    f"{_rpc_message(e)}"))
            return
        for key, step in {(item.key, item.step) for item in block}:
            _native.stamp(self._native_keys[key], step, EngineStamp.PUSH_END)
        if self._recorder is not None:
            self._recorder.transfer(timeline_lib.Transfer(
                "push", ps_index, tuple(self._native_keys[i.key] for i in block),
                sum(i.nbytes for i in block), block[0].step, start, end))
        with self._lock:
            self._rpcs[ps_index] -= 1
            self._rpc_free[ps_index].notify_all()
            self._scheduler.on_sent(block, start, end)
            self._drain_locked()
            self._idle.notify_all()

    def _record_plan(self) -> None:
        if self._recorder is None:
            return
        with self._lock:
            plan = self._scheduler.plan()
        version = plan.get("version", 0)
        if version != self._plan_version:
            self._plan_version = version
            self._recorder.plan(time.monotonic_ns(), plan)

    # -- parameters in -------------------------------------------------------------------

    def _puller(self, ps_index: int):
        while not self._stop.is_set():
            try:
                version = self._pull_queues[ps_index].get(timeout=0.1)
            except queue.Empty:
                continue
            self._pull_version(ps_index, version)

    def _pull_version(self, ps_index: int, version: int) -> None:
        """Streams one PS's partitions of `version` in priority order and delivers them."""
        client = self._clients[ps_index]
        owned = sorted((p for p in self._plan if p.ps_index == ps_index),
                       key=lambda p: (self._specs[p.key].priority, p.partition))
        previous = time.monotonic_ns()
        waited_s = 0.0
        while owned:
            try:
                for chunk in client.pull(owned, version, timeout=self.rpc_timeout_s):
                    arrived = time.monotonic_ns()
                    if not owned:
                        raise RuntimeError(f"PS {ps_index} sent more partitions than asked for. "
                                           f"Received: key {chunk.key} partition "
                                           f"{chunk.partition} version {chunk.version}")
                    expected = owned.pop(0)  # Partitions arrive in the order asked for.
                    # The key asked for, not the wire's: _deliver_partition checks that.
                    native_key = self._native_keys[expected.key]
                    _native.stamp(native_key, version, EngineStamp.PULL_RECEIVED)
                    if self._recorder is not None:
                        self._recorder.transfer(timeline_lib.Transfer(
                            "pull", ps_index, (native_key,), chunk.array.nbytes, version,
                            previous, arrived))
                    previous = arrived
                    self._deliver_partition(chunk, expected, version)
            except Exception as e:
                if self._stop.is_set():
                    return
                code = getattr(e, "code", None)
                if callable(code) and code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    # Slow peers are not lost ones: the heartbeats tell those
                    # apart and fail the job, so waiting on is safe.
                    waited_s += self.rpc_timeout_s
                    logger.warning("worker %d: still waiting for version %d from PS %d at %s "
                                   "after %.0f s (a slow worker?)", self.worker_id, version,
                                   ps_index, client.address, waited_s)
                    continue
                raise RuntimeError(f"pull of version {version} from PS {ps_index} at "
                                   f"{client.address} failed: {_rpc_message(e)}") from e

    def _deliver_partition(self, chunk, expected: sharding.Partition, version: int) -> None:
        """Checks a pulled chunk against the partition asked for, then stages it."""
        key = expected.key
        if (chunk.key, chunk.partition) != (key, expected.partition) or chunk.version < version:
            raise RuntimeError(
                f"PS {expected.ps_index} sent another partition than the one asked for: "
                f"expected key {key} partition {expected.partition} at version >= {version}. "
                f"Received: key {chunk.key} partition {chunk.partition} version {chunk.version}")
        data = chunk.array
        spec = self._specs[key]
        if data.nbytes != expected.nbytes or codec.dtype_name(data.dtype) != spec.dtype:
            raise RuntimeError(
                f"PS {expected.ps_index} sent key {key} partition {expected.partition} with "
                f"{data.nbytes} bytes of {codec.dtype_name(data.dtype)}; the partition holds "
                f"{expected.nbytes} bytes of {spec.dtype}")
        native_key = self._native_keys[key]
        with self._assembly_lock:
            remaining = self._assembly.get((key, version))
            if remaining is None:
                _native.deliver_begin(native_key, version)
                remaining = self._assembly[key, version] = [len(self._partitions_of[key])]
        # Bounds-checked by the runtime; disjoint partitions copy in parallel.
        _native.deliver_write(native_key, version, expected.row_begin * self._row_bytes[key], data)
        with self._assembly_lock:
            remaining[0] -= 1
            done = remaining[0] == 0
            if done:
                del self._assembly[key, version]
        if done:
            _native.deliver_commit(native_key, version)

    # -- liveness ------------------------------------------------------------------------

    def _heartbeat(self, ps_index: int) -> None:
        """Keeps this worker alive on one PS and learns there when the job failed.

        Pulls fail at once when a PS's connection breaks, but a worker that is
        computing has no pull waiting, and a PS host that vanishes breaks no
        connection: the heartbeat's deadline notices both.
        """
        client = self._clients[ps_index]
        silent_since = None
        while True:
            try:
                failure = client.heartbeat(self._last_step + 1, timeout=self.PS_TIMEOUT_S / 2)
            except Exception as e:  # noqa: BLE001 - classified below
                code = getattr(e, "code", None)
                transient = callable(code) and code() in _TRANSIENT_CODES
                now = time.monotonic()
                silent_since = silent_since or now
                if self._stop.is_set():
                    return
                if not transient or now - silent_since >= self.PS_TIMEOUT_S:
                    raise RuntimeError(
                        f"PS {ps_index} at {client.address} is unreachable (no heartbeat "
                        f"answer for {now - silent_since:.1f} s): {_rpc_message(e)}") from e
            else:
                silent_since = None
                if failure:
                    raise RuntimeError(f"PS {ps_index} at {client.address} reports that the "
                                       f"job failed: {failure}")
            if self._stop.wait(self.HEARTBEAT_INTERVAL_S):
                return

    def _leave(self) -> None:
        """Tells every PS this worker stops after the steps it pushed."""
        for client in self._clients:
            try:
                client.heartbeat(self._last_step + 1, leaving=True, timeout=2.0)
            except Exception as e:  # noqa: BLE001 - the PS may be gone already
                logger.debug("leaving PS at %s: %s", client.address, _rpc_message(e))

    # -- stop ----------------------------------------------------------------------------

    def flush(self, timeout_s: float | None = None) -> bool:
        """Sends every gradient handed to the engine; True once all are pushed."""
        if not self._started:
            return True
        deadline = time.monotonic() + (self.rpc_timeout_s if timeout_s is None else timeout_s)
        while time.monotonic() < deadline and self._error is None:
            with self._lock:
                self._scheduler.flush()
                self._drain_locked()
                if (not self._grads and not any(self._rpcs) and _native.queued_grads() == 0
                        and all(q.empty() for q in self._send_queues)):
                    return True
                self._idle.wait(0.05)
        return False

    def shutdown(self, flush_timeout_s: float = 30.0) -> None:
        """Pushes what is pending, writes the timeline, stops and joins the threads."""
        if self._started and not self._stop.is_set():
            flushed = self.flush(flush_timeout_s)
            self.write_timeline()
            self._stop.set()
            if flushed:  # Otherwise the PS must not count the unsent steps as pushed.
                self._leave()
        self._stop.set()
        # Closing the channels first cancels any RPC a thread still waits on
        # (a pull of a version that will never come), so every thread ends
        # here, before the interpreter tears down what they use.
        for client in getattr(self, "_clients", []):
            client.close()
        for thread in self._threads:
            thread.join(timeout=self.JOIN_TIMEOUT_S)
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive:
            logger.warning("worker %d: engine threads still running after %.0f s: %s",
                           self.worker_id, self.JOIN_TIMEOUT_S, ", ".join(alive))

    def write_timeline(self) -> str | None:
        """Writes this worker's timeline (if enabled); returns its path."""
        if not self._started or self._recorder is None:
            return None
        path = self._recorder.write(self.timeline, _native.drain_stamps(),
                                    _native.stamps_dropped())
        logger.info("worker %d: timeline written to %s", self.worker_id, path)
        return path


# Heartbeat errors that may pass (a PS restarting its listener, a slow answer).
_TRANSIENT_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def _itemsize(dtype_name: str) -> int:
    return codec.to_numpy_dtype(dtype_name).itemsize


def _rpc_message(error: Exception) -> str:
    code = getattr(error, "code", None)
    if callable(code):
        return f"{code().name}: {error.details()}"
    return str(error)
