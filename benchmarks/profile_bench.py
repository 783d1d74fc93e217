"""Where the CPU of a default bench run goes, per step: by process, by kind of
thread, and the Python code that holds the interpreter.

    .venv/bin/python benchmarks/profile_bench.py [--schedulers prophet,tf-mwms] \\
        [--steps 70] [--window 6] [--json benchmarks/profile-default.json]

Runs ``prophet-tf bench --reps 1 --compute-reps 0`` (the default bench: the CNN,
2 workers, 2 colocated PS tasks, 200 Mbit/s; as root, for its network
namespaces) once per scheduler. Once a run is past its warm-up (its first
worker's host has sent ``--start-mb`` MB), for ``--window`` seconds it measures
every worker and PS process:

* each thread's CPU time (``/proc/PID/task/TID/stat``, user + system) at the
  window's start and end, grouped by the thread's name: Python's own threads
  (the main thread and every ``threading.Thread``) carry the interpreter's
  name, gRPC's core threads (``grpc_global_tim``, ``default-executo``, ...)
  and TensorFlow's C++ threads (``tf_*``) their own;
* ``py-spy record --gil --nonblocking`` of each process over the same window:
  a sample of whichever thread holds the GIL, 100 times a second. Each sample
  is counted for the innermost frame of the project's own code in its stack
  (else of gRPC, protobuf, Keras, TensorFlow or numpy), so a function's share
  includes what it calls in other packages. A sample is the interpreter's
  CPU only while that thread runs; a thread that waits without releasing the
  GIL would be counted too (none of grpcio's waits does).

Per step: the window's CPU times the bench's step time over the window.
``py-spy`` comes with the ``profile`` extra: ``pip install -e ".[profile]"``.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

from prophet_tf.bench.netns import interface_bytes
from prophet_tf.bench.worker import cpu_seconds

ROOT = pathlib.Path(__file__).resolve().parents[1]
_THREAD_KINDS = (  # (kind, pattern of the OS thread name); the first that matches
    ("grpc", re.compile(r"^(grpc|default-execut|resolver-execu|timer_manager|"
                        r"event_engine|global-cq|ev_|EventEngine)", re.I)),
    ("tensorflow", re.compile(r"^tf_", re.I)),
)
# Frames are attributed to the innermost one of these, searched in this order.
_OWNERS = (("prophet_tf", "/prophet_tf/"), ("grpc", "/grpc/"), ("protobuf", "/google/protobuf/"),
           ("keras", "/keras/"), ("tensorflow", "/tensorflow/"), ("numpy", "/numpy/"))


def descendants(pid: int) -> list[int]:
    children = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rpartition(")")[2].split()[1])
            except OSError:
                continue
            children[ppid].append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def role(pid: int) -> str | None:
    """"worker" or "ps" for a bench run's training processes, else None."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return None
    if b"prophet_tf.bench.worker" in argv:
        return "worker"
    if b"prophet_tf" in argv and b"ps" in argv and argv[0] != b"ip":
        return "ps"
    return None


def thread_times(pid: int) -> dict[int, tuple[str, float]]:
    """tid -> (thread name, CPU seconds) of every thread of ``pid``."""
    times = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return times
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        cpu = cpu_seconds(f"{pid}/task/{tid}")
        if cpu is not None:
            times[int(tid)] = (name, cpu)
    return times


def thread_kind(name: str, process_name: str) -> str:
    for kind, pattern in _THREAD_KINDS:
        if pattern.match(name):
            return kind
    return "python" if name == process_name else "other"


def owner(stack: list[str]) -> str:
    """The innermost frame of the project's code (else of the first package of
    ``_OWNERS`` found innermost), as ``package: function (file)``."""
    for package, marker in _OWNERS:
        for frame in reversed(stack):
            name, _, where = frame.partition(" (")
            if marker in where:
                path = where.rsplit(":", 1)[0]
                short = path.split(marker, 1)[1]
                return f"{package}: {name} ({short})"
    return "other: " + (stack[-1].partition(" (")[0] if stack else "?")


def read_pyspy(path: str) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    if not os.path.exists(path):
        return counts
    with open(path) as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            if stack:
                counts[owner(stack.split(";"))] += int(n)
    return counts


