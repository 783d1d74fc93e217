"""`prophet-tf launch`: a whole cluster on this machine, or on several over ssh.

    prophet-tf launch --workers 2 --ps 1 [--scheduler fifo] -- python train.py
    prophet-tf launch --gpus 4 --ps 1 -- python train.py     # one worker per GPU
    prophet-tf launch --hosts a:2,b:2 -- python train.py     # over ssh, see remote_hosts

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

With ``--hosts H[:N],...`` every task is started over ssh instead
(prophet_tf.tools.remote_hosts): N workers on host H and ``--ps`` PS tasks on
every host, each PS on a port it picks and reports back; the rest is the same.
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
from typing import Mapping, Sequence

from prophet_tf import cluster as cluster_lib
from prophet_tf import environment, progress
from prophet_tf.tools import board as board_lib
from prophet_tf.tools import launched_tasks, processes, remote_hosts
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


def launch(command: list[str], num_workers: int | None, num_ps: int,
           scheduler: str | None = None, host: str = "127.0.0.1",
           startup_timeout_s: float = 120.0, out=None, *, restarts: int = 0,
           checkpoint_dir: str | None = None, checkpoint_steps: int | None = None,
           checkpoint_secs: float | None = None, log_level: str | None = None,
           progress_interval_s: float = 10.0, verbose: bool = True, gpus: int | None = None,
           hosts: Sequence[remote_hosts.Host] | None = None,
           ssh: remote_hosts.SshOptions | None = None,
           env: Mapping[str, str] | None = None) -> int:
    """Runs the cluster to completion; returns the exit code (see module doc).

    Args:
      command: the worker command (every worker runs it).
      num_workers, num_ps: how many worker and PS tasks. With ``hosts``,
        num_workers is None (the hosts say it) and num_ps is per host.
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
      hosts: start the tasks on these hosts over ssh (``remote_hosts``,
        ``--hosts``), with ``ssh``'s options; None: all on this machine.
      env: set in every task's environment (with ``hosts``, sent to each).

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
    if hosts is not None and (num_workers is not None or gpus is not None):
        raise ValueError("--hosts gives the workers, HOST:WORKERS for each host; leave out "
                         f"--workers and --gpus. Received: --workers {num_workers}, --gpus {gpus}")
    if hosts is not None:
        num_workers = sum(h.workers for h in hosts)
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
    base_env.update(env or {})
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
    if hosts is None:
        placement = _ThisHost(host, base_env, num_workers, num_ps)
    else:
        placement = remote_hosts.SshHosts(hosts, num_ps, ssh or remote_hosts.SshOptions(),
                                          base_env, forward=list(env or {}))
    ps_flags = _checkpoint_flags(checkpoint_dir, checkpoint_steps, checkpoint_secs)
    if devices is not None:
        logger.info("one worker per GPU: %s; PS tasks: %s=\"\"", ", ".join(
            f"worker {i} on {CUDA_DEVICES_ENV}={d}" for i, d in enumerate(devices)),
            CUDA_DEVICES_ENV)
    cluster = _Cluster(command, placement, scheduler, startup_timeout_s, out, base_env,
                       client_security, ps_flags, progress_interval_s, verbose, devices)
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


