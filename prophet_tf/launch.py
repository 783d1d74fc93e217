"""`prophet-tf launch`: a whole cluster on this machine.

    prophet-tf launch --workers 2 --ps 1 [--scheduler fifo] -- python train.py

Starts M PS tasks on free ports, waits until each reports SERVING on the
standard gRPC health service, then starts N copies of CMD, each with its own
TF_CONFIG. Every line a task prints is prefixed with the task's name. The
launcher exits with the first failing task's exit code after stopping the
others, or 0 once every worker has finished. Children die with the launcher
(PR_SET_PDEATHSIG), so a killed launcher leaves no orphans.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
# Loaded here, not in the child: dlopen between fork and exec can deadlock
# when another thread (a relay) held the loader's lock at fork time.
_libc = ctypes.CDLL("libc.so.6", use_errno=True)


def _die_with_parent(parent_pid: int):
    def preexec():  # Runs in the child between fork and exec.
        # The launcher's SIGTERM handler is inherited until exec: a death
        # signal arriving now would only set its flag. Default action instead.
        _libc.signal(signal.SIGTERM, ctypes.c_void_p(0))  # SIG_DFL
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent_pid:  # The launcher died before prctl took effect.
            os._exit(128 + signal.SIGTERM)
    return preexec


class _Interrupted(Exception):
    """SIGTERM/SIGINT reached the launcher while it was starting the PS tasks."""


class Task:
    """One child process whose output is relayed line by line with a prefix."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], out=None):
        self.name = name
        self._out = out or sys.stdout
        self.process = subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent(os.getpid()))
        self._relay = threading.Thread(target=self._pump, name=f"relay-{name}", daemon=True)
        self._relay.start()

    def _pump(self):
        prefix = f"[{self.name}] ".encode()
        for line in iter(self.process.stdout.readline, b""):
            self._out.buffer.write(prefix + line) if hasattr(self._out, "buffer") else \
                self._out.write((prefix + line).decode(errors="replace"))
            self._out.flush()

    def poll(self):
        return self.process.poll()

    def terminate(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after `grace_s`; always reaps."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._relay.join(timeout=2.0)


def _free_port(host: str) -> int:
    import socket
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _wait_for_port_file(task: Task, path: str, timeout_s: float,
                        stopping: threading.Event) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if stopping.is_set():
            raise _Interrupted
        if task.poll() is not None:
            raise RuntimeError(f"{task.name} exited with code {task.poll()} before it listened")
        try:
            text = open(path).read().strip()
            if text:
                return int(text)
        except FileNotFoundError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{task.name} did not report its port within {timeout_s:.0f} s")


def _wait_healthy(task: Task, address: str, timeout_s: float,
                  stopping: threading.Event) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if stopping.is_set():
                raise _Interrupted
            if task.poll() is not None:
                raise RuntimeError(f"{task.name} exited with code {task.poll()} before it "
                                   "was SERVING")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"PS at {address} was not SERVING within {timeout_s:.0f} s")
            time.sleep(0.1)


