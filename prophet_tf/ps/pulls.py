"""Pull and Owed, a mixin of the servicer.

A Pull sends each partition it names the moment that partition reaches the
version asked for (of those ready, the first named), and in the same message
the next ones ready while they add at most ``protocol.PULL_PACK_BYTES``. ``Owed`` tells how many
partitions some workers' pulls still wait for: a worker on this PS's host
holds its pushes to other hosts meanwhile (``prophet_tf/engine/answers_first.py``).

They use the servicer's state and locks (see ``servicer.py``): ``_pulls``
(worker -> pulls in progress) and ``_unsent`` (pull -> [worker, min_version,
partitions not yet sent]) change under its state lock.
"""
from __future__ import annotations

from typing import Iterator

import grpc

from prophet_tf.ps import protocol, registration
from prophet_tf.ps.errors import RpcError, check_sender, invalid, precondition
from prophet_tf.ps.v1 import ps_pb2

__all__ = ["PullRPCs", "MAX_PULLS_PER_WORKER"]

_PULL_POLL_SECONDS = 1.0
# Pulls one worker may have waiting at once (its engine needs one per PS). With
# W workers that is 4W threads of the server pool of 16 + 8W (server.py).
MAX_PULLS_PER_WORKER = 4


class PullRPCs:
    """``Pull`` and ``Owed`` of the servicer."""

    def Pull(self, request, context) -> Iterator[bytes]:
        """Yields serialized ``ParameterChunks`` messages (see server.py).

        A waiting pull holds one of the server's threads, so each worker may
        have at most MAX_PULLS_PER_WORKER in progress: no client can tie up
        the thread pool with pulls of versions that never come.
        """
        try:
            parts = self._pull_targets(request)
            self._begin_pull(request.worker_id)
        except RpcError as e:
            self._rejections.log("Pull", request, e)
            context.abort(e.code, e.message)
        pull = object()
        try:
            left = list(parts)  # in the order asked: the most urgent first
            unsent = [request.worker_id, request.min_version, len(left)]
            with self._lock:
                self._unsent[pull] = unsent
            while left:
                try:
                    with self._lock:
                        got = self._next_message_locked(left, request.min_version, context)
                except RpcError as e:
                    self._rejections.log("Pull", request, e)
                    context.abort(e.code, e.message)
                if got is None:  # the client went away
                    return
                yield b"".join(data for _, data, _ in got) if len(got) > 1 else got[0][1]
                if self._trace:
                    for part, _, version in got:
                        self._trace.record("answered", part, version, request.worker_id)
                # gRPC asks for the next answer once it has taken this one.
                with self._lock:
                    unsent[2] = len(left)
        finally:
            with self._lock:
                self._pulls[request.worker_id] -= 1
                self._unsent.pop(pull, None)

    def Owed(self, request, context):
        return self._answer(self._owed, "Owed", request, context)

    def _begin_pull(self, worker_id: int) -> None:
        with self._lock:
            if self._pulls[worker_id] >= MAX_PULLS_PER_WORKER:
                raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"worker {worker_id} already has {MAX_PULLS_PER_WORKER} pulls "
                               "in progress on this PS (the limit; a worker needs one). "
                               f"Received: a Pull from worker_id={worker_id}")
            self._pulls[worker_id] += 1

    def _pull_targets(self, request):
        check_sender(request, "a PullRequest", self.num_workers)
        if request.min_version < 0:
            raise invalid(f"min_version must be >= 0. Received: min_version={request.min_version}")
        with self._lock:
            if self._model is None:
                raise precondition("No model is registered on this PS yet; call Register "
                                   f"first. Received: Pull from worker_id={request.worker_id}")
            return registration.pulled_parts(self._model, request.items, self.ps_index)

    def _next_applied(self, left: list, min_version: int, context):
        """Removes from ``left`` the first partition (in ``left``'s order)
        whose version is ``min_version`` or later, waiting until one is, and
        returns it with its answer and version: a pull gets each partition
        the moment it is applied, the most urgent first among those ready.
        None when the client went away."""
        with self._lock:
            i = self._wait_applied_locked(left, min_version, context)
            if i is None:
                return None
            part = left.pop(i)
            return part, part.encoded, part.version

    def _next_message_locked(self, left: list, min_version: int, context) -> list | None:
        """A Pull message's answers, removed from ``left``: the first partition
        applied (as :meth:`_next_applied`) and the next applied ones after it,
        in order, while they add at most PULL_PACK_BYTES (the first that does
        not fit ends the pack, so none goes before a more urgent one that is
        ready). None when the client went away."""
        i = self._wait_applied_locked(left, min_version, context)
        if i is None:
            return None
        first = left.pop(i)
        got, added = [(first, first.encoded, first.version)], 0
        while i < len(left):  # those before i were not applied: no need to look again
            part = left[i]
            if part.version < min_version:
                i += 1
                continue
            added += len(part.encoded)
            if added > protocol.PULL_PACK_BYTES:
                break
            del left[i]
            got.append((part, part.encoded, part.version))
        return got

    def _wait_applied_locked(self, left: list, min_version: int, context) -> int | None:
        """The index in ``left`` of the first partition whose version is
        ``min_version`` or later, waiting (on ``_published``, the lock held)
        until one is; None when the client went away."""
        while True:
            for i, part in enumerate(left):
                if part.version >= min_version:
                    return i
            if self._failure:
                raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, self._failure)
            failed = next((part for part in left if part.failed), None)
            if failed is not None:
                raise RpcError(grpc.StatusCode.INTERNAL, failed.failed)
            gone = self._liveness.departed_before_locked(min_version)
            if gone is not None:
                wid, steps = gone
                raise RpcError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"Version {min_version} of {left[0].name} can never be "
                               f"complete: worker {wid} left the job after pushing "
                               f"{steps} steps. Received: min_version={min_version}")
            remaining = context.time_remaining()
            if remaining is not None and remaining <= 0:
                raise RpcError(grpc.StatusCode.DEADLINE_EXCEEDED,
                               f"{left[0].name} is at version {left[0].version}, below the "
                               f"requested one when the deadline expired. Received: "
                               f"min_version={min_version}")
            if not context.is_active():
                return None
            self._published.wait(_PULL_POLL_SECONDS if remaining is None
                                 else min(remaining, _PULL_POLL_SECONDS))

    def _owed(self, request):
        check_sender(request, "an OwedRequest", self.num_workers)
        if request.max_version < 0:
            raise invalid(f"max_version must be >= 0. Received: max_version={request.max_version}")
        workers = set(request.workers)
        bad = sorted(w for w in workers if not 0 <= w < self.num_workers)
        if bad:
            raise invalid(f"workers must be in [0, {self.num_workers}). Received: workers={bad}")
        with self._lock:
            owed = sum(n for worker, version, n in self._unsent.values()
                       if worker in workers and version <= request.max_version)
        return ps_pb2.OwedResponse(partitions=owed)
