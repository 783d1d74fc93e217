"""How the PS rejects a request: :class:`RpcError` and a rate-limited log of them."""

from __future__ import annotations

import collections
import logging
import math
import threading
import time

import grpc

__all__ = ["RpcError", "check_sender", "invalid", "precondition", "short", "RejectionLog"]

# Rejections are logged as the servicer's: one logger for what the RPCs answered.
logger = logging.getLogger("prophet_tf.ps.servicer")

_MAX_ECHO_CHARS = 200  # of a received value quoted in an error message


class RpcError(Exception):
    """A request error: the RPC is aborted with ``code`` and ``message``."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> RpcError:
    return RpcError(grpc.StatusCode.INVALID_ARGUMENT, message)


def precondition(message: str) -> RpcError:
    return RpcError(grpc.StatusCode.FAILED_PRECONDITION, message)


def check_sender(request, expected: str, num_workers: int) -> None:
    """Rejects (INVALID_ARGUMENT) a request whose bytes did not parse as
    ``expected`` ("a PullRequest"; protocol.py marks it ``malformed``) or
    that names a worker_id outside [0, num_workers)."""
    if getattr(request, "malformed", None):
        raise invalid(f"The request is not {expected}. Received: {request.malformed}")
    if not 0 <= request.worker_id < num_workers:
        raise invalid(f"worker_id must be in [0, {num_workers}). "
                      f"Received: worker_id={request.worker_id}")


def short(value) -> str:
    """``repr(value)``, cut to a length that fits an error message (a long
    string or list is cut before its repr is built)."""
    if isinstance(value, (str, list)) and len(value) > _MAX_ECHO_CHARS:
        unit = "characters" if isinstance(value, str) else "items"
        return f"{repr(value[:_MAX_ECHO_CHARS])[:_MAX_ECHO_CHARS]}... ({len(value)} {unit})"
    text = repr(value)
    return text if len(text) <= _MAX_ECHO_CHARS else f"{text[:_MAX_ECHO_CHARS]}..."


class RejectionLog:
    """Logs rejected requests, at most one per RPC kind every INTERVAL_S.

    A client sending bad requests in a loop must not fill the disk or slow the
    PS with log lines; the count of those left out is logged with the next.
    """

    INTERVAL_S = 5.0

    def __init__(self):
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._skipped = collections.Counter()

    def log(self, rpc: str, request, error: RpcError) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(rpc, -math.inf) < self.INTERVAL_S:
                self._skipped[rpc] += 1
                return
            self._last[rpc] = now
            skipped = self._skipped.pop(rpc, 0)
        logger.info("%s from worker %s rejected: %s%s", rpc, getattr(request, "worker_id", "?"),
                    error.message,
                    f" ({skipped} more {rpc} rejections not logged)" if skipped else "")
