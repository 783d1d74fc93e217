"""`prophet-tf bench`: schedulers side by side on an emulated bandwidth-limited cluster.

    prophet-tf bench                      # the default configuration (below)
    prophet-tf bench --model cnn --workers 2 --layout dedicated --ps 1 \\
        --bandwidth-mbit 300 --steps 30 --reps 5 \\
        --schedulers fifo,p3,bytescheduler,prophet,tf-mwms --json out.json

Every host runs in its own network namespace with a shaped link
(``prophet_tf.bench.netns``); one network serves the whole invocation. The
layout says where PS tasks live: ``colocated`` (the default, as BytePS and
most deployments run) puts PS task i on worker host ``i % workers``, sharing
that host's link, with ``--ps`` = ``--workers`` unless given (a multiple of
it); ``dedicated`` gives each PS task a host of its own (``--ps`` default 1).
Repetitions are interleaved (rep 1: every scheduler, rep 2: every scheduler,
...) so that noise from the shared machine hits all of them alike. In the
first ``--compute-reps`` reps, a ``compute`` run first profiles the model on
every worker host at once with no communication (each worker on its share of
the batch; ``models.profile_model``): its forward + backward time is the
compute time C of the ideal bound, and the profile (per-variable compute
under the same CPU sharing) goes into the JSON's config, for the ideal bound
and for ``prophet-tf simulate --validate``.

Per run: fresh PS tasks (``python -m prophet_tf ps``) and workers
(``python -m prophet_tf.bench.worker``), which report every step's time. The
first :data:`WARMUP_STEPS` steps are dropped for every scheduler alike
(Prophet skips 2 and profiles 5 iterations, and plans when the 8th begins);
the run's step time is the median over the remaining steps of the mean over
workers. A scheduler's ``step_time_s`` is the median of its runs' step times
(``step_time_s_all``).

Compute (``--compute``): ``real`` trains the model itself, on the CPUs the PS
tasks and the transport also need; ``emulated`` trains the emulated model of
the model's saved profile (``prophet_tf.bench.emulated``: real variables and
gradients, compute time that uses no CPU, as on a GPU worker), the profile's
times scaled so that a step computes ``--compute-ms`` (default: as profiled),
and the paper's models (``resnet50``, ``vgg16``, ``inceptionv3``) can run.
``--time-scale k`` multiplies compute times and latency by k and divides the
links' bandwidth by k: the compute/communication ratio of the cluster asked
for (``--bandwidth-mbit``) is kept while the transport moves k times fewer
bytes per second, which 2 cores can carry. Step times are reported as
measured and, divided by k, at the cluster's scale. Every run records each
process' CPU busy fraction (CPU time over wall time); the bench warns when
the processes together keep the machine's cores busy, since then the
machine, not the emulated network, sets the step time.

Every prophet_tf run records its workers' timelines (kept with
``--timeline-dir``, else in a temporary directory) and the JSON carries what a
message cost at its ends in that run (``message_costs``: per message and per
byte, measured from the pushes to the PS on the worker's own host), which
``prophet-tf simulate --validate`` uses.

Without network namespaces (not root, no iproute2), the workers' transport
shapes itself (``PROPHET_TF_SHAPE_MBIT``, a token bucket per PS connection
and direction, see ``prophet_tf.ps.shaping``) on loopback: the output says
so; PS links are then not shared between workers, and tf-mwms is not shaped.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time

from prophet_tf import cluster as cluster_lib, environment
from prophet_tf.bench import ideal as ideal_lib
from prophet_tf.bench import link_load, message_costs, models, netns, saved_profiles
from prophet_tf.bench import suite as suite_lib
from prophet_tf.bench import worker as worker_lib
from prophet_tf.engine import engine as engine_lib
from prophet_tf.engine import schedulers as schedulers_lib

__all__ = ["run_bench", "main", "DEFAULTS", "WARMUP_STEPS"]

logger = logging.getLogger(__name__)

WARMUP_STEPS = schedulers_lib.ProphetScheduler.ITERATIONS_BEFORE_PLAN
ALL_SCHEDULERS = ("fifo", "p3", "bytescheduler", "prophet", "tf-mwms")
#: The target configuration: the bench CNN, 2 workers with a PS task on each
#: worker host, global batch 64, and 200 Mbit/s per link (each host link
#: carries 4.47 MB each way per step, as one link of an all-reduce does).
#: ``ps`` None: one per worker host (colocated), else 1.
DEFAULTS = {"model": "cnn", "workers": 2, "layout": "colocated", "ps": None,
            "bandwidth_mbit": 200.0, "host_queue": "fair",
            "latency_ms": 0.0, "steps": 30, "reps": 5, "global_batch": 64,
            "schedulers": ",".join(ALL_SCHEDULERS)}
# Fixed: every host has its own namespace. A host's k-th PS task listens on
# PS_PORT + k.
PS_PORT, WORKER_PORT = 7080, 7070
RUN_TIMEOUT_S = 900.0
#: How often a run's processes' CPU time and its hosts' byte counters are read.
SAMPLE_PERIOD_S = 0.1
COMPUTE_MODES = ("real", "emulated")
#: Above this share of the machine's cores in use by a run's processes, the
#: machine rather than the emulated network may set the step time. Measured
#: (README, "The transport budget"): ResNet-50 runs at 0.79-0.84 of the cores
#: took 9-18% longer at the cluster's scale than at 0.62-0.68 with half the
#: link rate; the kernel's share for TCP and the links is not counted here.
BUSY_WARNING = 0.75
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _Cluster:
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


def _stop(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


def _log_tail(path: str) -> str:
    """The end of a task's log, for an error message: the bench's working
    directory, and the log with it, is gone by the time the user reads it."""
    with open(path, errors="replace") as f:
        return f.read()[-3000:]


def _run_once(cluster: _Cluster, scheduler: str, args, workdir: str, shape_env: dict,
              options: dict | None = None) -> dict:
    """One training run (``options``: the scheduler's); returns the workers' reports."""
    tag = f"{scheduler}-{time.monotonic_ns()}"
    timelines = os.path.join(args.timeline_dir or workdir, tag)
    if args.timeline_dir:  # the PS tasks' traces and run.json go there too
        os.makedirs(timelines, exist_ok=True)
    launched = time.monotonic()
    logs, procs = [], []
    try:
        ps_addresses = []
        framework = {"tf-mwms": "tf-mwms", "compute": "local"}.get(scheduler, "prophet")
        if framework == "prophet":
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
                procs.append(subprocess.Popen(cluster.command(cluster.ps_host(i), argv), stdout=log,
                                              stderr=subprocess.STDOUT, env=env))
                ps_addresses.append((port_file, i))
            addresses = []
            deadline = time.monotonic() + 120
            for port_file, i in ps_addresses:
                while not os.path.exists(port_file):
                    if procs[i].poll() is not None or time.monotonic() > deadline:
                        path = os.path.join(workdir, f"{tag}-ps{i}.log")
                        raise RuntimeError(f"PS {i} did not start (exit code "
                                           f"{procs[i].poll()}); its log {path}:\n"
                                           f"{_log_tail(path)}")
                    time.sleep(0.05)
                addresses.append(cluster.ps_address(i, int(open(port_file).read())))
        else:
            addresses = []
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
            argv = [sys.executable, "-m", "prophet_tf.bench.worker", "--framework", framework,
                    "--model", args.model, "--steps", str(args.steps), "--global-batch",
                    str(args.global_batch), "--out", out]
            if args.compute == "emulated":
                argv += ["--compute", "emulated", "--scale", repr(args.scale)]
            log = open(os.path.join(workdir, f"{tag}-worker{j}.log"), "wb")
            logs.append(log)
            p = subprocess.Popen(cluster.command(cluster.worker_host(j), argv), stdout=log,
                                 stderr=subprocess.STDOUT, env=_env(extra))
            procs.append(p)
            worker_procs.append(p)
        # One process per emulated host: its /proc entry shows the host's interface.
        host_pids = {}
        if cluster.network:
            for i in range(len(ps_addresses)):
                host_pids.setdefault(cluster.ps_host(i), procs[i].pid)
            for j, p in enumerate(worker_procs):
                host_pids.setdefault(cluster.worker_host(j), p.pid)
        link_bytes: list[tuple] = []  # (time.monotonic(), {host: (received, sent)})
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while any(p.poll() is None for p in worker_procs):
            now = time.monotonic()
            ps_cpu.append((now, [worker_lib.cpu_seconds(procs[i].pid)
                                 for i in range(len(ps_addresses))]))
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
        if ps_addresses:
            begin = max(r["train_window"][0] for r in reports)
            end = min(r["train_window"][1] for r in reports)
            busy = {f"ps{i}": _busy_between(ps_cpu, i, begin, end)
                    for i in range(len(ps_addresses))}
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
            loads = link_load.link_loads(link_bytes, _measured_window(reports, WARMUP_STEPS),
                                         rate)
            phases = link_load.link_phases(link_bytes, reports, host_worker, WARMUP_STEPS, rate)
        if args.timeline_dir:
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


def _measured_window(reports: list[dict], warmup: int) -> tuple[float, float]:
    """When every worker was past its warm-up steps and none had finished."""
    begin = max(r["train_window"][0] + sum(r["step_times_s"][:warmup]) for r in reports)
    return begin, min(r["train_window"][1] for r in reports)


def _busy_between(samples: list[tuple], i: int, begin: float, end: float) -> float | None:
    """Process i's CPU time over wall time between the samples nearest ``begin`` and ``end``."""
    inside = [(t, cpu[i]) for t, cpu in samples if begin <= t <= end and cpu[i] is not None]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return None
    return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


def _loads_text(loads: dict | None) -> str:
    if not loads:
        return ""
    up = [v for v in loads["sent"] if v is not None]
    return (f"; links sent {min(up):.2f}-{max(up):.2f} of their rate, busiest "
            f"{link_load.busiest_load(loads):.2f}" if up else "")


def _median_or_none(values) -> float | None:
    """The median of the values that are not None; None if there is none."""
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _run_step_time(reports: list[dict], warmup: int) -> float:
    per_step = list(zip(*[r["step_times_s"] for r in reports]))
    measured = [statistics.fmean(s) for s in per_step[warmup:]]
    if not measured:
        raise RuntimeError(f"--steps must exceed the {warmup} warm-up steps")
    return statistics.median(measured)


def run_bench(args, out=sys.stdout) -> dict:
    """Runs the configuration of ``args`` (see :func:`_parse`); returns the JSON dict."""
    names = schedulers_lib.split_specs(args.schedulers)
    given: dict[str, dict] = {}  # scheduler spec -> the options it names
    for n in names:
        if n != "tf-mwms":
            _, given[n] = schedulers_lib.parse_scheduler(n)
    if args.steps <= WARMUP_STEPS:
        raise ValueError(f"--steps must exceed the {WARMUP_STEPS} warm-up steps. "
                         f"Received: --steps={args.steps}")
    if args.global_batch % args.workers:
        raise ValueError(f"--global-batch must be a multiple of --workers. Received: "
                         f"--global-batch={args.global_batch}, --workers={args.workers}")
    profile = saved_profiles.load_profile(args.model)
    # What the JSON records of the profile: the shipped one's name and hash
    # (and scale), unless a compute run below measures one.
    profile_record = saved_profiles.reference(args.model)
    if args.compute == "emulated":
        # The emulated model computes exactly its scaled profile.
        args.scale = args.time_scale * (args.compute_ms / 1e3 / profile["compute_s"]
                                        if args.compute_ms else 1.0)
        profile = saved_profiles.scaled_profile(profile, args.scale)
        profile_record = saved_profiles.reference(args.model, args.scale)
    link_mbit = args.bandwidth_mbit / args.time_scale
    latency_ms = args.latency_ms * args.time_scale
    network = None
    shaping = "netns"
    # The PS tasks listen on namespace addresses, not loopback: they need a
    # shared token (prophet_tf.ps.security); a fresh one per invocation.
    shape_env: dict = {environment.TOKEN: secrets.token_hex(16)}
    ok, why = netns.available(need_latency=args.latency_ms > 0)
    if ok and args.host_queue == "fair":
        fair_ok, fair_why = netns.available(need_fair_queue=True)
        if not fair_ok:
            raise SystemExit(f"prophet-tf bench: --host-queue fair cannot be built here "
                             f"({fair_why}); pass --host-queue fifo")
    if ok:
        netns.cleanup_leftovers()  # of runs that were killed before their teardown
    else:
        shaping = "transport"
        shape_env[environment.SHAPE_MBIT] = str(link_mbit)
        print(f"prophet-tf bench: network namespaces unavailable ({why}); shaping inside the "
              f"transport instead (token bucket per worker connection, "
              f"PROPHET_TF_SHAPE_MBIT={link_mbit}); PS links are not shared and "
              f"tf-mwms is unshaped", file=out, flush=True)
    # The namespaces' tbf counts TCP/IP headers; the transport's bucket does not.
    framing = ideal_lib.TCP_FRAMING if shaping == "netns" else 1.0
    runs = {n: [] for n in ["compute"] + names}
    options = {n: o for n, o in given.items() if o}  # scheduler spec -> its options
    search: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="prophet-tf-bench-") as workdir:
        if ok:
            network = netns.EmulatedNetwork(
                _Cluster.hosts(args.ps, args.workers, args.layout), link_mbit, latency_ms,
                host_queue=args.host_queue)
        try:
            if network:
                network.open()
                where = (f"{args.workers} worker hosts, {args.ps} PS task(s) on them"
                         if args.layout == "colocated" else
                         f"{args.ps} PS + {args.workers} worker hosts")
                scaled = (f" (a {args.bandwidth_mbit:g} Mbit/s cluster at time scale "
                          f"{args.time_scale:g})" if args.time_scale != 1 else "")
                print(f"prophet-tf bench: emulated network {network.run_id}: {where}, "
                      f"{link_mbit:g} Mbit/s per link each way, latency "
                      f"{latency_ms:g} ms{scaled}, {args.host_queue} host queues", file=out,
                      flush=True)
            cluster = _Cluster(network, args.ps, args.workers, args.layout)
            # Emulated compute is its profile: nothing to measure.
            compute_reps = 0 if args.compute == "emulated" else min(args.reps, args.compute_reps)
            for rep in range(args.reps):
                order = (["compute"] if rep < compute_reps else []) + names
                for name in order:
                    if name == "bytescheduler" and "bytescheduler" not in options:
                        options["bytescheduler"], search = _tune_bytescheduler(
                            args, runs["compute"], profile, framing, out)
                    t0 = time.monotonic()
                    result = _run_once(cluster, name, args, workdir, shape_env,
                                       options.get(name))
                    step = (statistics.fmean(r["profile"]["compute_s"] for r in result["reports"])
                            if name == "compute" else
                            _run_step_time(result["reports"], WARMUP_STEPS))
                    runs[name].append({"step_time_s": step, "reports": result["reports"],
                                       "cpu_busy": result["cpu_busy"],
                                       "link_load": result["link_load"],
                                       "link_phases": result["link_phases"],
                                       "message_costs": result["message_costs"],
                                       "startup_s": result["startup_s"]})
                    busy = [b for b in result["cpu_busy"].values() if b is not None]
                    print(f"rep {rep + 1}/{args.reps} {name:>13}: step {step * 1e3:8.1f} ms "
                          f"(run {time.monotonic() - t0:.0f} s"
                          + (f", {result['startup_s']:.0f} s to the first batch"
                             if result["startup_s"] is not None else "")
                          + f", CPU busy {sum(busy):.2f} of "
                          f"{os.cpu_count()} cores, most {max(busy, default=0):.2f}"
                          + _loads_text(result["link_load"]) + ")",
                          file=out, flush=True)
                    if sum(busy) > BUSY_WARNING * (os.cpu_count() or 1):
                        print(f"prophet-tf bench: WARNING: the {name} run kept "
                              f"{sum(busy):.2f} of {os.cpu_count()} cores busy: the machine, "
                              f"not the emulated network, may set its step time",
                              file=out, flush=True)
        finally:
            if network:
                network.close()
    if runs["compute"]:
        # The compute run nearest the median: its worker-0 profile (measured
        # with every worker computing at once) is the one of this configuration.
        compute_s = statistics.median(r["step_time_s"] for r in runs["compute"])
        nearest = min(runs["compute"], key=lambda r: abs(r["step_time_s"] - compute_s))
        profile = profile_record = nearest["reports"][0]["profile"]
        compute_s = profile["compute_s"]
    else:
        compute_s = profile["compute_s"]
    bound = ideal_lib.ideal_step_time(profile, args.workers, args.ps, link_mbit,
                                      latency_ms, layout=args.layout, framing=framing)
    config = {"model": args.model, "workers": args.workers, "ps": args.ps,
              "layout": args.layout,
              "scheduler_settings": {n: scheduler_settings(n, profile, args.ps,
                                                           options.get(n))
                                     for n in names if n != "tf-mwms"},
              "bytescheduler_search": search,
              "bandwidth_mbit": args.bandwidth_mbit, "latency_ms": args.latency_ms,
              "host_queue": args.host_queue if shaping == "netns" else None,
              "compute": args.compute, "compute_scale": args.scale,
              "time_scale": args.time_scale, "link_mbit": link_mbit,
              "link_latency_ms": latency_ms,
              "steps": args.steps, "warmup_steps": WARMUP_STEPS, "reps": args.reps,
              "global_batch": args.global_batch, "schedulers": names, "shaping": shaping,
              # The workers inherit the bench's environment (runs A/B it with "0").
              "answers_first": os.environ.get(engine_lib.ANSWERS_FIRST_ENV, "1") != "0",
              "num_params": profile["num_params"], "model_bytes": profile["trainable_bytes"],
              "compute_s": compute_s, "compute_s_all": [r["step_time_s"] for r in runs["compute"]],
              "ideal": bound, "threads": {"intra_op": models.INTRA_OP_THREADS,
                                          "inter_op": models.INTER_OP_THREADS},
              "profile": profile_record}
    results = []
    for name in names:
        times = [r["step_time_s"] for r in runs[name]]
        step = statistics.median(times)
        busy = [r["cpu_busy"] for r in runs[name]]
        results.append({"scheduler": name, "step_time_s": step, "step_time_s_all": times,
                        "cluster_step_time_s": step / args.time_scale,
                        "cpu_busy": {p: statistics.median(b[p] for b in busy
                                                          if b.get(p) is not None)
                                     for p in busy[0] if any(b.get(p) is not None
                                                             for b in busy)},
                        "samples_per_s": args.global_batch / step,
                        "message_costs": message_costs.combine(
                            [r["message_costs"] for r in runs[name]]),
                        "startup_s": _median_or_none(r["startup_s"] for r in runs[name]),
                        "link_load": link_load.median_loads([r["link_load"] for r in runs[name]]),
                        "link_phases": link_load.median_loads(
                            [r["link_phases"] for r in runs[name]]),
                        "ideal_step_time_s": bound["ideal_s"],
                        "per_step_s": [[statistics.fmean(s) for s in zip(
                            *[w["step_times_s"] for w in r["reports"]])] for r in runs[name]]})
    return {"config": config, "results": results}


