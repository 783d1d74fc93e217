"""Gather: rounds of an all-gather among the workers, through PS task 0.

The workers use it for what Keras reports (whole-data metrics and
predictions, ``prophet_tf.whole_data``): in round r every worker sends its
bytes, and each gets back all W payloads in worker order once the last one
has arrived. The PS never reads the payloads.

Every worker runs the same rounds in the same order, and waits for each
round before it starts the next, so only a few rounds are ever open; a
client that opens more than :data:`MAX_OPEN_ROUNDS` is refused.

A complete round is kept until no worker's latest call names it, not until
each worker's call has fetched it: a worker whose call ended at its deadline
retries the round, and the PS may still count the first call's fetch (its
deadline is later than the client's, or its answer was in flight). The last
round of a job stays until the PS exits.
"""
from __future__ import annotations

import threading
from typing import Callable

import grpc

from prophet_tf.ps.errors import RpcError, check_sender, invalid

__all__ = ["Gatherer", "MAX_OPEN_ROUNDS"]

MAX_OPEN_ROUNDS = 16
_POLL_SECONDS = 1.0


class _Round:
    def __init__(self, num_workers: int):
        self.payloads: list[bytes | None] = [None] * num_workers

    def complete(self) -> bool:
        return all(p is not None for p in self.payloads)


class Gatherer:
    """The open rounds of one PS task.

    Args:
        num_workers: W.
        failure: ``missing workers`` -> why a round missing them can never
            complete: ``(the job's failure, True)``, ``(a worker's
            departure, False)``, or None.
        what: what a round is, in messages ("gather round", "verdict of step").
        same_calls: what every worker must do for the rounds to match, in messages.
    """

    def __init__(self, num_workers: int, failure: Callable[[list], tuple[str, bool] | None],
                 what: str = "gather round",
                 same_calls: str = "every worker must run the same evaluate, predict and "
                                   "fit calls"):
        self.num_workers = num_workers
        self._failure = failure
        self._what, self._same_calls = what, same_calls
        self._cond = threading.Condition()
        self._rounds: dict[int, _Round] = {}
        self._latest: list[int | None] = [None] * num_workers  # each worker's last round

    def wake(self) -> None:
        """Wakes the waiting calls (the job failed)."""
        with self._cond:
            self._cond.notify_all()

    def gather(self, request, context) -> list[bytes]:
        """Adds the request's payload to its round and returns the round's W payloads.

        Raises:
            RpcError: a bad worker id or round, a different payload sent
                twice, too many open rounds, the job failed, or the call's
                deadline passed first.
        """
        check_sender(request, "a GatherRequest", self.num_workers)
        worker_id, round_id, payload = request.worker_id, request.round, request.payload
        if round_id < 0:
            raise invalid(f"round must be >= 0. Received: round={round_id}")
        with self._cond:
            entry = self._rounds.get(round_id)
            if entry is None:
                if len(self._rounds) >= MAX_OPEN_ROUNDS:
                    raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"{len(self._rounds)} rounds ({self._what}) are open, "
                                   f"the most allowed. Received: round={round_id}")
                entry = self._rounds[round_id] = _Round(self.num_workers)
            previous = entry.payloads[worker_id]
            if previous is not None and previous != payload:
                raise invalid(f"Worker {worker_id} sent another payload for {self._what} "
                              f"{round_id}: {self._same_calls}. Received: round={round_id}")
            entry.payloads[worker_id] = payload
            self._moved_on_locked(worker_id, round_id)
            self._cond.notify_all()
        while True:
            with self._cond:
                missing = [i for i, p in enumerate(entry.payloads) if p is None]
                if not missing:
                    return list(entry.payloads)
            # Outside this lock: the check takes the servicer's, which holds it
            # while it wakes the waiting calls.
            failure = self._failure(missing)
            if failure:
                message, of_the_job = failure
                raise RpcError(grpc.StatusCode.ABORTED, message if of_the_job else (
                    f"{self._what.capitalize()} {round_id} can never be complete: {message} "
                    f"({self._same_calls})"))
            with self._cond:
                if entry.complete():
                    continue
                remaining = context.time_remaining()
                if remaining is not None and remaining <= 0:
                    raise RpcError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                   f"{self._what.capitalize()} {round_id}: no payload from workers "
                                   f"{missing} before the deadline")
                if not context.is_active():
                    raise RpcError(grpc.StatusCode.CANCELLED, "the client went away")
                self._cond.wait(_POLL_SECONDS if remaining is None
                                else min(remaining, _POLL_SECONDS))

    def _moved_on_locked(self, worker_id: int, round_id: int) -> None:
        """Worker ``worker_id`` called for ``round_id``: it is done with its
        previous round, which goes once complete and no worker's latest."""
        previous, self._latest[worker_id] = self._latest[worker_id], round_id
        entry = self._rounds.get(previous)
        if (previous != round_id and entry is not None and entry.complete()
                and previous not in self._latest):
            del self._rounds[previous]
