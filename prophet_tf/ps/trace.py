"""A PS task's own record of when its partitions moved: a Chrome trace.

A worker's timeline (``engine/timeline.py``) sees a push end when the PS's
reply arrives, and that reply can wait behind answers in the same
connection; only the PS knows when a partition's sum became complete. With
``prophet-tf ps --timeline PATH`` the PS records, per partition and step:

- ``complete``: the last worker's push of it arrived (the worker named);
- ``applied``: the optimizer's result was published as the next version;
- ``answered``: gRPC took that version's answer to a worker (the bytes may
  still sit in gRPC's and the socket's buffers).

Times are ``time.monotonic_ns()``, the clock of the workers' timelines, so
the files open side by side in Perfetto. The record grows with steps times
partitions: it is for bench and diagnosis runs, off by default, written
when the task exits.
"""
from __future__ import annotations

import json
import os
import threading
import time

KINDS = ("complete", "applied", "answered")
#: Trace process ids: one per PS task, apart from the workers' (their index).
PID_BASE = 1000

__all__ = ["KINDS", "PID_BASE", "PSTrace"]


class PSTrace:
    """Collects a PS task's partition events; thread-safe."""

    def __init__(self, ps_index: int):
        self.ps_index = ps_index
        self._lock = threading.Lock()
        self._events: list[tuple] = []  # (kind, name, key, partition, step, worker, t_ns)

    def record(self, kind: str, part, step: int, worker: int | None = None) -> None:
        """Notes that ``part`` (a ``registration.Part``) reached ``kind`` for
        ``step`` (a push's iteration, or the version applied or answered)."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}. Received: kind={kind!r}")
        t = time.monotonic_ns()
        with self._lock:
            self._events.append((kind, part.spec.name, part.plan.key, part.plan.partition,
                                 step, worker, t))

    def trace(self) -> dict:
        """The Chrome trace: one track per kind, an instant per event."""
        pid = PID_BASE + self.ps_index
        tids = {kind: i + 1 for i, kind in enumerate(KINDS)}
        events = [{"ph": "M", "name": "process_name", "pid": pid,
                   "args": {"name": f"ps {self.ps_index}"}}]
        events += [{"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                    "args": {"name": kind}} for kind, tid in tids.items()]
        with self._lock:
            recorded = list(self._events)
        for kind, name, key, partition, step, worker, t in recorded:
            args = {"key": key, "partition": partition,
                    ("step" if kind == "complete" else "version"): step}
            if worker is not None:
                args["worker"] = worker
            events.append({"ph": "i", "s": "t", "name": f"{kind} {name}", "pid": pid,
                           "tid": tids[kind], "ts": t / 1e3, "cat": kind, "args": args})
        return {"traceEvents": events, "displayTimeUnit": "ms",
                "metadata": {"ps": self.ps_index, "clock": "CLOCK_MONOTONIC"}}

    def write(self, path: str) -> None:
        """Writes the trace to ``path`` (atomically: a reader never sees half)."""
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(self.trace(), f)
        os.replace(tmp, path)
