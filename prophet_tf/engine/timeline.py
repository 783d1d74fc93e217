"""Chrome-trace timelines of a worker: what was computed and what was sent when.

Open the JSON in Perfetto (ui.perfetto.dev) or chrome://tracing. One process
per worker, one track per kind of activity:

- forward: each parameter read (AwaitParam) from the moment it waited to the
  moment its value was there, i.e. when that layer's forward could start;
- backward: each gradient's ready time;
- push to PS i / pull from PS i: each transfer with its keys, bytes, start, end;
- plan: each schedule the scheduler adopted.

Enable with `Strategy(timeline=path)` or `PROPHET_TF_TIMELINE=path`. A path
ending in ".json" may contain "{worker}"; otherwise it names a directory that
gets one `worker-<i>.json` per worker.
"""
from __future__ import annotations

import dataclasses
import enum
import json
import os
import threading

from prophet_tf import environment

TIMELINE_ENV = environment.TIMELINE

# Track ids within a worker's process.
_FORWARD, _BACKWARD, _PLAN = 1, 2, 3
_PUSH_BASE, _PULL_BASE = 100, 200



class StampKind(enum.IntEnum):
    """Kinds of the op runtime's stamp records: the one Python definition.

    Mirrors ``ProphetStampKind`` in ops/runtime.h (tests/unit/test_native.py
    compares the two through the built library). Values 0..15 are the
    runtime's; ``prophet_tf._native.stamp`` callers use kinds >= 16.
    """

    READY = 0        # a gradient is ready (ReadyStamp / PushGrad ran)
    AWAIT_BEGIN = 1  # AwaitParam started waiting
    AWAIT_END = 2    # AwaitParam completed: the layer's forward can start
    DELIVER = 3      # the engine committed a parameter value (the record's step: the version)


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One push or pull on one PS link."""

    direction: str  # "push" or "pull"
    ps_index: int
    keys: tuple[int, ...]  # op-library keys
    nbytes: int
    iteration: int  # training iteration of a push; version of a pull
    start_ns: int
    end_ns: int


def timeline_path(path: str, worker: int) -> str:
    """The file one worker writes, from the user's `path` (see module doc)."""
    if path.endswith(".json"):
        return path.replace("{worker}", str(worker)) if "{worker}" in path else \
            f"{path[:-len('.json')]}.worker{worker}.json"
    return os.path.join(path, f"worker-{worker}.json")


class Recorder:
    """Collects a worker's transfers and plans; thread-safe."""

    def __init__(self, worker: int, names: dict[int, str] | None = None):
        self.worker = worker
        self.names = dict(names or {})
        self._lock = threading.Lock()
        self._transfers: list[Transfer] = []
        self._plans: list[tuple[int, dict]] = []

    def transfer(self, transfer: Transfer) -> None:
        with self._lock:
            self._transfers.append(transfer)

    def plan(self, t_ns: int, plan: dict) -> None:
        with self._lock:
            self._plans.append((t_ns, plan))

    def trace(self, stamps) -> dict:
        """The Chrome-trace dict of these stamps plus what was recorded."""
        with self._lock:
            transfers, plans = list(self._transfers), list(self._plans)
        return build_trace(self.worker, stamps, transfers, plans, self.names)

    def write(self, path: str, stamps, dropped: int = 0) -> str:
        trace = self.trace(stamps)
        trace["metadata"]["stamps_dropped"] = int(dropped)
        target = timeline_path(path, self.worker)
        os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
        tmp = f"{target}.tmp"
        with open(tmp, "w") as f:
            json.dump(trace, f)
        os.replace(tmp, target)
        return target


def build_trace(worker: int, stamps, transfers: list[Transfer], plans: list[tuple[int, dict]],
                names: dict[int, str]) -> dict:
    """Builds the trace; times are microseconds on the CLOCK_MONOTONIC axis."""
    pid = worker
    events: list[dict] = [
        {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"worker {worker}"}},
        _thread_name(pid, _FORWARD, "forward (parameter reads)"),
        _thread_name(pid, _BACKWARD, "backward (gradients ready)"),
        _thread_name(pid, _PLAN, "scheduler plan"),
    ]

    def name_of(key: int) -> str:
        return names.get(key, f"key {key}")

    waiting: dict[tuple[int, int], int] = {}
    for record in sorted(stamps, key=lambda r: int(r["t_ns"])):
        key, step, t, kind = int(record["key"]), int(record["step"]), int(record["t_ns"]), \
            int(record["kind"])
        if kind == StampKind.READY:
            events.append({"ph": "i", "s": "t", "name": f"grad {name_of(key)}", "pid": pid,
                           "tid": _BACKWARD, "ts": t / 1e3, "cat": "backward",
                           "args": {"key": key, "step": step}})
        elif kind == StampKind.AWAIT_BEGIN:
            waiting.setdefault((key, step), t)
        elif kind == StampKind.AWAIT_END:
            begin = waiting.pop((key, step), t)
            events.append({"ph": "X", "name": f"read {name_of(key)}", "pid": pid,
                           "tid": _FORWARD, "ts": begin / 1e3, "dur": max(t - begin, 0) / 1e3,
                           "cat": "forward", "args": {"key": key, "step": step,
                                                      "forward_start_us": t / 1e3}})
    links = set()
    for tr in transfers:
        base = _PUSH_BASE if tr.direction == "push" else _PULL_BASE
        links.add((base + tr.ps_index, f"{tr.direction} {'to' if base == _PUSH_BASE else 'from'} "
                                       f"PS {tr.ps_index}"))
        events.append({"ph": "X", "name": f"{tr.direction} {len(tr.keys)} key(s)", "pid": pid,
                       "tid": base + tr.ps_index, "ts": tr.start_ns / 1e3,
                       "dur": max(tr.end_ns - tr.start_ns, 0) / 1e3, "cat": tr.direction,
                       "args": {"keys": [name_of(k) for k in tr.keys], "bytes": tr.nbytes,
                                ("step" if tr.direction == "push" else "version"): tr.iteration}})
    for tid, label in sorted(links):
        events.append(_thread_name(pid, tid, label))
    for t, plan in plans:
        events.append({"ph": "i", "s": "p", "name": "plan", "pid": pid, "tid": _PLAN,
                       "ts": t / 1e3, "cat": "plan", "args": plan})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "metadata": {"worker": worker, "clock": "CLOCK_MONOTONIC"}}


def _thread_name(pid: int, tid: int, name: str) -> dict:
    return {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}
