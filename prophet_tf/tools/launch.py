"""`prophet-tf launch`: a whole cluster on this machine.

    prophet-tf launch --workers 2 --ps 1 [--scheduler fifo] -- python train.py
    prophet-tf launch --gpus 4 --ps 1 -- python train.py     # one worker per GPU

Starts M PS tasks on free ports, waits until each reports SERVING on the
standard gRPC health service, then starts N copies of CMD, each with its own
TF_CONFIG. Every line a task prints is prefixed with the task's name. The
launcher exits with the first failing task's exit code after stopping the
others, or 0 once every worker has finished. Children die with the launcher
(PR_SET_PDEATHSIG), so a killed launcher leaves no orphans.

On its stderr the launcher prints each task's state as it changes (starting,
healthy, training with epoch and step, done, failed, stopped; see
prophet_tf.progress) and a summary table at the end. With ``--restart K`` a
failed cluster is stopped and started again, PS tasks included, up to K
times. ``--checkpoint-dir D`` gives PS task i ``--checkpoint-dir D/ps-<i>``.
Tasks get TF_CPP_MIN_LOG_LEVEL=2 unless it is set, and TensorFlow's start-up
banners are dropped from the output of a task whose level hides them.

With ``--gpus N`` this host has N GPUs and runs one worker on each (N
workers unless ``--workers`` says so too, which must then be N): worker i
gets ``CUDA_VISIBLE_DEVICES`` naming one device, the i-th entry of the
caller's CUDA_VISIBLE_DEVICES if it is set (the first N are used), else i.
PS tasks get CUDA_VISIBLE_DEVICES="" so that they take no GPU memory. Bad
input (N < 1, another number of workers, a malformed or too short
CUDA_VISIBLE_DEVICES) is rejected before anything starts.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import tempfile
import threading

from prophet_tf import cluster as cluster_lib
from prophet_tf import environment, progress
from prophet_tf.tools import board as board_lib
from prophet_tf.tools import launched_tasks, processes
from prophet_tf.tools.gpus import CUDA_DEVICES_ENV, gpu_devices
from prophet_tf.tools.launched_tasks import TF_LOG_LEVEL_ENV, Task

logger = logging.getLogger(__name__)

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_LEVEL_ENV = environment.LOG_LEVEL


class _Interrupted(Exception):
    """SIGTERM/SIGINT reached the launcher while it was starting the PS tasks."""


def _alive(task: Task, stopping: threading.Event, before: str):
    """What a wait for ``task`` calls between looks: raises once the launcher is
    interrupted or the task has exited (``before`` what it was waiting for)."""
    def alive():
        if stopping.is_set():
            raise _Interrupted
        if task.poll() is not None:
            raise RuntimeError(f"{task.name} exited with code {task.poll()} before {before}")
    return alive


def _wait_healthy(task: Task, address: str, timeout_s: float,
                  stopping: threading.Event, security=None) -> None:
    """Waits for SERVING (with the cluster's token/TLS `security`, default from the env)."""
    from prophet_tf.ps import health  # grpc only, no TensorFlow

    health.wait_serving(address, timeout_s, alive=_alive(task, stopping, "it was SERVING"),
                        security=security)


def launch(command: list[str], num_workers: int, num_ps: int, scheduler: str | None = None,
           host: str = "127.0.0.1", startup_timeout_s: float = 120.0, out=None, *,
           restarts: int = 0, checkpoint_dir: str | None = None,
           checkpoint_steps: int | None = None, checkpoint_secs: float | None = None,
           log_level: str | None = None, progress_interval_s: float = 10.0,
           verbose: bool = True, gpus: int | None = None) -> int:
    """Runs the cluster to completion; returns the exit code (see module doc).

    Args:
      command: the worker command (every worker runs it).
      num_workers, num_ps: how many worker and PS tasks.
      scheduler: exported to the workers as PROPHET_TF_SCHEDULER.
      host: the address the PS tasks bind and the cluster spec names.
      startup_timeout_s: how long each PS may take to listen and be SERVING.
      out: where the tasks' prefixed lines go (default stdout).
      restarts: after a failure (a task exited non-zero, or a PS did not
        come up), stop everything and start the whole cluster again, up to
        this many times. The exit code is the last attempt's.
      checkpoint_dir: PS task i checkpoints to ``checkpoint_dir/ps-<i>``.
      checkpoint_steps, checkpoint_secs: passed to every PS task.
      log_level: exported to every task as PROPHET_TF_LOG_LEVEL.
      progress_interval_s: at most one progress line per training worker in
        this time unless its epoch changes; 0 prints state changes only.
      verbose: print state changes (False: failures and summaries only).
      gpus: this host's number of GPUs, one worker on each (num_workers must
        equal it): worker i gets CUDA_VISIBLE_DEVICES=gpu_devices(...)[i],
        from this process's CUDA_VISIBLE_DEVICES; PS tasks get "". None:
        CUDA_VISIBLE_DEVICES is left as it is.

    Raises:
      ValueError: a bad argument, before anything starts.
      RuntimeError, TimeoutError: a PS did not come up (in the last attempt).
    """
    if not isinstance(restarts, int) or restarts < 0:
        raise ValueError(f"restarts must be an integer >= 0. Received: restarts={restarts!r}")
    if log_level is not None and log_level not in LOG_LEVELS:
        raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}. "
                         f"Received: log_level={log_level!r}")
    if progress_interval_s < 0:
        raise ValueError("progress_interval_s must be >= 0. "
                         f"Received: progress_interval_s={progress_interval_s!r}")
    devices = None
    if gpus is not None:
        devices = gpu_devices(gpus, os.environ.get(CUDA_DEVICES_ENV))
        if num_workers != gpus:
            raise ValueError(f"--gpus runs one worker per GPU: give --workers {gpus} or leave it "
                             f"out. Received: --workers {num_workers}, --gpus {gpus}")
    if num_workers < 1 or num_ps < 1:
        raise ValueError(f"need at least one worker and one ps. Received: workers={num_workers}, "
                         f"ps={num_ps}")
    if not command:
        raise ValueError("no worker command given; put it after `--`. Received: CMD=[]")
    from prophet_tf.ps import security as security_lib
    base_env = dict(os.environ)
    base_env.setdefault(TF_LOG_LEVEL_ENV, "2")  # TensorFlow's own start-up chatter: quiet
    if security_lib.TOKEN_ENV not in base_env and security_lib.TOKEN_FILE_ENV not in base_env:
        # Authenticated by default: every task of this cluster, and only they, get the token.
        import secrets
        base_env[security_lib.TOKEN_ENV] = secrets.token_urlsafe(32)
        logger.info("generated a token for this cluster (%s in every task's environment)",
                    security_lib.TOKEN_ENV)
    client_security = security_lib.client_security(base_env)  # bad settings: fail before starting
    stopping = threading.Event()

    def on_signal(signum, _frame):
        stopping.set()

    if log_level is not None:
        base_env[LOG_LEVEL_ENV] = log_level
    ps_flags = _checkpoint_flags(checkpoint_dir, checkpoint_steps, checkpoint_secs)
    if devices is not None:
        logger.info("one worker per GPU: %s; PS tasks: %s=\"\"", ", ".join(
            f"worker {i} on {CUDA_DEVICES_ENV}={d}" for i, d in enumerate(devices)),
            CUDA_DEVICES_ENV)
    cluster = _Cluster(command, num_workers, num_ps, scheduler, host, startup_timeout_s, out,
                       base_env, client_security, ps_flags, progress_interval_s, verbose,
                       devices)
    attempts = restarts + 1
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        failure = ""
        for attempt in range(1, attempts + 1):
            if attempts > 1:
                why = f"; the previous attempt failed: {failure}" if failure else ""
                print(f"prophet-tf launch: attempt {attempt} of {attempts}{why}",
                      file=sys.stderr, flush=True)
            try:
                code, failure = cluster.run(stopping, attempt if attempts > 1 else None)
            except (RuntimeError, TimeoutError) as e:  # A PS did not come up.
                if attempt == attempts or stopping.is_set():
                    raise
                code, failure = 1, str(e)
            if code == 0 or not failure or stopping.is_set():
                return code
        return code
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _checkpoint_flags(directory: str | None, steps: int | None, secs: float | None):
    """The PS checkpoint flags of PS task i, as a function of i."""
    if directory is None:
        if steps is not None or secs is not None:
            raise ValueError("--checkpoint-steps and --checkpoint-secs need --checkpoint-dir. "
                             f"Received: checkpoint_steps={steps}, checkpoint_secs={secs}")
        return lambda i: []
    if steps is not None and (not isinstance(steps, int) or steps < 1):
        raise ValueError(f"checkpoint_steps must be an integer >= 1. Received: {steps!r}")
    if secs is not None and not secs > 0:
        raise ValueError(f"checkpoint_secs must be > 0. Received: {secs!r}")
    extra = (["--checkpoint-steps", str(steps)] if steps is not None else []) + \
        (["--checkpoint-secs", repr(float(secs))] if secs is not None else [])
    return lambda i: ["--checkpoint-dir", os.path.join(directory, f"ps-{i}"), *extra]


