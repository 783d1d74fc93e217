"""Waiting for a PS task to report SERVING on the standard gRPC health service.

One wait for the launcher, the worker's client and ``prophet-tf doctor``. It
dials with the token and TLS settings of :mod:`prophet_tf.ps.security`, and
imports neither TensorFlow nor the PS's generated code, so the launcher stays
light.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prophet_tf.ps import security as security_lib

__all__ = ["NotServingError", "HealthCheckRefused", "wait_serving"]

logger = logging.getLogger(__name__)

# Answers that may change by themselves: the task is starting, or far away.
_RETRY = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# The health channel reconnects at least this often while the task is not up
# (gRPC's default backoff grows to minutes), so a late task is seen promptly.
_CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100),
                    ("grpc.min_reconnect_backoff_ms", 100),
                    ("grpc.max_reconnect_backoff_ms", 1000)]


class NotServingError(TimeoutError):
    """The task did not report SERVING in time.

    Attributes:
        address: the address dialed.
        last_answer: the last status or error seen (``"no answer"`` if none).
        last_code: the last ``grpc.StatusCode`` of an error, or None.
    """

    def __init__(self, address: str, timeout_s: float, last_answer: str,
                 last_code: grpc.StatusCode | None):
        super().__init__(f"PS at {address} was not SERVING within {timeout_s:g} s. "
                         f"Last answer: {last_answer}")
        self.address = address
        self.last_answer = last_answer
        self.last_code = last_code


class HealthCheckRefused(RuntimeError):
    """The task answered with an error that waiting will not fix (UNAUTHENTICATED...).

    Attributes:
        address: the address dialed.
        code: the ``grpc.StatusCode``.
        details: the server's message.
    """

    def __init__(self, address: str, code: grpc.StatusCode, details: str):
        hint = ""
        if code == grpc.StatusCode.UNAUTHENTICATED:
            hint = (f" Give this process the PS's token ({security_lib.TOKEN_ENV} or "
                    f"{security_lib.TOKEN_FILE_ENV}).")
        super().__init__(f"PS at {address} refused the health check: {code.name}: "
                         f"{details}.{hint}")
        self.address = address
        self.code = code
        self.details = details


def wait_serving(address: str, timeout_s: float, *, alive: Callable[[], None] | None = None,
                 service: str = "", security: security_lib.ClientSecurity | None = None,
                 attempt_timeout_s: float = 2.0, poll_s: float = 0.05) -> None:
    """Blocks until the task at ``address`` reports SERVING for ``service``.

    Args:
        address: ``host:port`` of the task.
        timeout_s: overall limit.
        alive: called before every attempt; whatever it raises (the task
            died, the caller was interrupted) ends the wait and propagates.
        service: the health service name (``""``: the whole server).
        security: token and TLS; default from the environment
            (:func:`prophet_tf.ps.security.client_security`).
        attempt_timeout_s: deadline of one health check.
        poll_s: pause between attempts.

    Raises:
        NotServingError: (a TimeoutError) not SERVING within ``timeout_s``;
            names the address and the last answer.
        HealthCheckRefused: the task answered with an error other than
            UNAVAILABLE or DEADLINE_EXCEEDED, e.g. UNAUTHENTICATED.
        prophet_tf.ps.security.SecurityError: the token/TLS settings are unusable.
    """
    deadline = time.monotonic() + timeout_s
    last, last_code = "no answer", None
    request = health_pb2.HealthCheckRequest(service=service)
    with security_lib.create_channel(address, _CHANNEL_OPTIONS, security=security) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if alive is not None:
                alive()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise NotServingError(address, timeout_s, last, last_code)
            try:
                # Fail fast, not wait_for_ready: a refused connection or a failed
                # TLS handshake shows up in the last answer instead of a bare deadline.
                reply = stub.Check(request, timeout=min(remaining, attempt_timeout_s))
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
                last_code = None
            except grpc.RpcError as e:
                if e.code() not in _RETRY:
                    raise HealthCheckRefused(address, e.code(), e.details()) from None
                last, last_code = f"{e.code().name}: {e.details()}", e.code()
            logger.debug("PS at %s not SERVING yet: %s", address, last)
            time.sleep(max(0.0, min(poll_s, deadline - time.monotonic())))
