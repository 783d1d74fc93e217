"""Clipping norms over partitions on several PS tasks, agreed through PS task 0.

``global_clipnorm`` takes one norm over every partition, ``clipnorm`` one per
variable; a norm whose partitions are on several PS tasks (a shared group,
``clipping.shared_groups``) needs every task's sum of squares. Each task that
owns partitions of shared groups adds its own (``clipping.NormHold``) and, once
it has all of them for a step, sends one float64 per shared group to PS task 0's
``ShareNorm``: a gather round per step among those tasks (``gather.Gatherer``,
as the workers' rounds). Task 0 answers every sender with all the shares once
the last has arrived; each adds them in task order, so every task computes the
same norms to the bit and scales its sums by Keras' factors.

Only those partitions' applies wait for the answer: pushes of the next step,
pulls of partitions already applied and the sums go on. The call runs on a
thread of its own (one step at a time: step k + 1's sums cannot complete
before step k is applied, since its pushes need step k's parameters).

PS task 0's address is the one the workers dial (``RegisterRequest.ps0_address``);
the tasks reach it with the job's token and, with TLS, the CA of
``PROPHET_TF_TLS_CA`` or else the PS's own certificate (one certificate for
all PS tasks, as the launcher's).

A share that gets no answer: the wait is renewed with a warning every worker
timeout while the job lives (another PS task may be slower); task 0
unreachable for that long, or the job failed, fails the job here too,
naming the step.
"""
from __future__ import annotations

import logging
import queue
import struct
import threading
import time
from typing import Callable

import grpc
import numpy as np

from prophet_tf.ps import accumulation, clipping, gather, security
from prophet_tf.ps.errors import invalid, precondition
from prophet_tf.ps.protocol import SERVICE_NAME, channel_options
from prophet_tf.ps.v1 import ps_pb2

__all__ = ["NormRPCs", "NormSharing", "encode", "decode_totals"]

logger = logging.getLogger(__name__)


def encode(squared) -> bytes:
    """A task's share: its sums of squares, one float64 per shared group (little-endian)."""
    return np.asarray(squared, "<f8").tobytes()


def decode_totals(payloads, groups: int) -> list[float]:
    """Every task's shares added in task order (float64), one total per shared group."""
    totals = np.zeros(groups, np.float64)
    for payload in payloads:
        if len(payload) != 8 * groups:
            raise ValueError(f"A norm share is {groups} float64 ({8 * groups} bytes). "
                             f"Received: {len(payload)} bytes")
        totals += np.frombuffer(payload, "<f8")
    return totals.tolist()


class NormSharing:
    """A PS task's side of the agreement: its share of each step to task 0, the total back.

    Args:
        address: PS task 0's ``host:port``.
        sender: this task's position among the PS tasks that own partitions.
        client_security: how to reach task 0 (token, TLS).
        timeout_s: one call's deadline (the worker timeout).
        failed: the job's failure, or None while it lives.
        fail: fails the job with a message (the servicer's).
    """

    def __init__(self, address: str, sender: int, client_security: security.ClientSecurity,
                 timeout_s: float, failed: Callable[[], str | None],
                 fail: Callable[[str], None]):
        self.address, self.sender = address, sender
        self._timeout = timeout_s
        self._failed, self._fail = failed, fail
        self._channel = security.create_channel(address, channel_options(),
                                                security=client_security)
        self._call = self._channel.unary_unary(
            f"/{SERVICE_NAME}/ShareNorm",
            request_serializer=ps_pb2.GatherRequest.SerializeToString,
            response_deserializer=ps_pb2.GatherResponse.FromString)
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"prophet-tf-norm-share-{sender}")
        self._thread.start()

    def share(self, step: int, squared: list, then: Callable[[list], None]) -> None:
        """Sends this task's ``squared`` of ``step`` (one per shared group); calls
        ``then(totals)`` on the sharing thread once every task's share is in."""
        self._queue.put((step, squared, then))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=self._timeout)
        self._channel.close()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            step, squared, then = item
            total = self._agree(step, squared)
            if total is None:
                return  # The job failed: nothing more is applied.
            then(total)

    def _agree(self, step: int, squared: list) -> list | None:
        request = ps_pb2.GatherRequest(worker_id=self.sender, round=step,
                                       payload=encode(squared))
        unreachable_since = None
        while self._failed() is None:
            try:
                return decode_totals(self._call(request, timeout=self._timeout).payloads,
                                     len(squared))
            except grpc.RpcError as e:
                code = e.code()
                if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    logger.warning("Still waiting after %.0f s for the other PS tasks' "
                                   "gradient norms of step %d at PS task 0, %s",
                                   self._timeout, step, self.address)
                    continue
                if code == grpc.StatusCode.UNAVAILABLE:
                    now = time.monotonic()
                    unreachable_since = unreachable_since or now
                    if now - unreachable_since < self._timeout:
                        time.sleep(min(1.0, self._timeout / 10))
                        continue
                if self._failed() is None:
                    self._fail(f"The PS tasks could not agree on the gradient norms of step "
                               f"{step} (clipping) through PS task 0 at "
                               f"{self.address}: {code.name}: {e.details()}")
                return None
        return None


