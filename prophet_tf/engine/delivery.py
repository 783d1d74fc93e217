"""Pulled partitions in, staged parameters out: checks and assembly.

A pulled chunk is staged only when it is the partition the engine asked for,
at the version asked for or later, with that partition's dtype and size; any
other chunk fails with a message naming both, and nothing of it is staged. A
parameter is published (``deliver_commit``) once all its partitions of a
version are in; partitions of one parameter may come from several PS tasks
and are copied in parallel.
"""
from __future__ import annotations

import threading

from prophet_tf import codec
from prophet_tf.engine.dispatch import Dispatch
from prophet_tf.ps import sharding

__all__ = ["Assembler", "Expected"]


class Expected:
    """The partitions one pull still waits for; they may arrive in any order.

    The PS sends each partition of a version the moment it is applied, so
    the order of a pull's answers is not the order asked. Each answer must
    still be a partition asked for and not yet received.

    Args:
      ps_index: the PS asked (for messages).
      partitions: the partitions asked for, in the order asked (priority).
    """

    def __init__(self, ps_index: int, partitions):
        self.ps_index = ps_index
        self._left = {(p.key, p.partition): p for p in partitions}
        self._order = list(partitions)

    def __len__(self) -> int:
        return len(self._left)

    def left(self) -> list[sharding.Partition]:
        """What is still expected, in the order asked (for a new request)."""
        return [p for p in self._order if (p.key, p.partition) in self._left]

    def take(self, chunk) -> sharding.Partition:
        """The partition ``chunk`` answers, no longer expected.

        Raises:
          RuntimeError: a partition not asked for, or one already received;
            nothing changes then.
        """
        partition = self._left.pop((chunk.key, chunk.partition), None)
        if partition is None:
            raise RuntimeError(
                f"PS {self.ps_index} sent a partition not asked for, or twice. Received: key "
                f"{chunk.key} partition {chunk.partition} version {chunk.version}; still "
                f"expected {len(self._left)} partition(s)")
        return partition


class Assembler:
    """Stages pulled partitions through the op runtime; thread-safe.

    Args:
      runtime: the op runtime (``prophet_tf._native`` or an object with its
        ``deliver_begin``, ``deliver_write`` and ``deliver_commit``).
      dispatch: the worker's key map and partitions.
    """

    def __init__(self, runtime, dispatch: Dispatch):
        self._runtime = runtime
        self._dispatch = dispatch
        self._lock = threading.Lock()
        self._remaining: dict[tuple[int, int], list[int]] = {}  # (key, version) -> [parts left]

    @property
    def open_versions(self) -> int:
        """Parameters with some but not all partitions staged."""
        with self._lock:
            return len(self._remaining)

    def deliver(self, chunk, expected: sharding.Partition, version: int) -> None:
        """Checks a pulled chunk against the partition asked for, then stages it.

        Raises:
          RuntimeError: another partition, an older version, or another size
            or dtype than asked for; the message names both.
        """
        key = expected.key
        if (chunk.key, chunk.partition) != (key, expected.partition) or chunk.version < version:
            raise RuntimeError(
                f"PS {expected.ps_index} sent another partition than the one asked for: "
                f"expected key {key} partition {expected.partition} at version >= {version}. "
                f"Received: key {chunk.key} partition {chunk.partition} version {chunk.version}")
        data = chunk.array
        spec = self._dispatch.specs[key]
        if data.nbytes != expected.nbytes or codec.dtype_name(data.dtype) != spec.dtype:
            raise RuntimeError(
                f"PS {expected.ps_index} sent key {key} partition {expected.partition} with "
                f"{data.nbytes} bytes of {codec.dtype_name(data.dtype)}; the partition holds "
                f"{expected.nbytes} bytes of {spec.dtype}")
        native_key = self._dispatch.native_keys[key]
        with self._lock:
            remaining = self._remaining.get((key, version))
            if remaining is None:
                self._runtime.deliver_begin(native_key, version)
                remaining = self._remaining[key, version] = [
                    len(self._dispatch.partitions_of[key])]
        # Bounds-checked by the runtime; disjoint partitions copy in parallel.
        self._runtime.deliver_write(native_key, version, self._dispatch.byte_offset(expected),
                                    data)
        with self._lock:
            remaining[0] -= 1
            done = remaining[0] == 0
            if done:
                del self._remaining[key, version]
        if done:
            self._runtime.deliver_commit(native_key, version)
