"""Gradients out: the pump and one sender per PS link.

The pump takes ready gradients from the op runtime (`PushGrad` enqueued them)
and hands them to the dispatch; on the first gradient of iteration k it notes
k's learning rate and batch rows and asks every PS for version k+1. Every
block the dispatch releases goes to its link's sender, which pushes it as one
asynchronous RPC, at once (the dispatch's window bounds what is in flight); a
finished push tells the dispatch (`on_sent`), which may release more. To a PS
on another host, a step's pushes wait while a PS on this host still owes that
version to the other hosts' workers (answers_first.py).

The engine (engine.py) runs these loops on its threads and owns their
failures; everything here shares one lock.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Sequence

import numpy as np

from prophet_tf import progress
from prophet_tf.engine import liveness, schedulers
from prophet_tf.engine import timeline as timeline_lib
from prophet_tf.engine.answers_first import AnswersFirst
from prophet_tf.engine.dispatch import Dispatch
from prophet_tf.ps import sharding
from prophet_tf.ps.client import Chunk

__all__ = ["GradientsOut"]


class GradientsOut:
    """Moves one worker's ready gradients to the PS tasks.

    Args:
      runtime: the op runtime (its ``next_grad``, ``release_grad`` and
        ``queued_grads``).
      dispatch: the worker's send decisions.
      clients: one PS client per PS task, by PS index.
      stop: set when the engine stops; the loops end then.
      fail: ``fail(error)`` fails the engine; a push that fails calls it.
      ask_version: ``ask_version(v)`` asks every PS for version ``v``.
      rpc_timeout_s: deadline of each push.
      answers: holds pushes to other hosts (answers_first.py); None: off.
      recorder: the timeline's recorder; None: no timeline.
      learning_rate, batch_rows: as in ``Engine.start``.
    """

    def __init__(self, runtime, dispatch: Dispatch, clients: Sequence, stop: threading.Event,
                 fail: Callable[[BaseException], None], ask_version: Callable[[int], None], *,
                 rpc_timeout_s: float, answers: AnswersFirst | None = None,
                 recorder: timeline_lib.Recorder | None = None,
                 learning_rate: Callable[[int], float] | None = None,
                 batch_rows: Callable[[int], int | None] | None = None):
        self._native = runtime
        self._dispatch = dispatch
        self._clients = clients
        self._stop = stop
        self._fail = fail
        self._ask_version = ask_version
        self._rpc_timeout_s = rpc_timeout_s
        self._answers = answers
        self._recorder = recorder
        self._lock = threading.Lock()  # The dispatch and the learning rates.
        self._idle = threading.Condition(self._lock)
        self._send_queues = [queue.Queue() for _ in clients]
        self._plan_version = None
        self._learning_rate = learning_rate
        self._learning_rates: dict[int, float] = {}  # iteration -> its learning rate
        self._batch_rows_of = batch_rows
        self._batch_rows: dict[int, int | None] = {}  # iteration -> this worker's rows

    def pump(self):
        """Ready gradients -> dispatch -> the links' senders."""
        native, dispatch = self._native, self._dispatch
        while not self._stop.is_set():
            grad = native.next_grad(0.1)
            if grad is None:
                continue
            if dispatch.starts_iteration(grad.iteration):
                # First gradient of iteration k: the PS will have version k+1 soon.
                progress.report(step=grad.iteration + 1)  # For `prophet-tf launch`.
                if self._learning_rate is not None:
                    with self._lock:
                        self._learning_rates[grad.iteration] = float(
                            self._learning_rate(grad.iteration))
                        self._learning_rates.pop(grad.iteration - 8, None)
                if self._batch_rows_of is not None:
                    with self._lock:
                        self._batch_rows[grad.iteration] = self._batch_rows_of(grad.iteration)
                        self._batch_rows.pop(grad.iteration - 8, None)
                self._ask_version(grad.iteration + 1)
                self._record_plan()
            with self._lock:
                try:
                    dispatch.add(grad.key, grad.iteration, grad.ready_ns, grad)
                except BaseException:
                    # Never replace a buffer a sender may still read: drop the new one.
                    native.release_grad(grad.handle)
                    raise
                self._drain_locked()

    def flush(self, wait_s: float) -> bool:
        """Releases what the scheduler holds back; True once every gradient is
        pushed, else False after waiting up to ``wait_s`` for a push to finish."""
        with self._lock:
            self._dispatch.flush()
            self._drain_locked()
            if self._dispatch.idle and self._native.queued_grads() == 0:
                return True
            self._idle.wait(wait_s)
        return False

    def _drain_locked(self) -> None:
        for block in self._dispatch.next_blocks(time.monotonic_ns()):
            self._send_queues[block[0].ps_index].put(block)

    def sender(self, ps_index: int):
        """Pushes one link's blocks in order, each at once (the window bounds them)."""
        client = self._clients[ps_index]
        while not self._stop.is_set():
            try:
                block = self._send_queues[ps_index].get(timeout=0.1)
            except queue.Empty:
                continue
            with self._lock:
                chunks = [Chunk(item.key, item.partition, item.iteration, self._elements(item),
                                batch_rows=self._batch_rows.get(item.iteration))
                          for item in block]
                iterations = {item.iteration for item in block}
                learning_rate = self._learning_rates.get(block[0].iteration) \
                    if len(iterations) == 1 else None
            if self._answers is not None and self._answers.applies_to(ps_index):
                self._answers.wait(min(iterations))
            start = time.monotonic_ns()
            future = client.push_future(chunks, timeout=self._rpc_timeout_s,  # Serialized here.
                                        learning_rate=learning_rate)
            with self._lock:
                for grad in self._dispatch.release(block):
                    self._native.release_grad(grad.handle)
            future.add_done_callback(
                lambda f, block=block, start=start: self._pushed(f, ps_index, block, start))

    def _elements(self, item: schedulers.ReadyItem) -> np.ndarray:
        p = self._dispatch.partition(item)
        return sharding.elements(self._dispatch.payload(item).view(), p)  # a Grad's bytes

    def _pushed(self, future, ps_index: int, block, start: int) -> None:
        end = time.monotonic_ns()
        try:
            future.result()
        except Exception as e:  # noqa: BLE001 - reported to the training thread.
            if not self._stop.is_set():
                self._fail(RuntimeError(
                    f"push to PS {ps_index} at {self._clients[ps_index].address} failed: "
                    f"{liveness.rpc_message(e)}"))
            return
        if self._recorder is not None:
            self._recorder.transfer(timeline_lib.Transfer(
                "push", ps_index, tuple(self._dispatch.native_keys[i.key] for i in block),
                sum(i.nbytes for i in block), block[0].iteration, start, end))
        with self._lock:
            self._dispatch.on_sent(block, start, end)
            self._drain_locked()
            self._idle.notify_all()

    def _record_plan(self) -> None:
        if self._recorder is None:
            return
        with self._lock:
            plan = self._dispatch.plan()
        version = plan.get("version", 0)
        if version != self._plan_version:
            self._plan_version = version
            self._recorder.plan(time.monotonic_ns(), plan)