class NormRPCs:
    """The servicer's side: the clipping hold installed with a model, and PS task 0's
    ``ShareNorm`` (a mixin of the servicer; its state and locks)."""

    def _init_norms(self, peer_security: security.ClientSecurity | None) -> None:
        self._norm_hold: clipping.NormHold | None = None
        self._peer_security = peer_security
        self._norm_sharing: NormSharing | None = None  # the agreement: sending,
        self._norm_rounds: gather.Gatherer | None = None  # and on task 0 answering
        self._norm_groups = 0  # shared groups: the float64 of each share

    def _install_norm_hold(self, model) -> None:
        """The clipping hold; with groups over several PS tasks, the agreement."""
        per_variable = model.clipnorm is not None
        group = (lambda p: p.key) if per_variable else (lambda p: 0)  # noqa: E731
        shared, peers = model.norm_groups, model.norm_peers
        if shared and self.ps_index == 0:
            self._norm_groups = len(shared)
            self._norm_rounds = gather.Gatherer(
                len(peers), lambda _missing: (self._failure, True) if self._failure else None,
                what="norms of step", same_calls="every PS task owning partitions of a "
                "shared norm sends one share per step")
        counts: dict = {}
        for part in model.parts.values():
            counts[group(part.plan)] = counts.get(group(part.plan), 0) + 1
        if not counts:
            return
        clip = model.clipnorm if per_variable else model.global_clipnorm
        optimizer = model.optimizer
        steps = getattr(optimizer, "gradient_accumulation_steps", None) or 0
        accumulating = dict(accumulation_steps=steps, accumulated=lambda part: (
            accumulation.accumulated(optimizer, part))) if steps else {}
        mine = shared if self.ps_index in peers else ()
        if not mine:
            self._norm_hold = clipping.NormHold(clip, per_variable, counts, **accumulating)
            return
        peer_security = (security.client_security() if self._peer_security is None
                         else self._peer_security)
        self._norm_sharing = NormSharing(
            model.ps0_address, peers.index(self.ps_index), peer_security,
            self.worker_timeout_s, lambda: self._failure, self._fail_job)
        self._norm_hold = clipping.NormHold(
            clip, per_variable, counts, mine, share=self._norm_sharing.share,
            release=lambda ready: [self._applier.submit(*r) for r in ready], **accumulating)

    def ShareNorm(self, request, context):
        return self._answer(lambda r: self._share_norm(r, context), "ShareNorm", request,
                            context)

    def _share_norm(self, request, context):
        with self._lock:
            rounds, groups = self._norm_rounds, self._norm_groups
        if rounds is None:
            raise precondition(
                "ShareNorm is for PS task 0 of a model whose clipping norms span several PS "
                f"tasks; this is PS task {self.ps_index} with "
                f"{'no model' if self._model is None else 'another model'}. Received: "
                f"round={request.round} from sender {request.worker_id}")
        if len(request.payload) != 8 * groups:
            raise invalid(f"A norm share is {groups} float64 ({8 * groups} bytes). Received: "
                          f"{len(request.payload)} bytes from sender {request.worker_id}")
        return ps_pb2.GatherResponse(payloads=rounds.gather(request, context))
