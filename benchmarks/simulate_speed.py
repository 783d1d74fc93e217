"""How long a `prophet-tf simulate` command takes, wall and CPU, optionally
against another checkout's code in the same run.

    .venv/bin/python benchmarks/simulate_speed.py [--reps 3] [--baseline-root ../before] \
        [--json benchmarks/simulate-speed.json] [-- SIMULATE ARGS...]

The command defaults to the 64-worker, 64-PS colocated ResNet-50 simulation
of the four schedulers (2 processes). Each repetition runs it as
``python -m prophet_tf simulate ARGS --json FILE`` in a child process: wall
time, and the CPU time (user + system) of the child and its own worker
processes. With ``--baseline-root``, the same command runs from that checkout
too (e.g. ``git worktree add ../before HEAD~1``), the two taking turns, so
that the machine's drift through the run falls on both alike. Each run's
step times are kept, so a change's effect on the results shows beside its
speed. ``prophet-tf report``'s ``simspeed`` kind renders the JSON.

``--instructions`` runs each command under Valgrind's callgrind (Debian's
``valgrind``) and keeps the instructions its processes executed: a count that
does not move with the machine's load, so one turn shows a change of a few
percent that wall and CPU time, moving by a third within an hour here, cannot.
Callgrind runs the code some 60 times slower: give it a smaller command
(e.g. ``--workers 8``); the hash seed is fixed so that two runs of one tree
count the same.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import trees  # noqa: E402
from prophet_tf.bench.speed_table import speed_table  # noqa: E402

DEFAULT_ARGS = ["--model", "resnet50", "--workers", "64", "--ps", "64", "--layout", "colocated",
                "--bandwidth-mbit", "10000", "--compute-s", "0.25",
                "--schedulers", "fifo,p3,bytescheduler,prophet", "--jobs", "2"]


#: What callgrind prints at each traced process's exit: the instructions it ran.
_COLLECTED = re.compile(r"^==\d+== Collected : (\d+)$", re.MULTILINE)


def run_once(root: pathlib.Path, args: list[str], instructions: bool = False) -> dict:
    """One simulation run from ``root``: its wall and CPU seconds and step times,
    and with ``instructions`` (under callgrind) the instructions of its processes."""
    with tempfile.TemporaryDirectory(prefix="simulate-speed-") as tmp:
        out = pathlib.Path(tmp) / "result.json"
        command = [sys.executable, "-m", "prophet_tf", "simulate", *args, "--json", str(out)]
        env = None
        if instructions:
            # Every process the command starts (the simulations' pool) is counted.
            command = ["valgrind", "--tool=callgrind", "--trace-children=yes",
                       f"--callgrind-out-file={tmp}/callgrind.%p", *command]
            env = {**os.environ, "PYTHONHASHSEED": "0"}
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.monotonic()
        # In root's directory: `python -m` puts it first on the path (trees.py).
        done = subprocess.run(command, cwd=root, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
        wall = time.monotonic() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if done.returncode:
            raise RuntimeError(f"{' '.join(command)} exited with {done.returncode}:\n"
                               f"{done.stderr[-4000:]}")
        result = json.loads(out.read_text())
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    run = {"wall_s": wall, "cpu_s": cpu,
           "step_time_s": {r["scheduler"]: r["step_time_s"] for r in result["results"]}}
    if instructions:
        counts = [int(n) for n in _COLLECTED.findall(done.stderr)]
        if not counts:
            raise RuntimeError(f"callgrind reported no instruction count:\n{done.stderr[-4000:]}")
        run["instructions"] = sum(counts)
    return run


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--baseline-root", type=pathlib.Path, default=None,
                        help="another checkout whose code runs the same command, in turns")
    parser.add_argument("--json", default=None, help="write the runs here")
    parser.add_argument("--instructions", action="store_true",
                        help="count the instructions run, under valgrind's callgrind "
                             "(about 60 times slower)")
    parser.add_argument("simulate_args", nargs="*", help="after --: prophet-tf simulate's arguments")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error(f"--reps takes a positive count. Received: {args.reps}")
    if "--json" in args.simulate_args:
        parser.error("the simulate arguments may not hold --json: each run writes its own")
    if args.instructions and shutil.which("valgrind") is None:
        parser.error("--instructions runs the command under valgrind, which is not installed "
                     "(Debian: apt-get install valgrind)")
    simulate_args = args.simulate_args or DEFAULT_ARGS
    roots = {"this": ROOT}
    if args.baseline_root is not None:
        baseline = args.baseline_root.resolve()
        if not (baseline / "prophet_tf").is_dir():
            parser.error(f"--baseline-root needs a prophet_tf checkout. Received: {baseline}")
        roots = {"baseline": baseline, "this": ROOT}
    for root in roots.values():
        trees.check_imports_from(root)
    runs = {name: [] for name in roots}
    for rep in range(args.reps):
        for name, root in roots.items():
            run = run_once(root, simulate_args, args.instructions)
            runs[name].append(run)
            counted = (f", {run['instructions'] / 1e9:.3f} G instructions"
                       if args.instructions else "")
            print(f"rep {rep} {name}: wall {run['wall_s']:.1f} s, CPU {run['cpu_s']:.1f} s"
                  f"{counted}", flush=True)
    result = {"config": {"command": "prophet-tf simulate " + " ".join(simulate_args),
                         "reps": args.reps, "cores": os.cpu_count(),
                         "instructions": args.instructions,
                         "commits": {name: trees.commit(root) for name, root in roots.items()}},
              "runs": runs}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    print(speed_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
