"""The worker's background engine: gradients out, parameters in.

Threads (all daemons; any failure aborts the op runtime, so a waiting
AwaitParam fails with the message instead of hanging):

- pump: takes ready gradients from the op library (`PushGrad` enqueued them),
  tells the scheduler, and hands each block it returns to the PS links; on the
  first gradient of step k it asks every PS for version k+1.
- one sender per PS task: pushes its share of each block, in order.
- one puller per PS task: streams the task's partitions of a version in
  priority order and delivers each parameter once all its partitions are in.

Keys: the op library knows a variable by its creation index (`ps_key`); the
PS knows the trained variables by their position in `trainable_variables`
(which is also their priority). The engine maps between the two.
"""
from __future__ import annotations

import atexit
import ctypes
import enum
import logging
import os
import queue
import threading
import time
from typing import Sequence

import numpy as np

from prophet_tf import _native, codec
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
      scheduler: scheduler name; None reads PROPHET_TF_SCHEDULER, else "fifo".
      rpc_timeout_s: deadline of each RPC and of waiting for a version.
    """

    def __init__(self, config: cluster_lib.ClusterConfig, scheduler: str | None = None, *,
                 rpc_timeout_s: float = 120.0, timeline: str | None = None):
        name = scheduler if scheduler is not None else os.environ.get(SCHEDULER_ENV, "fifo")
        self.scheduler_name = schedulers.validate_scheduler(name)
        if rpc_timeout_s <= 0:
            raise ValueError(f"rpc_timeout_s must be positive. Received: {rpc_timeout_s!r}")
        self.config = config
        self.rpc_timeout_s = rpc_timeout_s
        self.timeline = timeline
        self._started = False
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._threads: list[threading.Thread] = []

    @property
    def worker_id(self) -> int:
        return self.config.task_index

    # -- start ---------------------------------------------------------------------------

    def start(self, variables: Sequence, optimizer_config: str) -> None:
        """Registers the trained variables with every PS, stages version 0, starts threads.

        Args:
          variables: the trained PSVariables in trainable_variables order.
          optimizer_config: JSON the PS rebuilds the Keras optimizer from.
        """
        if self._started:
            raise RuntimeError("the engine was already started")
        self._native_keys = [v.ps_key for v in variables]
        self._ps_key_of = {k: i for i, k in enumerate(self._native_keys)}
        specs = variable_specs(variables)
        self._specs = specs
        self._plan = sharding.plan(specs, self.config.num_ps)
        self._partitions_of: dict[int, list[sharding.Partition]] = {}
        for p in self._plan:
            self._partitions_of.setdefault(p.key, []).append(p)
        self._row_bytes = [
            int(np.prod(s.shape[1:], dtype=np.int64)) * _itemsize(s.dtype) if s.shape else
            _itemsize(s.dtype) for s in specs]
        codec.tune_allocator()  # Recycle transfer buffers instead of page-faulting them in.
        self._clients = [PSClient(address, self.worker_id, self.config.num_workers)
                         for address in self.config.ps]
        for client in self._clients:
            client.wait_ready(self.rpc_timeout_s)
        initial = None
        if self.worker_id == 0:
            initial = {i: v.read_value().numpy() for i, v in enumerate(variables)}
        for client in self._clients:
            client.register(specs, optimizer_config, initial, timeout=self.rpc_timeout_s)
        self._scheduler = schedulers.make_scheduler(self.scheduler_name)
        self._assembly: dict[tuple[int, int], list] = {}
        self._assembly_lock = threading.Lock()
        self._grads: dict[tuple[int, int], list] = {}  # (ps key, step) -> [Grad, parts left]
        self._send_queues = [queue.Queue() for _ in self._clients]
        self._pull_queues = [queue.Queue() for _ in self._clients]
        self._pending_sends = 0
        self._sends_done = threading.Condition()
        # Version 0 comes from the PS, so every worker starts from worker 0's values.
        for ps_index in range(len(self._clients)):
            self._pull_version(ps_index, 0)
        self._last_pulled_step = -1
        self._spawn("prophet-tf-pump", self._pump)
        for i in range(len(self._clients)):
            self._spawn(f"prophet-tf-send-{i}", self._sender, i)
            self._spawn(f"prophet-tf-pull-{i}", self._puller, i)
        self._started = True
        # Push the last step's gradients before the interpreter exits, or the
        # other workers would wait for them in vain.
        atexit.register(self.shutdown)
        logger.info("worker %d: training %d variables through %d PS task(s), scheduler %s",
                    self.worker_id, len(specs), len(self._clients), self.scheduler_name)

    def _spawn(self, name, target, *args):
        thread = threading.Thread(target=self._guard, args=(target, *args), name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _guard(self, target, *args):
        try:
            target(*args)
        except BaseException as e:  # noqa: BLE001 - any failure must reach the training thread.
            if self._stop.is_set():
                return
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
        while not self._stop.is_set():
            grad = _native.next_grad(0.1)
            if grad is None:
                continue
            key = self._ps_key_of.get(grad.key)
            if key is None:
                _native.release_grad(grad.handle)
                raise RuntimeError(f"a gradient arrived for unregistered variable key {grad.key}")
            if grad.step > self._last_pulled_step:
                # First gradient of a new step: the PS will have step+1 soon.
                self._last_pulled_step = grad.step
                for q in self._pull_queues:
                    q.put(grad.step + 1)
            with self._assembly_lock:
                self._grads[key, grad.step] = [grad, 0]
            self._scheduler.add(schedulers.ReadyItem(
                key=key, step=grad.step, priority=self._specs[key].priority,
                nbytes=grad.nbytes, ready_ns=grad.ready_ns))
            while block := self._scheduler.next_block():
                self._send_block(block)

    def _send_block(self, block: list[schedulers.ReadyItem]) -> None:
        by_ps: dict[int, list[Chunk]] = {}
        for item in block:
            with self._assembly_lock:
                entry = self._grads[item.key, item.step]
            flat = entry[0].view()
            shape = self._specs[item.key].shape
            array = flat.reshape(shape) if shape else flat
            for p in self._partitions_of[item.key]:
                rows = array[p.row_begin:p.row_end] if shape else flat
                by_ps.setdefault(p.ps_index, []).append(Chunk(item.key, p.partition, item.step, rows))
            with self._assembly_lock:
                entry[1] += len(self._partitions_of[item.key])
        with self._sends_done:
            self._pending_sends += len(by_ps)
        for ps_index, chunks in by_ps.items():
            self._send_queues[ps_index].put(chunks)

    def _sender(self, ps_index: int):
        client = self._clients[ps_index]
        while not self._stop.is_set():
            try:
                chunks = self._send_queues[ps_index].get(timeout=0.1)
            except queue.Empty:
                continue
            keys = sorted({(c.key, c.step) for c in chunks})
            for key, step in keys:
                _native.stamp(self._native_keys[key], step, EngineStamp.PUSH_BEGIN)
            try:
                client.push(chunks, timeout=self.rpc_timeout_s)
            except Exception as e:
                raise RuntimeError(f"push to PS {ps_index} at {client.address} failed: "
                                   f"{_rpc_message(e)}") from e
            for key, step in keys:
                _native.stamp(self._native_keys[key], step, EngineStamp.PUSH_END)
            self._release(chunks)
            with self._sends_done:
                self._pending_sends -= 1
                self._sends_done.notify_all()

    def _release(self, chunks: list[Chunk]) -> None:
        with self._assembly_lock:
            for c in chunks:
                entry = self._grads[c.key, c.step]
                entry[1] -= 1
                if entry[1] == 0:
                    del self._grads[c.key, c.step]
                    _native.release_grad(entry[0].handle)

    # -- parameters in -------------------------------------------------------------------

    def _puller(self, ps_index: int):
        while not self._stop.is_set():
            try:
                version = self._pull_queues[ps_index].get(timeout=0.1)
            except queue.Empty:
                continue
            self._pull_version(ps_index, version)

    def _pull_version(self, ps_index: int, version: int) -> None:
        client = self._clients[ps_index]
        owned = sorted((p for p in self._plan if p.ps_index == ps_index),
                       key=lambda p: (self._specs[p.key].priority, p.partition))
        try:
            for chunk in client.pull(owned, version, timeout=self.rpc_timeout_s):
                _native.stamp(self._native_keys[chunk.key], version, EngineStamp.PULL_RECEIVED)
                self._deliver_partition(chunk, version)
        except Exception as e:
            if self._stop.is_set():
                return
            raise RuntimeError(f"pull of version {version} from PS {ps_index} at "
                               f"{client.address} failed: {_rpc_message(e)}") from e

    def _deliver_partition(self, chunk, version: int) -> None:
        key = chunk.key
        native_key = self._native_keys[key]
        partition = self._partitions_of[key][chunk.partition]
        offset = partition.row_begin * self._row_bytes[key]
        with self._assembly_lock:
            entry = self._assembly.get((key, version))
            if entry is None:
                address = _native.deliver_begin(native_key, version)
                entry = self._assembly[key, version] = [address, len(self._partitions_of[key])]
        data = chunk.array
        if data.nbytes:
            ctypes.memmove(entry[0] + offset, data.ctypes.data, data.nbytes)
        with self._assembly_lock:
            entry[1] -= 1
            done = entry[1] == 0
            if done:
                del self._assembly[key, version]
        if done:
            _native.deliver_commit(native_key, version)

    # -- stop ----------------------------------------------------------------------------

    def flush(self, timeout_s: float | None = None) -> bool:
        """Waits until every gradient handed to the engine has been pushed."""
        if not self._started:
            return True
        deadline = time.monotonic() + (self.rpc_timeout_s if timeout_s is None else timeout_s)
        while time.monotonic() < deadline and self._error is None:
            with self._sends_done:
                if self._pending_sends == 0 and not self._grads and _native.queued_grads() == 0:
                    return True
                self._sends_done.wait(0.05)
        return False

    def shutdown(self, flush_timeout_s: float = 30.0) -> None:
        """Pushes what is pending, then stops the threads and closes the channels."""
        if self._started and not self._stop.is_set():
            self.flush(flush_timeout_s)
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=2.0)
        for client in getattr(self, "_clients", []):
            client.close()


def _itemsize(dtype_name: str) -> int:
    return codec.to_numpy_dtype(dtype_name).itemsize


def _rpc_message(error: Exception) -> str:
    code = getattr(error, "code", None)
    if callable(code):
        return f"{code().name}: {error.details()}"
    return str(error)