def _tune_bytescheduler(args, compute_runs: list, profile: dict, framing: float,
                        out) -> tuple[dict, list]:
    """ByteScheduler's partition size and credit for this configuration
    (``tuning.py``), from this bench's measured profile when it has one."""
    from prophet_tf.bench import tuning

    if compute_runs:
        profile = compute_runs[0]["reports"][0]["profile"]
    chosen, rows = tuning.tune_bytescheduler(
        profile, args.workers, args.ps, args.bandwidth_mbit / args.time_scale,
        latency_ms=args.latency_ms * args.time_scale, layout=args.layout, framing=framing)
    print(f"prophet-tf bench: bytescheduler tuned over {len(rows)} settings (simulated): "
          f"partition_bytes={chosen['partition_bytes']}, credit_bytes={chosen['credit_bytes']}",
          file=out, flush=True)
    return chosen, rows


def scheduler_settings(name: str, profile: dict, num_ps: int,
                       options: dict | None = None) -> dict:
    """What a scheduler runs with in this configuration: its options, the
    partition size the workers declare (balanced over the PS tasks), and its
    in-flight window per link."""
    from prophet_tf.bench import simulate  # the profile's specs, as simulated
    from prophet_tf.engine.dispatch import Dispatch

    scheduler = schedulers_lib.make_scheduler(name.partition(":")[0], **(options or {}))
    specs = simulate.specs_of(profile)
    dispatch = Dispatch([s.key for s in specs], specs, num_ps, scheduler)
    options = {k: getattr(scheduler, k) for k in scheduler.OPTIONS}
    return {**options, "partition_bytes": dispatch.partition_bytes,
            "partitions": len(dispatch.partitions), "window_blocks": scheduler.window_blocks,
            "window_bytes": scheduler.window_bytes}