def profile_run(scheduler: str, args, work: str) -> dict:
    out_json = os.path.join(work, f"{scheduler}.json")
    bench = subprocess.Popen(
        [sys.executable, "-m", "prophet_tf", "bench", "--reps", "1", "--compute-reps", "0",
         "--schedulers", scheduler, "--steps", str(args.steps), "--json", out_json],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        procs: dict[int, str] = {}
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and bench.poll() is None:
            procs = {p: r for p in descendants(bench.pid) if (r := role(p))}
            workers = [p for p, r in procs.items() if r == "worker"]
            sent = (interface_bytes(min(workers)) or (0, 0))[1] if workers else 0
            if sent >= args.start_mb * 1e6:
                break
            time.sleep(0.1)
        else:
            raise RuntimeError(f"{scheduler}: the run ended or hung before its window")
        names = {p: open(f"/proc/{p}/comm").read().strip() for p in procs}
        spies = {p: subprocess.Popen(
            [args.py_spy, "record", "--gil", "--nonblocking", "--full-filenames", "-r",
             str(args.rate), "-f", "raw",
             "-d", str(args.window), "-o", os.path.join(work, f"{scheduler}-{p}.txt"),
             "-p", str(p)], stdout=subprocess.DEVNULL,
            stderr=open(os.path.join(work, f"{scheduler}-{p}.log"), "w"))
            for p in procs}
        begin, before = time.monotonic(), {p: thread_times(p) for p in procs}
        time.sleep(args.window)
        end, after = time.monotonic(), {p: thread_times(p) for p in procs}
        for p, spy in spies.items():
            if spy.wait(60):
                with open(os.path.join(work, f"{scheduler}-{p}.log")) as f:
                    raise RuntimeError(f"{scheduler}: py-spy of {procs[p]} process {p} "
                                       f"failed: {f.read()[-1500:]}")
        _, err = bench.communicate(timeout=600)
        if bench.returncode:
            raise RuntimeError(f"{scheduler}: bench exited {bench.returncode}: {err[-2000:]}")
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    with open(out_json) as f:
        result = json.load(f)["results"][0]
    step_s = result["step_time_s"]
    steps = (end - begin) / step_s
    processes = {}
    order = sorted(procs, key=lambda p: (procs[p], p))
    for index, p in enumerate(order):
        label = f"{procs[p]}{sum(procs[q] == procs[p] for q in order[:index])}"
        kinds: collections.Counter = collections.Counter()
        for tid, (name, cpu) in after[p].items():
            kinds[thread_kind(name, names[p])] += cpu - before[p].get(tid, (name, 0.0))[1]
        samples = read_pyspy(os.path.join(work, f"{scheduler}-{p}.txt"))
        total = sum(samples.values())
        packages: collections.Counter = collections.Counter()
        for name, n in samples.items():
            packages[name.partition(":")[0]] += n
        processes[label] = {
            "cpu_ms_per_step": {k: 1e3 * v / steps for k, v in sorted(kinds.items())},
            "gil_samples": total,
            "gil_ms_per_step_total": 1e3 * total / args.rate / steps,
            "gil_ms_per_step_by_package": {k: 1e3 * n / args.rate / steps
                                           for k, n in packages.most_common()},
            # Each function's share of the GIL, as ms per step of the window.
            "gil_ms_per_step": {k: 1e3 * n / args.rate / steps
                                for k, n in samples.most_common(args.top)},
        }
    return {"scheduler": scheduler, "step_time_s": step_s, "window_s": end - begin,
            "steps_in_window": steps, "processes": processes}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedulers", default="prophet,tf-mwms")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--window", type=int, default=8, help="seconds measured")
    parser.add_argument("--start-mb", type=float, default=60.0,
                        help="the window starts once worker 0's host has sent this much")
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument("--top", type=int, default=25, help="functions kept per process")
    parser.add_argument("--py-spy", default=shutil.which("py-spy") or os.path.join(
        os.path.dirname(sys.executable), "py-spy"))
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not os.path.exists(args.py_spy):
        parser.error("py-spy not found (pip install -e \".[profile]\"). "
                     f"Received: --py-spy {args.py_spy}")
    runs = []
    with tempfile.TemporaryDirectory(prefix="prophet-tf-profile-") as work:
        for scheduler in args.schedulers.split(","):
            run = profile_run(scheduler, args, work)
            runs.append(run)
            print(f"{scheduler}: step {run['step_time_s'] * 1e3:.1f} ms, "
                  f"{run['steps_in_window']:.1f} steps measured")
            for label, p in run["processes"].items():
                cpu = p["cpu_ms_per_step"]
                print(f"  {label}: {sum(cpu.values()):.1f} ms CPU/step "
                      + ", ".join(f"{k} {v:.1f}" for k, v in cpu.items())
                      + f"; GIL held {p['gil_ms_per_step_total']:.1f}: "
                      + ", ".join(f"{k} {v:.1f}"
                                  for k, v in p["gil_ms_per_step_by_package"].items()))
                for name, ms in list(p["gil_ms_per_step"].items())[:8]:
                    print(f"      {ms:6.1f} ms  {name}")
    if args.json:
        config = {k: v for k, v in vars(args).items() if k not in ("json", "py_spy")}
        with open(args.json, "w") as f:
            json.dump({"config": config, "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
