"""Bandwidth shaping inside the transport: the bench's fallback without namespaces.

Part of the transport (the worker's PS clients apply it), so the training path
never imports the bench.

With ``PROPHET_TF_SHAPE_MBIT=X`` set, every :class:`prophet_tf.ps.client.PSClient`
paces its pushes and its pulled bytes through two token buckets of X Mbit/s
(one per direction, per PS connection): a push waits until its bytes are
paid for before it is sent; a pulled chunk is paid for as it arrives, so
the next one is read later. This limits each worker's own traffic only; W
workers sharing one PS link, which network namespaces emulate, are not.
``prophet-tf bench`` uses it, and says so, only when it cannot create
namespaces.
"""
from __future__ import annotations

import os
import threading
import time

from prophet_tf import environment

__all__ = ["SHAPE_ENV", "TokenBucket", "from_env"]

SHAPE_ENV = environment.SHAPE_MBIT


class TokenBucket:
    """A rate limit of ``rate_bytes_per_s`` with a burst of ``burst_bytes``.

    Thread-safe: :meth:`consume` reserves its bytes at once, so concurrent
    callers queue behind each other like packets on one wire.
    """

    def __init__(self, rate_bytes_per_s: float, burst_bytes: float = 64 * 1024):
        if not rate_bytes_per_s > 0:
            raise ValueError(f"rate must be positive. Received: rate_bytes_per_s="
                             f"{rate_bytes_per_s!r}")
        self.rate = float(rate_bytes_per_s)
        self.burst = float(burst_bytes)
        self._lock = threading.Lock()
        self._free_at = time.monotonic()  # when the wire is free again

    def delay(self, nbytes: int) -> float:
        """Reserves ``nbytes``; returns the seconds to wait before they may go."""
        with self._lock:
            now = time.monotonic()
            start = max(now - self.burst / self.rate, self._free_at)
            self._free_at = start + nbytes / self.rate
            return max(0.0, self._free_at - now)

    def consume(self, nbytes: int) -> None:
        """Blocks until ``nbytes`` fit the rate."""
        wait = self.delay(nbytes)
        if wait > 0:
            time.sleep(wait)


def from_env() -> tuple[TokenBucket, TokenBucket] | None:
    """(push bucket, pull bucket) from ``PROPHET_TF_SHAPE_MBIT``, or None when unset.

    Raises:
      ValueError: the variable is set but not a positive number.
    """
    text = os.environ.get(SHAPE_ENV, "").strip()
    if not text:
        return None
    try:
        mbit = float(text)
        if not mbit > 0:
            raise ValueError
    except ValueError:
        raise ValueError(f"{SHAPE_ENV} must be a positive number of Mbit/s. "
                         f"Received: {SHAPE_ENV}={text!r}") from None
    rate = mbit * 1e6 / 8
    return TokenBucket(rate), TokenBucket(rate)
