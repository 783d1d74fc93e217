"""`python -m prophet_tf.tools._remote_task [options] -- CMD...`: a `launch --hosts` task.

`prophet-tf launch --hosts` runs this over ssh, in the launcher's working
directory, with the launcher's Python. It

1. reads the first line of its standard input: a JSON object of environment
   variables to add for CMD (TF_CONFIG, the cluster's token, ...), so that no
   secret is ever on a command line, where ``ps`` on the host would show it;
2. starts CMD in a session of its own (its own process group), its output
   (stderr included) relayed line by line;
3. with ``--port-flag FLAG``, appends ``FLAG FILE`` to CMD (``prophet-tf ps
   --port-file``) and reports the port written there; with ``--status``,
   gives CMD a status file (``PROPHET_TF_STATUS_FILE``) and reports what it
   holds whenever that changes: both as marker lines (:data:`MARKER`, then
   JSON) that the launcher takes out of the output;
4. stops CMD's process group (SIGTERM, then SIGKILL after ``--grace``
   seconds) when its standard input reaches EOF: the launcher closed it, or
   the ssh session ended because the launcher, its ssh or the network went
   away. SIGTERM, SIGHUP or SIGINT here do the same;
5. once CMD has exited, kills whatever is left of its process group and
   exits with CMD's exit code (128+N when CMD was killed by signal N).

Should this process be killed outright, CMD gets SIGTERM from the kernel
(PR_SET_PDEATHSIG, through ``_die_with_parent``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from prophet_tf import environment, progress
from prophet_tf.tools import processes

# A line of this process's output that starts with MARKER is for the launcher:
# MARKER, then a JSON object ({"port": N} or {"status": {...}}), then a newline.
MARKER = b"\x1eprophet-tf-launch "
_STATUS_FILE_ENV = environment.STATUS_FILE  # what prophet_tf.progress writes
_POLL_S = 0.05
_STATUS_POLL_S = 0.5


class _Output:
    """This process's standard output, shared by the relayed lines and the markers.

    A write into a closed session (the launcher's ssh is gone) sets ``lost``;
    later lines are dropped, so that CMD never blocks on a full pipe.
    """

    def __init__(self, lost: threading.Event):
        self._lock = threading.Lock()
        self._lost = lost

    def write(self, data: bytes) -> None:
        with self._lock:
            if self._lost.is_set():
                return
            try:
                sys.stdout.buffer.write(data)
                sys.stdout.buffer.flush()
            except (BrokenPipeError, OSError):
                self._lost.set()

    def marker(self, **fields) -> None:
        self.write(MARKER + json.dumps(fields, separators=(",", ":")).encode() + b"\n")


def _read_environment() -> dict[str, str]:
    # Unbuffered reads of the descriptor: the watcher below reads it too, and a
    # daemon thread blocked inside sys.stdin's lock would abort the interpreter's exit.
    line = b""
    while not line.endswith(b"\n"):
        chunk = os.read(0, 1)
        if not chunk:
            break
        line += chunk
    try:
        env = json.loads(line)
        if not isinstance(env, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise ValueError("not an object of strings")
    except ValueError as e:
        # The line may hold the token: say what is wrong, never what it is.
        sys.exit(f"prophet-tf launch (remote side): the first line of standard input must be "
                 f"a JSON object of environment variables ({e}). Received: {len(line)} bytes")
    return env


def _exited(pid: int) -> bool:
    """Whether child ``pid`` has exited, without reaping it: until it is reaped, its
    pid, and so its process group's id, cannot be given to another process."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


class _Exited(Exception):
    """CMD exited before it wrote its port."""


def _report_port(path: str, pid: int, out: _Output) -> None:
    """Reports the port CMD (``pid``) writes to ``path``, once, while CMD lives."""
    def alive():
        if _exited(pid):
            raise _Exited

    try:
        out.marker(port=processes.wait_for_port_file(path, math.inf, alive=alive,
                                                     poll_s=_POLL_S))
    except (_Exited, ValueError):
        pass


def _report_status(path: str, done: threading.Event, out: _Output) -> None:
    """Reports the status file's content whenever it changes, and once more at the end."""
    last = None
    while True:
        finished = done.wait(_STATUS_POLL_S)
        status = progress.read_status(path)
        if status is not None and status != last:
            out.marker(status=status)
            last = status
        if finished:
            return


def _kill_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m prophet_tf.tools._remote_task")
    parser.add_argument("--port-flag", default=None,
                        help="append FLAG FILE to CMD and report the port it writes to FILE")
    parser.add_argument("--status", action="store_true",
                        help="give CMD a status file and report its changes")
    parser.add_argument("--grace", type=float, default=5.0,
                        help="seconds between SIGTERM and SIGKILL when stopping CMD")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given after `--`. Received: CMD=[]")
    env = dict(os.environ, **_read_environment())

    stop, lost, done = threading.Event(), threading.Event(), threading.Event()
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())

    def watch_stdin():
        try:
            while os.read(0, 65536):
                pass
        except OSError:
            pass
        stop.set()  # EOF: the launcher closed it, or the session is gone.

    scratch = tempfile.mkdtemp(prefix="prophet-tf-task-")
    try:
        if args.port_flag:
            command = [*command, args.port_flag, os.path.join(scratch, "port")]
        if args.status:
            env[_STATUS_FILE_ENV] = os.path.join(scratch, "status.json")
        out = _Output(lost)
        task = subprocess.Popen(
            [sys.executable, "-m", "prophet_tf.tools._die_with_parent", str(os.getpid()),
             *command], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True)

        def relay():
            for line in iter(task.stdout.readline, b""):
                out.write(line)

        threads = [threading.Thread(target=relay, daemon=True)]
        if args.port_flag:
            threads.append(threading.Thread(target=_report_port, daemon=True,
                                            args=(os.path.join(scratch, "port"), task.pid,
                                                  out)))
        if args.status:
            threads.append(threading.Thread(target=_report_status, daemon=True,
                                            args=(env[_STATUS_FILE_ENV], done, out)))
        for thread in threads:
            thread.start()
        threading.Thread(target=watch_stdin, daemon=True).start()
        while not _exited(task.pid) and not stop.wait(0.1):
            pass
        if not _exited(task.pid):  # Stopped from outside: the group, gracefully first.
            _kill_group(task.pid, signal.SIGTERM)
            deadline = time.monotonic() + args.grace
            while not _exited(task.pid) and time.monotonic() < deadline:
                time.sleep(_POLL_S)
        # Whatever is left of the group (CMD too, after the grace period), before CMD is
        # reaped: its group's id is still CMD's own until then.
        _kill_group(task.pid, signal.SIGKILL)
        code = task.wait()
        done.set()
        for thread in threads:
            thread.join(timeout=2.0)
        return 128 - code if code < 0 else code
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    exit_code = main(sys.argv[1:])
    try:
        sys.stdout.flush()
    finally:  # No interpreter shutdown: daemon threads may still hold stdout's lock.
        os._exit(exit_code)
