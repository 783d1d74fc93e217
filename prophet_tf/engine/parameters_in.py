"""Parameters in: one puller per PS link.

A puller streams its PS's partitions of each version asked for as the PS
applies them, and hands each to the assembler (delivery.py), which publishes
a parameter once all its partitions are in. The engine (engine.py) runs the
pullers on its threads and owns their failures.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Sequence

import grpc

from prophet_tf.engine import liveness
from prophet_tf.engine import timeline as timeline_lib
from prophet_tf.engine.delivery import Assembler, Expected
from prophet_tf.engine.dispatch import Dispatch

__all__ = ["ParametersIn"]

logger = logging.getLogger("prophet_tf.engine.engine")  # the worker engine's one logger


class ParametersIn:
    """Pulls each version asked for from every PS task into the op runtime.

    Args:
      worker_id: this worker's index (for messages).
      runtime: the op runtime (its ``deliver_begin``, ``deliver_write`` and
        ``deliver_commit``).
      dispatch: the worker's key map and partitions.
      clients: one PS client per PS task, by PS index.
      stop: set when the engine stops; the loops end then.
      rpc_timeout_s: deadline of each pull; a pull that reaches it is renewed.
      recorder: the timeline's recorder; None: no timeline.
    """

    def __init__(self, worker_id: int, runtime, dispatch: Dispatch, clients: Sequence,
                 stop: threading.Event, *, rpc_timeout_s: float,
                 recorder: timeline_lib.Recorder | None = None):
        self._worker_id = worker_id
        self._dispatch = dispatch
        self._assembler = Assembler(runtime, dispatch)
        self._clients = clients
        self._stop = stop
        self._rpc_timeout_s = rpc_timeout_s
        self._recorder = recorder
        self._pull_queues = [queue.Queue() for _ in clients]

    def ask(self, version: int) -> None:
        """Asks every PS's puller for ``version``."""
        for q in self._pull_queues:
            q.put(version)

    def puller(self, ps_index: int):
        while not self._stop.is_set():
            try:
                version = self._pull_queues[ps_index].get(timeout=0.1)
            except queue.Empty:
                continue
            self.pull_version(ps_index, version)

    def pull_version(self, ps_index: int, version: int) -> None:
        """Pulls one PS's partitions of `version` and delivers each as it comes.

        The PS sends each partition the moment it is applied (the most urgent
        first among those ready), so they arrive in any order; each must be
        one asked for and not yet received.
        """
        client = self._clients[ps_index]
        expected = Expected(ps_index, self._dispatch.pull_order(ps_index))
        previous = time.monotonic_ns()
        waited_s = 0.0
        while expected:
            try:
                for chunk in client.pull(expected.left(), version, timeout=self._rpc_timeout_s):
                    arrived = time.monotonic_ns()
                    partition = expected.take(chunk)
                    if self._recorder is not None:
                        # The key asked for, not the wire's: the assembler checks that.
                        native_key = self._dispatch.native_keys[partition.key]
                        self._recorder.transfer(timeline_lib.Transfer(
                            "pull", ps_index, (native_key,), chunk.array.nbytes, version,
                            previous, arrived))
                    previous = arrived
                    self._assembler.deliver(chunk, partition, version)
            except Exception as e:
                if self._stop.is_set():
                    return
                code = getattr(e, "code", None)
                if callable(code) and code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    # Slow peers are not lost ones: the heartbeats tell those
                    # apart and fail the job, so waiting on is safe.
                    waited_s += self._rpc_timeout_s
                    logger.warning("worker %d: still waiting for version %d from PS %d at %s "
                                   "after %.0f s (a slow worker?)", self._worker_id, version,
                                   ps_index, client.address, waited_s)
                    continue
                raise RuntimeError(f"pull of version {version} from PS {ps_index} at "
                                   f"{client.address} failed: {liveness.rpc_message(e)}") from e
