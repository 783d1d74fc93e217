"""One run of `prophet-tf bench`: its PS tasks and workers on the emulated cluster.

:func:`run_once` starts fresh PS tasks (``python -m prophet_tf ps``) and workers
(``python -m prophet_tf.bench.worker``) where :class:`Cluster` places them (a
host's network namespace, or loopback), each logging to a file of the bench's
working directory; samples their CPU time and the hosts' byte counters while the
workers train; and returns the workers' reports with what was measured around
them. Processes are supervised with ``prophet_tf.tools.processes``.
"""
from __future__ import annotations

import json
import os
import sys
import time

from prophet_tf import cluster as cluster_lib, environment
from prophet_tf.bench import ideal as ideal_lib
from prophet_tf.bench import link_load, message_costs, models, netns
from prophet_tf.bench import worker as worker_lib
from prophet_tf.bench.results import WARMUP_STEPS, busy_between, measured_window
from prophet_tf.tools import processes

__all__ = ["Cluster", "run_once", "worker_argv", "PS_PORT", "WORKER_PORT", "RUN_TIMEOUT_S",
           "SAMPLE_PERIOD_S"]

# Fixed: every host has its own namespace. A host's k-th PS task listens on
# PS_PORT + k.
PS_PORT, WORKER_PORT = 7080, 7070
RUN_TIMEOUT_S = 900.0
#: How long a run's PS tasks may take, together, to report their ports.
PS_START_TIMEOUT_S = 120.0
#: How long a task may take to exit after SIGTERM, and after SIGKILL.
STOP_GRACE_S = 10.0
#: How often a run's processes' CPU time and its hosts' byte counters are read.
SAMPLE_PERIOD_S = 0.1
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Cluster:
    """Where tasks run: namespaces of an EmulatedNetwork, or loopback.

    Hosts: dedicated, PS tasks 0..P-1 then workers; colocated, the workers
    only, PS task i on host ``i % workers``.
    """

    def __init__(self, network: netns.EmulatedNetwork | None, num_ps: int, workers: int,
                 layout: str = "dedicated"):
        self.network, self.num_ps, self.workers, self.layout = network, num_ps, workers, layout

    @staticmethod
    def hosts(num_ps: int, workers: int, layout: str) -> int:
        return workers if layout == "colocated" else num_ps + workers

    def ps_host(self, i: int) -> int:
        return i % self.workers if self.layout == "colocated" else i

    def worker_host(self, j: int) -> int:
        return j if self.layout == "colocated" else self.num_ps + j

    def ps_port(self, i: int) -> int:
        """The PS task's port in its namespace (0 on loopback: any free one)."""
        per_host = i // self.workers if self.layout == "colocated" else 0
        return PS_PORT + per_host if self.network else 0

    def ps_host_address(self, i: int) -> str:
        return self.network.addresses[self.ps_host(i)] if self.network else "127.0.0.1"

    def ps_address(self, i: int, port: int) -> str:
        return f"{self.ps_host_address(i)}:{port}"

    def worker_address(self, j: int) -> str:
        if self.network:
            return f"{self.network.addresses[self.worker_host(j)]}:{WORKER_PORT}"
        return f"127.0.0.1:{cluster_lib.free_port()}"

    def command(self, host: int, argv: list[str]) -> list[str]:
        return self.network.command(host, argv) if self.network else argv


def _env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1",
               TF_NUM_INTRAOP_THREADS=str(models.INTRA_OP_THREADS),
               TF_NUM_INTEROP_THREADS=str(models.INTER_OP_THREADS))
    env.pop("TF_CONFIG", None)
    env.pop(environment.SCHEDULER, None)
    env.update(extra or {})
    return env


def _stop(children: list[processes.ChildProcess]) -> None:
    for child in children:  # Every one signalled first: their exits overlap.
        child.terminate()
    for child in children:
        child.stop(STOP_GRACE_S, reap_timeout_s=STOP_GRACE_S)


def _log_tail(path: str) -> str:
    """The end of a task's log, for an error message: the bench's working
    directory, and the log with it, is gone by the time the user reads it."""
    with open(path, errors="replace") as f:
        return f.read()[-3000:]


def _did_not_start(i: int, ps: processes.ChildProcess, log_path: str) -> RuntimeError:
    return RuntimeError(f"PS {i} did not start (exit code {ps.poll()}); its log {log_path}:\n"
                        f"{_log_tail(log_path)}")