class _ThisHost:
    """Where the cluster's tasks go without ``--hosts``: all on this machine, the PS
    tasks bound to `host`, each reporting its port in a file."""

    def __init__(self, host: str, base_env: dict[str, str], num_workers: int, num_ps: int):
        self.host, self.base_env = host, base_env
        self.num_workers, self.num_ps = num_workers, num_ps
        self._port_files: dict[str, str] = {}

    def ps_name(self, i: int) -> str:
        return f"ps {i}"

    def worker_name(self, i: int) -> str:
        return f"worker {i}"

    def _start(self, name: str, argv: list[str], extra, out) -> Task:
        logger.debug("starting %s: %s", name, " ".join(argv))
        return Task(name, argv, {**self.base_env, **extra}, out)

    def start_ps(self, i: int, ps_args: list[str], extra, out, tmp: str) -> Task:
        self._port_files[self.ps_name(i)] = os.path.join(tmp, f"ps{i}.port")
        argv = [sys.executable, "-m", "prophet_tf", "ps", "--host", self.host, "--port", "0",
                *ps_args, "--port-file", self._port_files[self.ps_name(i)]]
        return self._start(self.ps_name(i), argv, extra, out)

    def ps_address(self, task: Task, i: int, timeout_s: float, alive) -> str:
        port = processes.wait_for_port_file(self._port_files[task.name], timeout_s,
                                            name=task.name, alive=alive)
        return f"{self.host}:{port}"

    def worker_addresses(self) -> list[str]:
        # Workers do not listen yet; a free port keeps their names valid addresses.
        return [f"{self.host}:{cluster_lib.free_port(self.host)}"
                for _ in range(self.num_workers)]

    def start_worker(self, i: int, command: list[str], extra, out, tmp: str) -> Task:
        extra = {**extra, progress.STATUS_FILE_ENV: os.path.join(tmp, f"worker-{i}.status.json")}
        return self._start(self.worker_name(i), list(command), extra, out)