class _Cluster:
    """Everything needed to start the cluster; `run` starts one attempt."""

    def __init__(self, command, num_workers, num_ps, scheduler, host, startup_timeout_s, out,
                 base_env, client_security, ps_flags, progress_interval_s, verbose,
                 devices=None):
        self.command, self.num_workers, self.num_ps = command, num_workers, num_ps
        self.scheduler, self.host, self.startup_timeout_s = scheduler, host, startup_timeout_s
        self.out, self.base_env, self.client_security = out, base_env, client_security
        self.ps_flags, self.progress_interval_s = ps_flags, progress_interval_s
        self.verbose = verbose
        self.devices = devices  # worker i's CUDA_VISIBLE_DEVICES; None: left alone

    def _start(self, name: str, argv: list[str], env: dict[str, str]) -> Task:
        logger.debug("starting %s: %s", name, " ".join(argv))
        return Task(name, argv, env, self.out)

    def run(self, stopping: threading.Event, attempt: int | None) -> tuple[int, str]:
        """Starts the PS tasks, then the workers, and supervises them until the end.

        Returns:
          The exit code, and why the cluster failed ("" when it did not, or
          was interrupted).
        """
        tasks: list[Task] = []
        board = board_lib.Board(interval_s=self.progress_interval_s, verbose=self.verbose)
        host, num_workers, num_ps = self.host, self.num_workers, self.num_ps
        try:
            with tempfile.TemporaryDirectory(prefix="prophet-tf-launch-") as tmp:
                ps_addresses = []
                for i in range(num_ps):
                    port_file = os.path.join(tmp, f"ps{i}.port")
                    argv = [sys.executable, "-m", "prophet_tf", "ps", "--host", host, "--port",
                            "0", "--num-workers", str(num_workers), "--ps-index", str(i),
                            "--num-ps", str(num_ps), "--port-file", port_file, *self.ps_flags(i)]
                    env = dict(self.base_env)
                    if self.devices is not None:
                        env[CUDA_DEVICES_ENV] = ""  # A PS computes on the CPU: no GPU memory.
                    tasks.append(self._start(f"ps {i}", argv, env))
                    board.add(tasks[-1].name, "ps")
                    ps_addresses.append((tasks[-1], port_file))
                addresses = []
                for task, port_file in ps_addresses:
                    port = processes.wait_for_port_file(
                        port_file, self.startup_timeout_s, name=task.name,
                        alive=_alive(task, stopping, "it listened"))
                    addresses.append(f"{host}:{port}")
                for (task, _), address in zip(ps_addresses, addresses):
                    _wait_healthy(task, address, self.startup_timeout_s, stopping,
                                  self.client_security)
                    board.healthy(task.name, address)
                # Workers do not listen yet; a free port keeps their names valid addresses.
                workers = [f"{host}:{cluster_lib.free_port(host)}" for _ in range(num_workers)]
                cluster = {"worker": workers, "ps": addresses}
                worker_tasks = []
                for i in range(num_workers):
                    env = dict(self.base_env)
                    env.setdefault("PYTHONUNBUFFERED", "1")  # Relay workers' lines as printed.
                    env["TF_CONFIG"] = json.dumps({"cluster": cluster,
                                                   "task": {"type": "worker", "index": i}})
                    env[progress.STATUS_FILE_ENV] = os.path.join(tmp, f"worker-{i}.status.json")
                    if self.scheduler:
                        env[environment.SCHEDULER] = self.scheduler
                    if self.devices is not None:
                        env[CUDA_DEVICES_ENV] = self.devices[i]
                    worker_tasks.append(self._start(f"worker {i}", list(self.command), env))
                    board.add(worker_tasks[-1].name, "worker")
                tasks.extend(worker_tasks)
                try:
                    return launched_tasks.supervise(tasks, worker_tasks, stopping, board)
                finally:
                    launched_tasks.stop_all(tasks, board)  # Before the status files go with `tmp`.
        except _Interrupted:
            print("prophet-tf launch: interrupted while the PS tasks were starting; stopping "
                  "them", file=sys.stderr, flush=True)
            return 130, ""
        finally:
            launched_tasks.stop_all(tasks, board)
            board.print_summary(f"summary of attempt {attempt}" if attempt else "summary")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, command = argv[:split], argv[split + 1:]
    parser = argparse.ArgumentParser(
        prog="prophet-tf launch", description=__doc__.split("\n\n")[0],
        usage="prophet-tf launch (--workers N | --gpus N) [--ps M] [--scheduler S] "
              "[--restart K] [--checkpoint-dir D] [--log-level L] -- CMD [ARGS]")
    parser.add_argument("--workers", type=int, default=None,
                        help="number of worker processes (required unless --gpus gives it)")
    parser.add_argument("--gpus", type=int, default=None, metavar="N",
                        help="this host has N GPUs: run N workers, one per GPU. Worker i gets "
                             f"{CUDA_DEVICES_ENV}=the i-th entry of ${CUDA_DEVICES_ENV} if set, "
                             f"else i; PS tasks get {CUDA_DEVICES_ENV}=\"\" (--workers, if "
                             "given, must be N)")
    parser.add_argument("--ps", type=int, default=1, help="number of PS tasks (default 1)")
    parser.add_argument("--scheduler", default=None,
                        help="gradient scheduler for every worker, a name or name:option=value,... "
                             "(e.g. prophet:blocks_in_flight=4); sets PROPHET_TF_SCHEDULER")
    parser.add_argument("--host", default="127.0.0.1", help="address the PS tasks bind")
    parser.add_argument("--startup-timeout", type=float, default=120.0,
                        help="seconds to wait for each PS to become healthy")
    parser.add_argument("--restart", type=int, default=0, metavar="K",
                        help="after a failure, stop everything and start the whole cluster "
                             "again, up to K times (default 0)")
    parser.add_argument("--checkpoint-dir", default=None, metavar="D",
                        help="PS task i checkpoints to D/ps-<i> (prophet-tf ps --checkpoint-dir)")
    parser.add_argument("--checkpoint-steps", type=int, default=None, metavar="N",
                        help="passed to every PS task (needs --checkpoint-dir)")
    parser.add_argument("--checkpoint-secs", type=float, default=None, metavar="S",
                        help="passed to every PS task (needs --checkpoint-dir)")
    default_level = os.environ.get(LOG_LEVEL_ENV, "INFO").upper()
    parser.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS,
                        default=default_level if default_level in LOG_LEVELS else "INFO",
                        help="the launcher's log level, also exported to every task as "
                             f"{LOG_LEVEL_ENV} (default: ${LOG_LEVEL_ENV}, else INFO); "
                             "above INFO, state changes are not printed")
    parser.add_argument("--progress-interval", type=float, default=10.0, metavar="S",
                        help="at most one progress line per training worker every S seconds "
                             "unless its epoch changes; 0: state changes only (default 10)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    if args.workers is None and args.gpus is None:
        parser.error("the following arguments are required: --workers (or --gpus N: one worker "
                     "per GPU). Received neither")
    if args.restart < 0:
        parser.error(f"--restart must be >= 0. Received: --restart={args.restart}")
    if args.progress_interval < 0:
        parser.error(f"--progress-interval must be >= 0. Received: "
                     f"--progress-interval={args.progress_interval}")
    try:
        if args.scheduler is not None:
            # The documented "name:option=value,..." form, as PROPHET_TF_SCHEDULER reads it.
            from prophet_tf.engine.schedulers import parse_scheduler
            parse_scheduler(args.scheduler)
        num_workers = args.gpus if args.workers is None else args.workers
        return launch(command, num_workers, args.ps, args.scheduler, args.host,
                      args.startup_timeout, restarts=args.restart,
                      checkpoint_dir=args.checkpoint_dir,
                      checkpoint_steps=args.checkpoint_steps,
                      checkpoint_secs=args.checkpoint_secs, log_level=args.log_level,
                      progress_interval_s=args.progress_interval,
                      verbose=logging.getLevelName(args.log_level) <= logging.INFO,
                      gpus=args.gpus)
    except (ValueError, RuntimeError, TimeoutError) as e:
        print(f"prophet-tf launch: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # e.g. the worker command does not exist
        print(f"prophet-tf launch: cannot start a task: {e}", file=sys.stderr)
        return 127 if isinstance(e, FileNotFoundError) else 126