def print_table(result: dict, out=sys.stdout) -> None:
    c = result["config"]
    k = c.get("time_scale", 1.0)
    scale = (f", time scale {k:g} (links {c['link_mbit']:g} Mbit/s; 'cluster ms' = step / {k:g})"
             if k != 1 else "")
    print(f"\nmodel {c['model']} ({c['num_params']:,} parameters, "
          f"{c.get('compute', 'real')} compute), {c['workers']} workers, "
          f"{c['ps']} PS ({c.get('layout', 'dedicated')}), {c['bandwidth_mbit']:g} Mbit/s, "
          f"latency {c['latency_ms']:g} ms{scale}, "
          f"global batch {c['global_batch']}, {c['steps']} steps ({c['warmup_steps']} warm-up), "
          f"{c['reps']} reps, shaping: {c['shaping']}"
          + (f" ({c['host_queue']} host queues)" if c.get("host_queue") else ""), file=out)
    b = c["ideal"]
    print(f"compute {c['compute_s'] * 1e3:.1f} ms; ideal {b['ideal_s'] * 1e3:.1f} ms = max("
          f"compute {b['compute_s'] * 1e3:.1f}, busiest link {b['busiest_link_s'] * 1e3:.1f}, "
          f"critical chain {b['chain_s'] * 1e3:.1f} of variable {b['chain_variable']})",
          file=out)
    fifo = next((r["step_time_s"] for r in result["results"] if r["scheduler"] == "fifo"), None)
    cluster = f" {'cluster ms':>10}" if k != 1 else ""
    print(f"{'scheduler':>13} {'step ms':>9} {'min-max ms':>15} {'samples/s':>10} "
          f"{'vs fifo':>8} {'vs ideal':>9} {'CPU busy':>8} {'link load':>9}{cluster}",
          file=out)
    for r in result["results"]:
        lo, hi = min(r["step_time_s_all"]), max(r["step_time_s_all"])
        vs = f"{r['step_time_s'] / fifo:.2f}" if fifo else "-"
        busy = sum((r.get("cpu_busy") or {}).values())
        at_scale = f" {r['step_time_s'] / k * 1e3:10.1f}" if k != 1 else ""
        load = link_load.busiest_load(r.get("link_load"))
        load = "-" if load is None else f"{load:.2f}"
        print(f"{r['scheduler']:>13} {r['step_time_s'] * 1e3:9.1f} "
              f"{lo * 1e3:7.1f}-{hi * 1e3:<7.1f} {r['samples_per_s']:10.1f} {vs:>8} "
              f"{r['step_time_s'] / r['ideal_step_time_s']:9.2f} {busy:8.2f} {load:>9}"
              f"{at_scale}", file=out)


