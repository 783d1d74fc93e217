"""Child processes as `prophet-tf launch` and `prophet-tf bench` supervise them.

- :class:`ChildProcess`: started at once, its stderr with its stdout; polled,
  sent SIGTERM once, stopped with a grace period before SIGKILL, always reaped.
- :func:`wait_for_port_file`: the port a task reports in its port file
  (``prophet-tf ps --port-file``), while the task lives.

What the two commands do differently stays with them: the launcher relays each
task's lines with its name (``launched_tasks.Task``); the bench runs its tasks
inside network namespaces (a command prefix) and logs each to a file.
"""
from __future__ import annotations

import subprocess
import time
from typing import Callable

__all__ = ["ChildProcess", "wait_for_port_file"]


class ChildProcess:
    """One child process, started when constructed.

    Args:
      name: what messages call it (``"ps 0"``).
      argv: the command, a prefix that runs it elsewhere (a namespace) included.
      env: its whole environment.
      stdout: where its output goes (a file, or ``subprocess.PIPE``); its stderr
        goes there too.
      stdin: as ``subprocess.Popen``'s (None: this process's).
    """

    def __init__(self, name: str, argv: list[str], env: dict[str, str], stdout,
                 stdin=None):
        self.name = name
        self._terminated = False
        self.process = subprocess.Popen(argv, env=env, stdout=stdout,
                                        stderr=subprocess.STDOUT, stdin=stdin)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        """The exit code as of the last :meth:`poll` (None: running then)."""
        return self.process.returncode

    def poll(self) -> int | None:
        return self.process.poll()

    def terminate(self) -> None:
        """SIGTERM, if it still runs, once."""
        # Once: a second SIGTERM could land after the task's handler is gone
        # (while the interpreter exits) and kill a graceful shutdown.
        if self.process.poll() is None and not self._terminated:
            self._terminated = True
            self.process.terminate()

    def stop(self, grace_s: float, reap_timeout_s: float | None = None) -> None:
        """SIGTERM (unless already sent), then SIGKILL after ``grace_s``; always reaps.

        Args:
          grace_s: how long it may take to exit after SIGTERM.
          reap_timeout_s: how long to wait for it after SIGKILL (None: as long as
            it takes); past it, ``subprocess.TimeoutExpired``.
        """
        if self.process.poll() is None:
            self.terminate()
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(reap_timeout_s)


def wait_for_port_file(path: str, timeout_s: float, *, name: str = "the task",
                       alive: Callable[[], None] | None = None, poll_s: float = 0.05) -> int:
    """Blocks until the file at ``path`` holds a port; returns it.

    The task writes the file whole (``prophet-tf ps`` renames it into place once it
    listens); an empty file counts as not written yet.

    Args:
      path: the port file.
      timeout_s: overall limit.
      name: the task, as the timeout's message calls it.
      alive: called before every look at the file; whatever it raises (the task
        exited, the caller was interrupted) ends the wait and propagates.
      poll_s: pause between looks.

    Raises:
      TimeoutError: no port within ``timeout_s``: "NAME did not report its port
        within T s".
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if alive is not None:
            alive()
        try:
            with open(path) as f:
                text = f.read().strip()
            if text:
                return int(text)
        except FileNotFoundError:
            pass
        time.sleep(poll_s)
    raise TimeoutError(f"{name} did not report its port within {timeout_s:.0f} s")
