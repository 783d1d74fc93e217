"""Liveness: heartbeats, the watchdog, and workers that leave.

From Register on, each worker sends a Heartbeat about once a second. A worker
silent for ``worker_timeout_s`` is lost and the job fails: every waiting Pull,
later Push and Heartbeat answer carries the reason. Watching starts with a
worker's first Heartbeat, so a client that never sends one (a tool, a test) is
not watched; once any worker has sent one, every other must send its first
within ``startup_timeout_s``. A worker that leaves normally says how many
iterations it pushed; a Pull for a version it can never complete then fails
instead of waiting.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from prophet_tf.ps.errors import check_sender, invalid

__all__ = ["Liveness", "check_heartbeat"]

logger = logging.getLogger("prophet_tf.ps.servicer")  # the PS task's one logger


def check_heartbeat(request, num_workers: int) -> None:
    """Rejects a malformed HeartbeatRequest (INVALID_ARGUMENT)."""
    check_sender(request, "a HeartbeatRequest", num_workers)
    if request.steps_pushed < 0:
        raise invalid(f"steps_pushed must be >= 0. Received: steps_pushed={request.steps_pushed}")


class Liveness:
    """What the PS knows of each worker's heartbeats, and the watchdog thread.

    Every method ending in ``_locked`` runs under the servicer's state lock
    ``lock``, which the watchdog takes too.

    Args:
        fail_locked: ``(message)``: fails the job; called under ``lock``.
        failed_locked: whether the job has already failed; under ``lock``.
    """

    def __init__(self, num_workers: int, worker_timeout_s: float, startup_timeout_s: float,
                 lock: threading.Lock, fail_locked: Callable[[str], None],
                 failed_locked: Callable[[], bool], name: str):
        self.num_workers = num_workers
        self.worker_timeout_s = worker_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self._lock = lock
        self._fail_locked, self._failed_locked = fail_locked, failed_locked
        self._first_heartbeat: float | None = None
        # worker -> monotonic time of its last Heartbeat; workers that left
        # normally -> the number of iterations they pushed.
        self._last_seen: dict[int, float] = {}
        self._steps_pushed: dict[int, int] = {}
        self._left: dict[int, int] = {}
        self._stopping = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, daemon=True, name=name)
        self._watchdog.start()

    def heartbeat_locked(self, wid: int, steps_pushed: int, leaving: bool) -> bool:
        """Records a heartbeat; True when the worker left (waiting pulls must look)."""
        if self._first_heartbeat is None:
            self._first_heartbeat = time.monotonic()
        self._steps_pushed[wid] = steps_pushed
        if leaving:
            logger.info("Worker %d left after pushing %d steps", wid, steps_pushed)
            self._left[wid] = steps_pushed
            self._last_seen.pop(wid, None)
            return True
        self._last_seen[wid] = time.monotonic()
        self._left.pop(wid, None)
        return False

    def registered_locked(self, wid: int) -> None:
        """A worker registered (again): it has not left."""
        self._left.pop(wid, None)

    def departed_before_locked(self, min_version: int) -> tuple[int, int] | None:
        """A worker that left before pushing iteration ``min_version - 1``, if any."""
        for wid, steps in sorted(self._left.items()):
            if steps < min_version:
                return wid, steps
        return None

    def left_after_locked(self, wid: int) -> int | None:
        """The steps worker ``wid`` pushed before it left the job, or None if it has not left."""
        return self._left.get(wid)

    def stop(self) -> None:
        self._stopping.set()

    def _watch(self):
        """Fails the job when a registered worker stops sending heartbeats."""
        period = min(1.0, self.worker_timeout_s / 4)
        while not self._stopping.wait(period):
            now = time.monotonic()
            with self._lock:
                if self._failed_locked():
                    continue
                message = self._lost_locked(now)
                if message:
                    self._fail_locked(message)

    def _lost_locked(self, now: float) -> str | None:
        for wid, seen in sorted(self._last_seen.items()):
            if now - seen > self.worker_timeout_s:
                return (f"Worker {wid} was lost: no heartbeat for {now - seen:.1f} s "
                        f"(limit {self.worker_timeout_s:g} s; it had pushed "
                        f"{self._steps_pushed.get(wid, 0)} steps). The job cannot go on.")
        first = self._first_heartbeat
        if first is not None and now - first > self.startup_timeout_s:
            missing = [w for w in range(self.num_workers)
                       if w not in self._last_seen and w not in self._left
                       and w not in self._steps_pushed]
            if missing:
                return (f"Worker {missing[0]} never connected: no heartbeat "
                        f"{now - first:.0f} s after the first worker's (limit "
                        f"{self.startup_timeout_s:g} s). The job cannot go on.")
        return None