class _Cluster:
    """Everything needed to start the cluster; `run` starts one attempt."""

    def __init__(self, command, placement, scheduler, startup_timeout_s, out, base_env,
                 client_security, ps_flags, progress_interval_s, verbose, devices=None):
        self.command, self.placement, self.scheduler = command, placement, scheduler
        self.startup_timeout_s = startup_timeout_s
        self.out, self.base_env, self.client_security = out, base_env, client_security
        self.ps_flags, self.progress_interval_s = ps_flags, progress_interval_s
        self.verbose = verbose
        self.devices = devices  # worker i's CUDA_VISIBLE_DEVICES; None: left alone

    def run(self, stopping: threading.Event, attempt: int | None) -> tuple[int, str]:
        """Starts the PS tasks, then the workers, and supervises them until the end.

        Returns:
          The exit code, and why the cluster failed ("" when it did not, or
          was interrupted).
        """
        tasks: list[Task] = []
        board = board_lib.Board(interval_s=self.progress_interval_s, verbose=self.verbose)
        place = self.placement
        num_workers, num_ps = place.num_workers, place.num_ps
        try:
            with tempfile.TemporaryDirectory(prefix="prophet-tf-launch-") as tmp:
                for i in range(num_ps):
                    ps_args = ["--num-workers", str(num_workers), "--ps-index", str(i),
                               "--num-ps", str(num_ps), *self.ps_flags(i)]
                    # A PS computes on the CPU: with --gpus, no GPU memory.
                    extra = {CUDA_DEVICES_ENV: ""} if self.devices is not None else {}
                    tasks.append(place.start_ps(i, ps_args, extra, self.out, tmp))
                    board.add(tasks[-1].name, "ps")
                addresses = [place.ps_address(task, i, self.startup_timeout_s,
                                              _alive(task, stopping, "it listened"))
                             for i, task in enumerate(tasks)]
                for task, address in zip(list(tasks), addresses):
                    _wait_healthy(task, address, self.startup_timeout_s, stopping,
                                  self.client_security)
                    board.healthy(task.name, address)
                cluster = {"worker": place.worker_addresses(), "ps": addresses}
                worker_tasks = []
                for i in range(num_workers):
                    extra = {"TF_CONFIG": json.dumps({"cluster": cluster,
                                                      "task": {"type": "worker", "index": i}}),
                             # Relay workers' lines as printed.
                             "PYTHONUNBUFFERED": self.base_env.get("PYTHONUNBUFFERED", "1")}
                    if self.scheduler:
                        extra[environment.SCHEDULER] = self.scheduler
                    if self.devices is not None:
                        extra[CUDA_DEVICES_ENV] = self.devices[i]
                    worker_tasks.append(place.start_worker(i, self.command, extra, self.out, tmp))
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
        usage="prophet-tf launch (--workers N | --gpus N | --hosts H[:N],...) [--ps M] "
              "[--scheduler S] [--restart K] [--checkpoint-dir D] [--log-level L] "
              "[--ssh-... ] [--env NAME[=VALUE]] -- CMD [ARGS]")
    parser.add_argument("--workers", type=int, default=None,
                        help="number of worker processes (required unless --gpus gives it)")
    parser.add_argument("--gpus", type=int, default=None, metavar="N",
                        help="this host has N GPUs: run N workers, one per GPU. Worker i gets "
                             f"{CUDA_DEVICES_ENV}=the i-th entry of ${CUDA_DEVICES_ENV} if set, "
                             f"else i; PS tasks get {CUDA_DEVICES_ENV}=\"\" (--workers, if "
                             "given, must be N)")
    parser.add_argument("--hosts", default=None, metavar="H[:N],...",
                        help="start the tasks over ssh on these hosts: N workers on host H (1 "
                             "if left out) and --ps PS tasks on every host; in this directory "
                             "and with this Python on each (see docs/guide.md)")
    parser.add_argument("--ps", type=int, default=1,
                        help="number of PS tasks (default 1); with --hosts, on every host")
    parser.add_argument("--scheduler", default=None,
                        help="gradient scheduler for every worker, a name or name:option=value,... "
                             "(e.g. prophet:blocks_in_flight=4); sets PROPHET_TF_SCHEDULER")
    parser.add_argument("--host", default=None,
                        help="address the PS tasks bind (default 127.0.0.1; not with --hosts)")
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
    parser.add_argument("--env", action="append", default=[], metavar="NAME[=VALUE]",
                        help="set NAME in every task's environment; NAME alone sends this "
                             "environment's NAME to --hosts tasks (repeatable)")
    parser.add_argument("--ssh-port", type=int, default=None, metavar="P",
                        help="with --hosts: the hosts' ssh port (ssh -p)")
    parser.add_argument("--ssh-identity-file", default=None, metavar="FILE",
                        help="with --hosts: the private key ssh uses (ssh -i)")
    parser.add_argument("--ssh-option", action="append", default=[], metavar="KEY=VALUE",
                        help="with --hosts: passed to ssh as -o KEY=VALUE (repeatable)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    ssh_given = [flag for flag, value in (("--ssh-port", args.ssh_port), ("--ssh-option",
                 args.ssh_option or None), ("--ssh-identity-file", args.ssh_identity_file))
                 if value is not None]
    if args.hosts is not None:
        given = [f"{flag} {value}" for flag, value in (("--workers", args.workers), ("--gpus",
                 args.gpus), ("--host", args.host)) if value is not None]
        if given:
            parser.error("--hosts gives each host's workers (HOST:WORKERS) and binds the PS "
                         f"tasks on every interface of their hosts; leave out {', '.join(given)}"
                         f". Received: --hosts {args.hosts} with {', '.join(given)}")
    elif ssh_given:
        parser.error(f"{', '.join(ssh_given)} go with --hosts. Received: {', '.join(ssh_given)} "
                     "without --hosts")
    elif args.workers is None and args.gpus is None:
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
        hosts = None if args.hosts is None else remote_hosts.parse_hosts(args.hosts)
        ssh = remote_hosts.SshOptions(args.ssh_port, args.ssh_identity_file,
                                      tuple(args.ssh_option))
        return launch(command, num_workers, args.ps, args.scheduler, args.host or "127.0.0.1",
                      args.startup_timeout, restarts=args.restart,
                      checkpoint_dir=args.checkpoint_dir,
                      checkpoint_steps=args.checkpoint_steps,
                      checkpoint_secs=args.checkpoint_secs, log_level=args.log_level,
                      progress_interval_s=args.progress_interval,
                      verbose=logging.getLevelName(args.log_level) <= logging.INFO,
                      gpus=args.gpus, hosts=hosts, ssh=ssh,
                      env=remote_hosts.parse_env_items(args.env, os.environ))
    except (ValueError, RuntimeError, TimeoutError) as e:
        print(f"prophet-tf launch: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # e.g. the worker command does not exist
        print(f"prophet-tf launch: cannot start a task: {e}", file=sys.stderr)
        return 127 if isinstance(e, FileNotFoundError) else 126
