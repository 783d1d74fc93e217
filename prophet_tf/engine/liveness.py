"""A worker's liveness towards the PS tasks: heartbeats and RPC error text."""
from __future__ import annotations

import threading
import time
from typing import Callable

import grpc

__all__ = ["heartbeat", "rpc_message"]

# Heartbeat errors that may pass (a PS restarting its listener, a slow answer).
_TRANSIENT_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def heartbeat(client, ps_index: int, next_iteration: Callable[[], int],
              stop: threading.Event, interval_s: float, timeout_s: float) -> None:
    """Keeps this worker alive on one PS and learns there when the job failed.

    Pulls fail at once when a PS's connection breaks, but a worker that is
    computing has no pull waiting, and a PS host that vanishes breaks no
    connection: the heartbeat's deadline notices both.
    """
    silent_since = None
    while True:
        try:
            failure = client.heartbeat(next_iteration(), timeout=timeout_s / 2)
        except Exception as e:  # noqa: BLE001 - classified below
            code = getattr(e, "code", None)
            transient = callable(code) and code() in _TRANSIENT_CODES
            now = time.monotonic()
            silent_since = silent_since or now
            if stop.is_set():
                return
            if not transient or now - silent_since >= timeout_s:
                raise RuntimeError(
                    f"PS {ps_index} at {client.address} is unreachable (no heartbeat "
                    f"answer for {now - silent_since:.1f} s): {rpc_message(e)}") from e
        else:
            silent_since = None
            if failure:
                raise RuntimeError(f"PS {ps_index} at {client.address} reports that the "
                                   f"job failed: {failure}")
        if stop.wait(interval_s):
            return


def rpc_message(error: Exception) -> str:
    """A gRPC error as "CODE: details", any other error as its text."""
    code = getattr(error, "code", None)
    if callable(code):
        return f"{code().name}: {error.details()}"
    return str(error)
