"""Answers first: a worker that is ahead does not push over its PS's answers.

With a PS task on a worker's host (the colocated layout), the host's uplink
carries both the worker's pushes to the other hosts' PS tasks and its PS's
answers (pulled parameters) to the other hosts' workers. A worker that has
all of version s (its own PS answered it over loopback, the others over the
network) starts step s and pushes its gradients, while the workers on other
hosts may still wait for this host's PS to send them version s. Those
pushes cannot be used before every worker has pushed step s, which none can
do before it has version s; but on the shared uplink they take the answers'
bandwidth, so the waiting workers start later still, and the one ahead is
ahead again next step (measured in the README, "Four workers out of phase").

So before pushing gradients of step s to a PS on another host, the sender
asks the PS tasks on its own host (``Owed``, over loopback) whether they
still owe version s, or an older one, to workers on other hosts, and waits
until they do not. Safe: what they owe depends on the other workers' pushes
of step s-1, never on this worker's pushes of step s. Nothing waits when no
PS shares the worker's host, or no worker is on another host (a localhost
cluster).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Sequence

from prophet_tf import cluster as cluster_lib

__all__ = ["AnswersFirst"]

logger = logging.getLogger(__name__)


class AnswersFirst:
    """Holds a worker's pushes to other hosts while its host's PS tasks owe answers.

    Args:
      config: the cluster; this task is a worker.
      clients: one PS client per PS task (``PSClient.owed``).
      stop: set when the engine stops; a wait ends then.
      max_wait_s: the longest one step's pushes wait; after it they go (a
        PS that does not answer ``Owed`` must not stop training).
    """

    #: Seconds between two questions to the local PS tasks while they owe.
    POLL_S = 0.005

    def __init__(self, config: cluster_lib.ClusterConfig, clients: Sequence,
                 stop: threading.Event, max_wait_s: float):
        host_of = cluster_lib.address_host
        host = host_of(config.workers[config.task_index])
        self.local_ps = cluster_lib.local_ps(config)
        self.other_workers = [w for w, a in enumerate(config.workers) if host_of(a) != host]
        self._clients = [clients[i] for i in self.local_ps]
        self._stop = stop
        self._max_wait_s = float(max_wait_s)
        self._lock = threading.Lock()  # One sender asks; the others wait for its answer.
        self._cleared = -1  # pushes of steps up to this one go without asking
        self.waited_s = 0.0  # total, for logs and tests

    @property
    def active(self) -> bool:
        return bool(self._clients) and bool(self.other_workers)

    def applies_to(self, ps_index: int) -> bool:
        """Whether pushes to ``ps_index`` wait (it is on another host)."""
        return self.active and ps_index not in self.local_ps

    def wait(self, step: int) -> None:
        """Returns once the local PS tasks owe no version <= ``step`` to
        workers on other hosts (or after ``max_wait_s``)."""
        if step <= self._cleared:
            return
        with self._lock:
            if step <= self._cleared:
                return
            start = time.monotonic()
            while not self._stop.is_set():
                try:
                    owed = sum(c.owed(step, self.other_workers, timeout=self._max_wait_s)
                               for c in self._clients)
                except Exception as e:  # noqa: BLE001 - a PS that cannot tell: push.
                    logger.warning("answers first: the local PS did not say what it owes "
                                   "(%s); pushing without waiting from now on", e)
                    self._clients = []
                    break
                if owed == 0:
                    break
                if time.monotonic() - start > self._max_wait_s:
                    logger.warning("answers first: the local PS still owes %d partition(s) "
                                   "of step %d after %.0f s; pushing", owed, step,
                                   self._max_wait_s)
                    break
                time.sleep(self.POLL_S)
            self.waited_s += time.monotonic() - start
            self._cleared = step