def _start_ps_tasks(cluster: Cluster, args, workdir: str, tag: str, timelines: str,
                    shape_env: dict, procs: list, logs: list) -> list[str]:
    """Starts the run's PS tasks (into ``procs``, their logs into ``logs``); returns
    their addresses once each has reported its port."""
    port_files = []
    for i in range(cluster.num_ps):
        port_file = os.path.join(workdir, f"{tag}-ps{i}.port")
        argv = [sys.executable, "-m", "prophet_tf", "ps", "--host",
                cluster.ps_host_address(i), "--port", str(cluster.ps_port(i)),
                "--num-workers", str(args.workers), "--ps-index", str(i),
                "--num-ps", str(cluster.num_ps), "--port-file", port_file]
        if args.timeline_dir:  # beside the workers' timelines
            argv += ["--timeline", os.path.join(timelines, f"ps-{i}.json")]
        log = open(os.path.join(workdir, f"{tag}-ps{i}.log"), "wb")
        logs.append(log)
        env = _env({"TF_NUM_INTEROP_THREADS": "1",
                    environment.TOKEN: shape_env[environment.TOKEN]})
        procs.append(processes.ChildProcess(
            f"ps {i}", cluster.command(cluster.ps_host(i), argv), env, stdout=log))
        port_files.append(port_file)
    addresses = []
    deadline = time.monotonic() + PS_START_TIMEOUT_S
    for i, port_file in enumerate(port_files):
        log_path = os.path.join(workdir, f"{tag}-ps{i}.log")

        def alive(i=i, log_path=log_path) -> None:
            if procs[i].poll() is not None:
                raise _did_not_start(i, procs[i], log_path)

        try:
            port = processes.wait_for_port_file(port_file, deadline - time.monotonic(),
                                                alive=alive)
        except TimeoutError:
            raise _did_not_start(i, procs[i], log_path) from None
        addresses.append(cluster.ps_address(i, port))
    return addresses


def worker_argv(framework: str, args, out: str, options: dict | None = None) -> list[str]:
    """The command of one bench worker (``prophet_tf.bench.worker``); ``options``:
    tf-mwms's (``bytes_per_pack``), the PS schedulers' go in the environment."""
    argv = [sys.executable, "-m", "prophet_tf.bench.worker", "--framework", framework,
            "--model", args.model, "--steps", str(args.steps), "--global-batch",
            str(args.global_batch), "--out", out]
    if args.compute == "emulated":
        argv += ["--compute", "emulated", "--scale", repr(args.scale)]
    if getattr(args, "global_clipnorm", None):
        argv += ["--global-clipnorm", repr(args.global_clipnorm)]
    if framework == "tf-mwms" and options:
        argv += ["--bytes-per-pack", str(int(options["bytes_per_pack"]))]
    return argv


