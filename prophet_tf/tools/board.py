"""The launcher's board: each task's state, a line per change, a summary table.

:class:`Board` tracks each task's state (starting, healthy, training, done,
failed, stopped), prints one line per change (plain lines, fine in CI logs)
and a summary table at the end. Workers' steps and epochs come from their
status files (prophet_tf.progress).
"""
from __future__ import annotations

import dataclasses
import signal
import sys
import time
from typing import Callable, TextIO

__all__ = ["Board", "describe_exit"]


@dataclasses.dataclass
class _Row:
    name: str
    kind: str  # "ps" or "worker"
    state: str = "starting"
    detail: str = ""
    exit_code: int | None = None
    started: float = 0.0
    ended: float | None = None
    step: int | None = None
    epoch: int | None = None
    epochs: int | None = None
    shown_at: float = 0.0
    shown_step: int | None = None
    shown_epoch: int | None = None


class Board:
    """The launcher's view of its tasks: a line per state change, a summary table.

    States: ``starting``, then ``healthy`` (PS tasks, once SERVING) or
    ``training`` (workers, once they report a step); then ``done`` (exit 0),
    ``failed`` (non-zero exit of its own) or ``stopped`` (ended by the
    launcher). While a worker trains, a line is printed when its epoch
    changes, and at most every `interval_s` when only its step does.

    Args:
      out: where the lines go (the launcher's stderr).
      interval_s: seconds between two progress lines of a training worker
        whose epoch did not change; 0 prints state changes only.
      verbose: False prints only failures and the summary.
      clock: monotonic clock in seconds.
    """

    def __init__(self, out: TextIO | None = None, interval_s: float = 10.0, verbose: bool = True,
                 clock: Callable[[], float] = time.monotonic):
        if interval_s < 0:
            raise ValueError(f"the progress interval must be >= 0 s. Received: {interval_s!r}")
        self._out = out
        self.interval_s = float(interval_s)
        self.verbose = verbose
        self._clock = clock
        self._rows: dict[str, _Row] = {}

    def _print(self, text: str) -> None:
        out = self._out or sys.stderr
        print(f"prophet-tf launch: {text}", file=out, flush=True)

    def add(self, name: str, kind: str) -> None:
        """A task was started."""
        now = self._clock()
        self._rows[name] = _Row(name, kind, started=now, shown_at=now)
        if self.verbose:
            self._print(f"{name}: starting")

    def healthy(self, name: str, address: str) -> None:
        """A PS task answers SERVING at `address`."""
        self._set(name, "healthy", f"at {address}")

    def progress(self, name: str, status: dict | None) -> None:
        """A worker's status file says `status` (None: nothing written yet)."""
        row = self._rows[name]
        if not status or row.state not in ("starting", "training"):
            return
        step, epoch = status.get("step"), status.get("epoch")
        row.step = step if isinstance(step, int) else row.step
        row.epoch = epoch if isinstance(epoch, int) else row.epoch
        epochs = status.get("epochs")
        row.epochs = epochs if isinstance(epochs, int) else row.epochs
        if row.step is None and row.epoch is None:
            return
        now = self._clock()
        if row.state == "starting":
            self._set(name, "training")
        elif row.epoch != row.shown_epoch or (
                self.interval_s > 0 and row.step != row.shown_step
                and now - row.shown_at >= self.interval_s):
            self._show(row, now)

    def exited(self, name: str, code: int, stopped_by_launcher: bool = False) -> None:
        """A task exited with `code` (negative: killed by that signal)."""
        row = self._rows[name]
        if row.ended is not None:
            return
        row.ended = self._clock()
        row.exit_code = code
        if stopped_by_launcher:
            self._set(name, "stopped")
        elif code == 0:
            self._set(name, "done")
        else:
            self._set(name, "failed", f"(exit code {describe_exit(code)})", always=True)

    def _set(self, name: str, state: str, detail: str = "", always: bool = False) -> None:
        row = self._rows[name]
        if row.state == state:
            return
        row.state, row.detail = state, detail
        if self.verbose or always:
            self._show(row, self._clock())

    def _show(self, row: _Row, now: float) -> None:
        row.shown_at, row.shown_step, row.shown_epoch = now, row.step, row.epoch
        parts = [f"{row.state} {row.detail}" if row.detail else row.state]
        if row.state == "training" or (row.kind == "worker" and row.ended is not None):
            parts.extend(self._position(row))
        if row.ended is not None:
            parts.append(f"after {row.ended - row.started:.1f} s")
        self._print(f"{row.name}: " + ", ".join(parts))

    @staticmethod
    def _position(row: _Row) -> list[str]:
        out = []
        if row.epoch is not None:
            out.append(f"epoch {row.epoch}" + (f"/{row.epochs}" if row.epochs else ""))
        if row.step is not None:
            out.append(f"step {row.step}")
        return out

    def state(self, name: str) -> str:
        return self._rows[name].state

    def summary(self, title: str = "summary") -> str:
        """The table: task, state, exit code, wall time, last step."""
        now = self._clock()
        header = ("task", "state", "exit code", "wall time", "last step")
        rows = []
        for row in self._rows.values():
            wall = (row.ended if row.ended is not None else now) - row.started
            code = "-" if row.exit_code is None else describe_exit(row.exit_code)
            step = "-" if row.step is None else str(row.step)
            if row.epoch is not None:
                step += f" (epoch {row.epoch})"
            rows.append((row.name, row.state, code, f"{wall:.1f} s", step))
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        lines = [f"prophet-tf launch: {title}"]
        for r in [header, *rows]:
            lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        return "\n".join(lines)

    def print_summary(self, title: str = "summary") -> None:
        print(self.summary(title), file=self._out or sys.stderr, flush=True)


def describe_exit(code: int) -> str:
    """An exit code as a person reads it: ``3``, or ``-9 (SIGKILL)``."""
    if code < 0:
        try:
            return f"{code} ({signal.Signals(-code).name})"
        except ValueError:
            return str(code)
    return str(code)