def _parse(argv):
    d = DEFAULTS
    parser = argparse.ArgumentParser(
        prog="prophet-tf bench", description=__doc__.split("\n\n")[0],
        epilog=f"Defaults (the target configuration): --model {d['model']} --workers "
               f"{d['workers']} --layout {d['layout']} --bandwidth-mbit {d['bandwidth_mbit']:g} "
               f"--steps {d['steps']} --reps {d['reps']} --global-batch {d['global_batch']} "
               f"--schedulers {d['schedulers']}. The first {WARMUP_STEPS} steps of every run "
               "are warm-up (Prophet's 2 skipped + 5 profiled iterations, and the "
               "one that plans) and are left out for every scheduler.")
    parser.add_argument("--model", default=d["model"], choices=models.MODELS + models.APPLICATIONS,
                        help="the paper's models (resnet50, vgg16, inceptionv3) need "
                             "--compute emulated")
    parser.add_argument("--compute", default="real", choices=COMPUTE_MODES,
                        help="real: train the model; emulated: its profile's compute "
                             "times without using a CPU (default %(default)s)")
    parser.add_argument("--compute-ms", type=float, default=None,
                        help="emulated: one step's compute per worker (default: as profiled)")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="emulated: compute and latency x k, link bandwidth / k "
                             "(default 1)")
    parser.add_argument("--workers", type=int, default=d["workers"],
                        help="worker processes, each on an emulated host of its own "
                             "(default %(default)s)")
    parser.add_argument("--layout", default=d["layout"], choices=ideal_lib.LAYOUTS,
                        help="colocated: PS tasks on the worker hosts; dedicated: hosts of "
                             "their own (default %(default)s, as in `prophet-tf simulate`)")
    parser.add_argument("--ps", type=int, default=d["ps"],
                        help="PS tasks (default: one per worker host when colocated, else 1)")
    parser.add_argument("--bandwidth-mbit", type=float, default=d["bandwidth_mbit"],
                        help="each host link's bandwidth, each direction")
    parser.add_argument("--latency-ms", type=float, default=d["latency_ms"],
                        help="one-way latency between two hosts")
    parser.add_argument("--host-queue", default=d["host_queue"], choices=netns.HOST_QUEUES,
                        help="how each emulated host queues what it sends: fair (its "
                             "connections in turn, as fq_codel) or fifo (one queue) "
                             "(default %(default)s)")
    parser.add_argument("--steps", type=int, default=d["steps"], help="steps per run")
    parser.add_argument("--reps", type=int, default=d["reps"], help="interleaved repetitions")
    parser.add_argument("--global-batch", type=int, default=d["global_batch"],
                        help="samples per step over all workers, split evenly (a multiple of --workers) "
                             "(default %(default)s)")
    parser.add_argument("--schedulers", default=d["schedulers"],
                        help="comma-separated: fifo, p3, bytescheduler, prophet, tf-mwms; a "
                             "scheduler may name options (prophet:partition_bytes=200000)")
    parser.add_argument("--compute-reps", type=int, default=2,
                        help="compute-only runs (first reps); 0 = the profile's compute time")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--timeline-dir", default=None,
                        help="keep each prophet_tf run's worker and PS timelines here, "
                             "with its step marks and link counters (run.json)")
    parser.add_argument("--suite", default=None, choices=sorted(suite_lib.SUITES),
                        help="run a grid of configurations into one JSON (paper: the "
                             "paper's models, bandwidths and worker counts; smoke: a "
                             "one-minute check); the suite sets every option but --json "
                             "and --timeline-dir, and an existing --json of the same suite "
                             "is resumed")
    args = parser.parse_args(argv)
    if args.suite:
        defaults = vars(parser.parse_args([]))
        given = sorted(k for k, v in vars(args).items()
                       if k not in ("suite", "json", "timeline_dir") and v != defaults[k])
        if given:
            parser.error(f"--suite sets every option but --json and --timeline-dir. "
                         f"Received: {', '.join('--' + k.replace('_', '-') for k in given)}")
        return args
    if args.ps is None:
        args.ps = args.workers if args.layout == "colocated" else 1
    if args.compute == "real" and (args.model not in models.MODELS or args.compute_ms
                                   or args.time_scale != 1):
        parser.error(f"--model {args.model}, --compute-ms and --time-scale need --compute "
                     f"emulated (this machine computes only {', '.join(models.MODELS)} for "
                     f"real). Received: --model={args.model}, --compute-ms={args.compute_ms}, "
                     f"--time-scale={args.time_scale}")
    if not args.time_scale > 0 or (args.compute_ms is not None and not args.compute_ms > 0):
        parser.error(f"--time-scale and --compute-ms must be > 0. Received: "
                     f"--time-scale={args.time_scale}, --compute-ms={args.compute_ms}")
    args.scale = 1.0  # run_bench sets it for emulated compute
    if args.layout == "colocated" and args.workers >= 1 and args.ps % args.workers:
        parser.error(f"--layout colocated puts the same number of PS tasks on every worker "
                     f"host: --ps must be a multiple of --workers. Received: --ps={args.ps}, "
                     f"--workers={args.workers}")
    if args.workers < 1 or args.ps < 1 or args.reps < 1 or not args.bandwidth_mbit > 0 \
            or args.latency_ms < 0:
        parser.error(f"need --workers, --ps, --reps >= 1, --bandwidth-mbit > 0, --latency-ms "
                     f">= 0. Received: --workers={args.workers}, --ps={args.ps}, "
                     f"--reps={args.reps}, --bandwidth-mbit={args.bandwidth_mbit}, "
                     f"--latency-ms={args.latency_ms}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.suite:
        return _main_suite(args)
    try:
        result = run_bench(args)
    except (ValueError, RuntimeError, FileNotFoundError, netns.NetnsUnavailable) as e:
        print(f"prophet-tf bench: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("prophet-tf bench: interrupted; the emulated network was removed", file=sys.stderr)
        return 130
    print_table(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"results written to {args.json}")
    return 0


def _run_cell(argv: list[str], out) -> dict:
    """One cell of a suite: `prophet-tf bench ARGV`, its table printed to ``out``."""
    bench = run_bench(_parse(argv), out)
    print_table(bench, out)
    return bench


def _main_suite(args) -> int:
    try:
        result = suite_lib.run_suite(args.suite, args.json, _run_cell, DEFAULTS["host_queue"],
                                     args.timeline_dir)
    except (ValueError, RuntimeError, FileNotFoundError, netns.NetnsUnavailable) as e:
        print(f"prophet-tf bench: suite {args.suite}: {e}", file=sys.stderr)
        if args.json:
            print(f"prophet-tf bench: the cells finished so far are in {args.json}; the same "
                  f"command resumes", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("prophet-tf bench: interrupted; the emulated network was removed", file=sys.stderr)
        return 130
    walls = [c["wall_s"] for c in result["cells"] if "wall_s" in c]
    print(f"\nsuite {args.suite}: {len(result['cells'])} cells, "
          f"{result['elapsed_s'] / 60:.1f} min in this invocation"
          + (f", {sum(walls) / 60:.1f} min over {len(walls)} timed cell(s)" if walls else ""))
    suite_lib.print_summary(result)
    if args.json:
        print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