def launch(command: list[str], num_workers: int, num_ps: int, scheduler: str | None = None,
           host: str = "127.0.0.1", startup_timeout_s: float = 120.0, out=None) -> int:
    """Runs the cluster to completion; returns the exit code (see module doc)."""
    if num_workers < 1 or num_ps < 1:
        raise ValueError(f"need at least one worker and one ps. Received: workers={num_workers}, "
                         f"ps={num_ps}")
    if not command:
        raise ValueError("no worker command given; put it after `--`. Received: CMD=[]")
    tasks: list[Task] = []
    stopping = threading.Event()

    def on_signal(signum, _frame):
        stopping.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with tempfile.TemporaryDirectory(prefix="prophet-tf-launch-") as tmp:
            ps_addresses = []
            for i in range(num_ps):
                port_file = os.path.join(tmp, f"ps{i}.port")
                argv = [sys.executable, "-m", "prophet_tf", "ps", "--host", host, "--port", "0",
                        "--num-workers", str(num_workers), "--ps-index", str(i),
                        "--num-ps", str(num_ps), "--port-file", port_file]
                tasks.append(Task(f"ps {i}", argv, dict(os.environ), out))
                ps_addresses.append((tasks[-1], port_file))
            addresses = []
            for task, port_file in ps_addresses:
                port = _wait_for_port_file(task, port_file, startup_timeout_s, stopping)
                addresses.append(f"{host}:{port}")
            for (task, _), address in zip(ps_addresses, addresses):
                _wait_healthy(task, address, startup_timeout_s, stopping)
            # Workers do not listen yet; a free port keeps their names valid addresses.
            workers = [f"{host}:{_free_port(host)}" for _ in range(num_workers)]
            cluster = {"worker": workers, "ps": addresses}
            worker_tasks = []
            for i in range(num_workers):
                env = dict(os.environ)
                env.setdefault("PYTHONUNBUFFERED", "1")  # Relay Python workers' lines as printed.
                env["TF_CONFIG"] = json.dumps({"cluster": cluster,
                                               "task": {"type": "worker", "index": i}})
                if scheduler:
                    env["PROPHET_TF_SCHEDULER"] = scheduler
                worker_tasks.append(Task(f"worker {i}", list(command), env, out))
            tasks.extend(worker_tasks)
            return _supervise(tasks, worker_tasks, stopping)
    except _Interrupted:
        print("prophet-tf launch: interrupted while the PS tasks were starting; stopping them",
              file=sys.stderr, flush=True)
        return 130
    finally:
        for task in tasks:  # Signal everyone first: the PS grace periods overlap.
            task.terminate()
        for task in reversed(tasks):
            task.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)


def _supervise(tasks: list[Task], workers: list[Task], stopping: threading.Event) -> int:
    """Waits for all workers; the first failure (or a signal) stops everyone."""
    while not stopping.is_set():
        for task in tasks:
            code = task.poll()
            if code not in (None, 0) or (code == 0 and task not in workers):
                logger.error("%s exited with code %s; stopping the cluster", task.name, code)
                print(f"prophet-tf launch: {task.name} exited with code {code}; stopping the "
                      "other tasks", file=sys.stderr, flush=True)
                # Killed by signal N (code -N): exit 128+N like a shell would.
                return 128 - code if code < 0 else code or 1
        if all(w.poll() == 0 for w in workers):
            return 0
        time.sleep(0.1)
    print("prophet-tf launch: interrupted; stopping all tasks", file=sys.stderr, flush=True)
    return 130


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, command = argv[:split], argv[split + 1:]
    parser = argparse.ArgumentParser(
        prog="prophet-tf launch", description=__doc__.split("\n\n")[0],
        usage="prophet-tf launch --workers N --ps M [--scheduler S] -- CMD [ARGS]")
    parser.add_argument("--workers", type=int, required=True, help="number of worker processes")
    parser.add_argument("--ps", type=int, default=1, help="number of PS tasks (default 1)")
    parser.add_argument("--scheduler", default=None,
                        help="gradient scheduler for every worker (sets PROPHET_TF_SCHEDULER)")
    parser.add_argument("--host", default="127.0.0.1", help="address the PS tasks bind")
    parser.add_argument("--startup-timeout", type=float, default=120.0,
                        help="seconds to wait for each PS to become healthy")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.scheduler is not None:
            from prophet_tf.engine.schedulers import validate_scheduler
            validate_scheduler(args.scheduler)
        return launch(command, args.workers, args.ps, args.scheduler, args.host,
                      args.startup_timeout)
    except (ValueError, RuntimeError, TimeoutError) as e:
        print(f"prophet-tf launch: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # e.g. the worker command does not exist
        print(f"prophet-tf launch: cannot start a task: {e}", file=sys.stderr)
        return 127 if isinstance(e, FileNotFoundError) else 126
