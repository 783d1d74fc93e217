"""Answers that wait for a pusher on the PS's host (``Pushed``).

A worker and a PS task on one host share its uplink: the worker's pushes of
step s to the other hosts' PS tasks, and this PS's answers (parameters of
version s+1) to the other hosts' workers. The answers of version s+1 cannot
all be used before every worker has pushed all of step s, so while the
worker on this host still pushes step s, they only slow its pushes down:
the slowest host's pushes decide when the last sum, and so the last answer,
is complete. So once a worker on this host has said, with ``Pushed``, that
it pushes step by step, this PS sends version v to the workers it named only
after that worker has pushed all of step v-1 (the engine's other half,
``engine/answers_first.py``, holds its next pushes until those answers are
out: one host's link carries one exchange at a time, the older first).

Safe: a worker's pushes of step v-1 never wait for version v. A hold ends
when the pusher says it has pushed, leaves the job, or has kept a ready
answer waiting for ``limit_s`` (logged: a pusher that stopped saying so must
not stop the others).
"""
from __future__ import annotations

import dataclasses
import logging
import time

__all__ = ["AnswerHolds"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Pusher:
    workers: frozenset  # whose answers wait for this pusher
    step: int  # the last step it has pushed all of
    blocking_since: float | None = None  # when it first kept a ready answer waiting


class AnswerHolds:
    """Which pulls wait for a pusher on this host. Callers hold the servicer's lock.

    Args:
      limit_s: the longest a pusher may keep a ready answer waiting.
      clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, limit_s: float = 30.0, clock=time.monotonic):
        if not limit_s > 0:
            raise ValueError(f"limit_s must be > 0. Received: {limit_s!r}")
        self.limit_s = float(limit_s)
        self._clock = clock
        self._pushers: dict[int, _Pusher] = {}

    def pushed_locked(self, pusher: int, step: int, workers) -> bool:
        """Records that ``pusher`` has pushed all of ``step``; True when that
        may release answers (waiting pulls should look again)."""
        known = self._pushers.get(pusher)
        if known is not None and step <= known.step:
            return False  # an old or repeated notice
        self._pushers[pusher] = _Pusher(frozenset(workers), step)
        return True

    def forget_locked(self, pusher: int) -> None:
        """``pusher`` left the job: nothing waits for it any more."""
        self._pushers.pop(pusher, None)

    def held_locked(self, worker: int, version: int) -> bool:
        """Whether an answer of ``version`` that is ready for ``worker`` waits."""
        now = self._clock()
        for pusher_id, pusher in list(self._pushers.items()):
            if worker not in pusher.workers or pusher.step >= version - 1:
                continue
            if pusher.blocking_since is None:
                pusher.blocking_since = now
            elif now - pusher.blocking_since > self.limit_s:
                logger.warning("worker %d on this PS's host has not pushed step %d within "
                               "%.0f s of an answer of version %d being ready; its answers "
                               "no longer wait for its pushes", pusher_id, version - 1,
                               self.limit_s, version)
                del self._pushers[pusher_id]
                continue
            return True
        return False
