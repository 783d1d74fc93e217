"""The tasks of `prophet-tf launch`: their output relayed, supervised to the first failure.

- :class:`Task`: a child process (``processes.ChildProcess``) that dies with the
  launcher, each of its lines relayed prefixed with its name, TensorFlow's
  start-up banners dropped when its log level hides them.
- :func:`supervise`: waits for the workers; the first failure (or a signal) ends it.
- :func:`stop_all`: every task stopped and reaped, how each ended on the board.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time

from prophet_tf import progress
from prophet_tf.tools import board as board_lib
from prophet_tf.tools import processes

__all__ = ["Task", "TF_LOG_LEVEL_ENV", "hides_banners", "stop_all", "supervise"]

# TensorFlow's C++ log level; the launcher gives tasks 2 (warnings and errors
# hidden) unless the caller set it.
TF_LOG_LEVEL_ENV = "TF_CPP_MIN_LOG_LEVEL"
# What TensorFlow prints at import before its logging honours TF_CPP_MIN_LOG_LEVEL
# (TensorFlow 2.21: once per loaded library). Dropped from a task's output when its
# TF_CPP_MIN_LOG_LEVEL hides informational messages (>= 1).
_STARTUP_BANNERS = (re.compile(rb"^WARNING: All log messages before absl::InitializeLog\(\) "
                               rb"is called are written to STDERR\r?$"),
                    re.compile(rb"^I\d{4} [\d:.]+ +\d+ port\.cc:\d+\] oneDNN custom operations "
                               rb"are on\."))


def _check_executable(program: str, env: dict[str, str]) -> None:
    """Raises what Popen would for a program that cannot run (a missing or non-executable file)."""
    if os.sep in program:
        if not os.path.exists(program):
            raise FileNotFoundError(2, "No such file or directory", program)
        if os.path.isdir(program) or not os.access(program, os.X_OK):
            raise PermissionError(13, "Permission denied", program)
    elif shutil.which(program, path=env.get("PATH", os.defpath)) is None:
        raise FileNotFoundError(2, "No such file or directory (not on PATH)", program)


def hides_banners(env: dict[str, str]) -> bool:
    """Whether a task with environment ``env`` has TensorFlow's start-up banners dropped."""
    return env.get(TF_LOG_LEVEL_ENV, "0").strip() not in ("", "0")


class Task(processes.ChildProcess):
    """One child process whose output is relayed line by line with a prefix.

    Args:
      name: the task's name, which prefixes its lines.
      argv, env: its command and whole environment.
      out: where its prefixed lines go (default stdout).
      stdin: bytes written to its standard input, which then stays open until
        :meth:`close_stdin` (None: no input).
      drop_banners: drop TensorFlow's start-up banners (None: as ``env``'s
        TF_CPP_MIN_LOG_LEVEL says, :func:`hides_banners`).
    """

    def __init__(self, name: str, argv: list[str], env: dict[str, str], out=None, *,
                 stdin: bytes | None = None, drop_banners: bool | None = None):
        self._out = out or sys.stdout
        self.status_file = env.get(progress.STATUS_FILE_ENV)
        self._drop_banners = hides_banners(env) if drop_banners is None else drop_banners
        _check_executable(argv[0], env)  # The shim below would only exit 127.
        # No preexec_fn: see prophet_tf/tools/_die_with_parent.py for why.
        super().__init__(
            name,
            [sys.executable, "-m", "prophet_tf.tools._die_with_parent", str(os.getpid()), *argv],
            env, stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE)
        if stdin is not None:
            try:
                self.process.stdin.write(stdin)
                self.process.stdin.flush()
            except BrokenPipeError:  # It exited already; poll() tells.
                pass
        self._relay = threading.Thread(target=self._pump, name=f"relay-{name}", daemon=True)
        self._relay.start()

    def close_stdin(self) -> None:
        """Closes the task's standard input (it reads EOF), if it has one."""
        if self.process.stdin is not None:
            try:
                self.process.stdin.close()
            except OSError:  # The task is gone: a flush into a closed pipe.
                pass

    def take(self, line: bytes) -> bool:
        """Whether ``line`` is for the launcher rather than the output (then it is not
        relayed); a subclass's hook. This class relays every line."""
        return False

    def _pump(self):
        prefix = f"[{self.name}] ".encode()
        for line in iter(self.process.stdout.readline, b""):
            if self.take(line):
                continue
            if self._drop_banners and any(b.match(line) for b in _STARTUP_BANNERS):
                continue
            self._out.buffer.write(prefix + line) if hasattr(self._out, "buffer") else \
                self._out.write((prefix + line).decode(errors="replace"))
            self._out.flush()

    def status(self) -> dict | None:
        """What the task last wrote to its status file (workers only)."""
        return progress.read_status(self.status_file) if self.status_file else None

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM (unless already sent), then SIGKILL after `grace_s`; always reaps."""
        super().stop(grace_s)
        self._relay.join(timeout=2.0)


def stop_all(tasks: list[Task], board: board_lib.Board) -> None:
    """Stops and reaps every task still running; records how each ended."""
    running = {task.name for task in tasks if task.poll() is None}
    for task in tasks:  # Signal everyone first: the PS grace periods overlap.
        task.terminate()
    for task in reversed(tasks):
        task.stop()
    for task in tasks:
        board.progress(task.name, task.status())
        board.exited(task.name, task.poll(), stopped_by_launcher=task.name in running)


def supervise(tasks: list[Task], workers: list[Task], stopping: threading.Event,
              board: board_lib.Board) -> tuple[int, str]:
    """Waits for all workers; the first failure (or a signal) stops everyone.

    Returns:
      The exit code, and what failed ("" if nothing did).
    """
    next_status = 0.0
    while not stopping.is_set():
        if time.monotonic() >= next_status:  # Status files change at most once a second.
            next_status = time.monotonic() + 0.5
            for task in workers:
                if task.poll() is None:
                    board.progress(task.name, task.status())
        for task in tasks:
            code = task.poll()
            if code is None:
                continue
            board.progress(task.name, task.status())
            board.exited(task.name, code)
            if code != 0 or task not in workers:
                what = f"{task.name} exited with code {code}"
                print(f"prophet-tf launch: {what}; stopping the other tasks", file=sys.stderr,
                      flush=True)
                # Killed by signal N (code -N): exit 128+N like a shell would.
                return (128 - code if code < 0 else code or 1), what
        if all(w.poll() == 0 for w in workers):
            return 0, ""
        time.sleep(0.1)
    print("prophet-tf launch: interrupted; stopping all tasks", file=sys.stderr, flush=True)
    return 130, ""