def run_once(cluster: Cluster, scheduler: str, args, workdir: str, shape_env: dict,
             options: dict | None = None) -> dict:
    """One training run (``options``: the scheduler's); returns the workers' reports."""
    tag = f"{scheduler}-{time.monotonic_ns()}"
    timelines = os.path.join(args.timeline_dir or workdir, tag)
    framework = {"tf-mwms": "tf-mwms", "compute": "local"}.get(scheduler, "prophet")
    # The PS tasks' traces and run.json go beside the timelines too; a compute
    # run has no steps and no network to keep.
    keep_record = bool(args.timeline_dir) and framework != "local"
    if keep_record:
        os.makedirs(timelines, exist_ok=True)
    launched = time.monotonic()
    logs, procs = [], []
    try:
        addresses = []
        if framework == "prophet":
            addresses = _start_ps_tasks(cluster, args, workdir, tag, timelines, shape_env,
                                        procs, logs)
        num_ps = len(addresses)  # procs[:num_ps] are the PS tasks
        workers = [cluster.worker_address(j) for j in range(args.workers)]
        spec = {"worker": workers}
        if addresses:
            spec["ps"] = addresses
        outs, worker_procs = [], []
        ps_cpu: list[tuple] = []  # (time.monotonic(), each PS task's CPU seconds)
        for j in range(args.workers):
            out = os.path.join(workdir, f"{tag}-worker{j}.json")
            outs.append(out)
            extra = {"TF_CONFIG": json.dumps({"cluster": spec,
                                              "task": {"type": "worker", "index": j}})}
            if framework == "prophet":
                extra[environment.SCHEDULER] = scheduler.partition(":")[0] + (
                    ":" + ",".join(f"{k}={v}" for k, v in options.items()) if options else "")
                extra.update(shape_env)
                # Kept where asked, else in the work directory: the run's
                # message costs are measured from them (message_costs.py).
                extra[environment.TIMELINE] = timelines
            argv = worker_argv(framework, args, out, options)
            log = open(os.path.join(workdir, f"{tag}-worker{j}.log"), "wb")
            logs.append(log)
            p = processes.ChildProcess(f"worker {j}",
                                       cluster.command(cluster.worker_host(j), argv),
                                       _env(extra), stdout=log)
            procs.append(p)
            worker_procs.append(p)
        # One process per emulated host: its /proc entry shows the host's interface.
        host_pids = {}
        if cluster.network:
            for i in range(num_ps):
                host_pids.setdefault(cluster.ps_host(i), procs[i].pid)
            for j, p in enumerate(worker_procs):
                host_pids.setdefault(cluster.worker_host(j), p.pid)
        link_bytes: list[tuple] = []  # (time.monotonic(), {host: (received, sent)})
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while any(p.poll() is None for p in worker_procs):
            now = time.monotonic()
            ps_cpu.append((now, [worker_lib.cpu_seconds(procs[i].pid)
                                 for i in range(num_ps)]))
            link_bytes.append((now, {h: netns.interface_bytes(pid)
                                     for h, pid in host_pids.items()}))
            failed = [p for p in procs if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                break
            time.sleep(SAMPLE_PERIOD_S)
        bad = [(j, p.returncode) for j, p in enumerate(worker_procs) if p.returncode != 0]
        if bad or any(p.poll() not in (None, 0) for p in procs):
            j = bad[0][0] if bad else 0
            path = os.path.join(workdir, f"{tag}-worker{j}.log")
            tail = _log_tail(path)
            raise RuntimeError(f"{scheduler} run failed (worker exit codes "
                               f"{[p.poll() for p in worker_procs]}); worker {j} log {path}:\n"
                               f"{tail}")
        reports = [json.load(open(o)) for o in outs]
        # Each worker measured its own training; the PS tasks are sampled over
        # the time every worker trained (monotonic clocks are system-wide).
        busy = {}
        if num_ps:
            begin = max(r["train_window"][0] for r in reports)
            end = min(r["train_window"][1] for r in reports)
            busy = {f"ps{i}": busy_between(ps_cpu, i, begin, end)
                    for i in range(num_ps)}
        busy.update({f"worker{j}": r.get("cpu_busy") for j, r in enumerate(reports)})
        costs = (message_costs.measure(timelines, args.workers, cluster.num_ps, args.layout,
                                       WARMUP_STEPS) if framework == "prophet" else None)
        # Process start, imports, model and engine set-up, up to the first
        # batch of the last worker to get there (monotonic clocks are system-wide).
        starts = [r["train_window"][0] for r in reports if "train_window" in r]
        startup = max(starts) - launched if starts else None
        loads = phases = rate = None  # a compute run has no steps; an unshaped link no rate
        host_worker = {cluster.worker_host(j): j for j in range(len(reports))}
        if framework != "local" and cluster.network and cluster.network.bandwidth_mbit:
            rate = ideal_lib.payload_bytes_per_s(cluster.network.bandwidth_mbit)
            loads = link_load.link_loads(link_bytes, measured_window(reports, WARMUP_STEPS),
                                         rate)
            phases = link_load.link_phases(link_bytes, reports, host_worker, WARMUP_STEPS, rate)
        if keep_record:
            _keep_run_record(timelines, reports, link_bytes, host_worker, rate)
        return {"reports": reports, "cpu_busy": busy, "message_costs": costs,
                "startup_s": startup, "link_load": loads, "link_phases": phases}
    finally:
        _stop(procs)
        for log in logs:
            log.close()


def _keep_run_record(directory: str, reports: list[dict], link_bytes: list[tuple],
                     host_worker: dict, payload_bytes_per_s: float | None) -> None:
    """Writes ``run.json`` beside the run's timelines: each worker's step
    marks and the raw interface counters, all on the monotonic clock the
    timelines use, so a step's link load can be read beside its events
    (bench/breakdown.py), and the links' payload rate (None:
    not shaped)."""
    record = {"payload_bytes_per_s": payload_bytes_per_s,
              "workers": [{"train_window": r["train_window"], "step_times_s": r["step_times_s"]}
                          for r in reports],
              "host_worker": {str(h): j for h, j in host_worker.items()},
              "link_bytes": [[t, {str(h): c for h, c in counts.items()}]
                             for t, counts in link_bytes]}
    with open(os.path.join(directory, "run.json"), "w") as f:
        json.dump(record, f)
