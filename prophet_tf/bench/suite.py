"""`prophet-tf bench --suite NAME`: a grid of bench configurations, one JSON.

    prophet-tf bench --suite paper --json benchmarks/suite-paper.json
    prophet-tf plot benchmarks/suite-paper.json --out docs/suite-paper.png

``paper`` is the setting Prophet was published in: ResNet-50, InceptionV3 and
VGG16 on GPU workers (emulated compute, this machine's profiles scaled to a
GPU-class step time), two link bandwidths that bracket where priority
scheduling pays, 2 and 4 workers with a PS task on every worker host, every
scheduler and tf-mwms. ``smoke`` runs the same code on the CNN in about a
minute (the tests run it).

Each cell is one ``prophet-tf bench`` invocation. Its time scale is chosen so
that every link runs at the rate the suite's transport budget allows
(``transport_mbit``, split over the workers a host serves): the cluster's
compute/communication ratio is kept while this machine's cores carry the
bytes (see ``bench_cli``). The JSON is rewritten after every cell, so an
interrupted suite loses at most the cell it was running; run the same command
again and the cells already in the JSON are kept and not run again.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Callable

__all__ = ["Suite", "SUITES", "TARGETS", "cells", "cell_directory", "run_suite", "summary",
           "print_summary", "targets"]


@dataclasses.dataclass(frozen=True)
class Suite:
    name: str
    models: tuple[str, ...]
    bandwidths_mbit: tuple[float, ...]
    workers: tuple[int, ...]
    #: One step's compute per worker, per model (GPU-class; see the README).
    compute_ms: dict
    #: The link rate (Mbit/s) this machine's transport carries for 2 workers;
    #: with W workers each link gets 2/W of it (a host's link carries
    #: 2(W-1)/W of the model each way, the machine W times the model).
    transport_mbit: float
    steps: int
    reps: int
    per_worker_batch: int
    schedulers: str

    @classmethod
    def from_json(cls, definition: dict) -> "Suite":
        """The suite a JSON result recorded (its lists back to tuples).

        Raises:
          ValueError: ``definition`` is not one.
        """
        try:
            return cls(**{k: tuple(v) if isinstance(v, list) else v
                          for k, v in definition.items()})
        except TypeError as e:
            raise ValueError(f"not a suite definition ({e}). Received: {definition!r:.200}") \
                from None


SUITES = {
    "paper": Suite("paper", models=("resnet50", "inceptionv3", "vgg16"),
                   bandwidths_mbit=(3000.0, 10000.0), workers=(2, 4),
                   # V100-class fp32 training at batch 32 per GPU.
                   compute_ms={"resnet50": 90.0, "inceptionv3": 130.0, "vgg16": 145.0},
                   # 500 Mbit/s kept 1.6 of the 2 cores busy and made ResNet-50's
                   # steps 9-18% longer at the cluster's scale than 250 did (the
                   # README's "transport budget"): the CPU, not the links, set them.
                   transport_mbit=250.0, steps=12, reps=1, per_worker_batch=32,
                   schedulers="fifo,p3,bytescheduler,prophet,tf-mwms"),
    "smoke": Suite("smoke", models=("cnn",), bandwidths_mbit=(400.0,), workers=(2,),
                   compute_ms={"cnn": 40.0}, transport_mbit=200.0, steps=10, reps=1,
                   per_worker_batch=32, schedulers="fifo,prophet,tf-mwms"),
}


#: What the paper suite is to show (Prophet's step against each peer's):
#: in every cell at most 0.7x tf-mwms and 1.15x the ideal bound; at most
#: 0.9x the better of P3 and ByteScheduler in some cell, 1.0x in all.
TARGETS = {"vs_tf_mwms": 0.7, "vs_ideal": 1.15, "vs_rival_somewhere": 0.9, "vs_rival": 1.0}


def cells(suite: Suite) -> list[dict]:
    """The suite's configurations, in the order they run (cheapest first)."""
    out = []
    for model in suite.models:
        for workers in suite.workers:
            for bandwidth in suite.bandwidths_mbit:
                link = suite.transport_mbit * 2 / workers
                out.append({"model": model, "workers": workers, "bandwidth_mbit": bandwidth,
                            "compute_ms": suite.compute_ms[model],
                            "time_scale": max(1.0, bandwidth / link)})
    return out


def _key(cell: dict) -> tuple:
    return cell["model"], cell["workers"], cell["bandwidth_mbit"]


def _argv(suite: Suite, cell: dict, timeline_dir: str | None) -> list[str]:
    argv = ["--model", cell["model"], "--compute", "emulated",
            "--compute-ms", repr(cell["compute_ms"]), "--time-scale", repr(cell["time_scale"]),
            "--workers", str(cell["workers"]), "--bandwidth-mbit", repr(cell["bandwidth_mbit"]),
            "--steps", str(suite.steps), "--reps", str(suite.reps),
            "--global-batch", str(suite.per_worker_batch * cell["workers"]),
            "--schedulers", suite.schedulers, "--compute-reps", "0",
            # TensorFlow's default packing: the suites' committed cells ran it, a
            # resumed suite stays comparable, and no cell pays four tuning runs.
            "--tf-mwms-bytes-per-pack", "0"]
    if timeline_dir:
        argv += ["--timeline-dir", os.path.join(timeline_dir, cell_directory(cell))]
    return argv


def cell_directory(cell: dict) -> str:
    """Where a cell's timelines go under the suite's ``--timeline-dir``."""
    return "{model}-w{workers}-{bandwidth_mbit:g}".format(**cell)


def _previous(path: str | None, suite: Suite, host_queue: str) -> list[dict]:
    """The cells of an earlier run of this suite in ``path`` (to keep): those
    made through ``host_queue`` (``netns``). A cell made through another
    (one queue, if it predates the record) is run again, so one suite never
    mixes the two.

    Raises:
      ValueError: ``path`` holds something else, or another definition of the suite.
    """
    if not path or not os.path.exists(path):
        return []
    with open(path) as f:
        try:
            data = json.load(f)
        except ValueError as e:
            raise ValueError(f"--json {path} exists and is not JSON ({e}); move it away") from None
    recorded = data.get("suite") if isinstance(data, dict) else None
    try:
        same = isinstance(recorded, dict) and Suite.from_json(recorded) == suite
    except ValueError:
        same = False
    if not same:
        what = recorded.get("name") if isinstance(recorded, dict) else "not a suite result"
        raise ValueError(f"--json {path} holds another result ({what!r}, or a different "
                         f"definition of suite {suite.name!r}); move it away or name a new "
                         f"file")
    wanted = {_key(c) for c in cells(suite)}
    return [c for c in data.get("cells", []) if _key(c["cell"]) in wanted
            and c.get("config", {}).get("host_queue", "fifo") == host_queue]


def _write(path: str, data: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def run_suite(name: str, json_path: str | None, run_cell: Callable, default_host_queue: str,
              timeline_dir: str | None = None, out=sys.stdout) -> dict:
    """Runs every cell of suite ``name`` not already in ``json_path``; returns the JSON dict.

    ``run_cell(argv, out)`` runs one `prophet-tf bench` (``argv``: its arguments) and
    returns its result (bench_cli's, handed in so this module does not import it);
    ``default_host_queue``: the bench's, for cells recorded before they named theirs.
    """
    suite = SUITES[name]
    done = _previous(json_path, suite, default_host_queue)
    have = {_key(c["cell"]) for c in done}
    result = {"suite": dataclasses.asdict(suite), "cells": done, "elapsed_s": 0.0,
              "complete": False}
    order = {_key(c): i for i, c in enumerate(cells(suite))}
    todo = [c for c in cells(suite) if _key(c) not in have]
    if done:
        print(f"prophet-tf bench: suite {name}: {len(done)} cell(s) kept from {json_path}, "
              f"{len(todo)} to run", file=out, flush=True)
    t0 = time.monotonic()
    for i, cell in enumerate(todo):
        print(f"\nprophet-tf bench: suite {name}, cell {i + 1}/{len(todo)}: {cell['model']}, "
              f"{cell['workers']} workers, {cell['bandwidth_mbit']:g} Mbit/s, compute "
              f"{cell['compute_ms']:g} ms, time scale {cell['time_scale']:g}",
              file=out, flush=True)
        started = time.monotonic()
        bench = run_cell(_argv(suite, cell, timeline_dir), out)
        # Each cell's own wall time: elapsed_s counts only this invocation,
        # and a resumed suite's cells ran in several.
        result["cells"].append({"cell": cell, **bench, "wall_s": time.monotonic() - started})
        # In the suite's order, also when a resumed run filled a gap.
        result["cells"].sort(key=lambda c: order[_key(c["cell"])])
        result["elapsed_s"] = time.monotonic() - t0
        if json_path:
            _write(json_path, result)
    result["complete"] = True
    result["elapsed_s"] = time.monotonic() - t0
    if json_path:
        _write(json_path, result)
    return result


def summary(result: dict) -> list[dict]:
    """Per cell: every scheduler's step at the cluster's scale, its speedup
    over FIFO, Prophet's ratios to tf-mwms, to the better of P3 and
    ByteScheduler and to the ideal bound, tf-mwms's ratio to that bound (None
    where a run is missing), and whether the cell ran with answers first
    (None: run before the bench recorded it).

    The suite's PS tasks are colocated, so the bound holds for tf-mwms too:
    its ring all-reduce moves the same 2·(W-1)/W of the gradient bytes over
    every link (``ideal``'s module doc). Prophet can be 0.7x tf-mwms only
    where tf-mwms takes at least 1/0.7 = 1.43x the bound."""
    rows = []
    for c in result["cells"]:
        step = {r["scheduler"]: r["step_time_s"] for r in c["results"]}
        k = c["config"].get("time_scale", 1.0)
        prophet = step.get("prophet")
        rival = min((step[s] for s in ("p3", "bytescheduler") if s in step), default=None)

        def ratio(x, y):
            return x / y if x is not None and y is not None else None
        rows.append({**c["cell"], "cluster_step_s": {s: t / k for s, t in step.items()},
                     "speedup_vs_fifo": {s: ratio(step.get("fifo"), t) for s, t in step.items()},
                     "prophet_vs_tf_mwms": ratio(prophet, step.get("tf-mwms")),
                     "prophet_vs_rival": ratio(prophet, rival),
                     "prophet_vs_ideal": ratio(prophet, c["config"]["ideal"]["ideal_s"]),
                     "tf_mwms_vs_ideal": ratio(step.get("tf-mwms"),
                                               c["config"]["ideal"]["ideal_s"]),
                     "answers_first": c["config"].get("answers_first")})
    return rows


def targets(result: dict) -> dict:
    """``TARGETS`` against a suite result: per cell (``summary``'s rows)
    whether Prophet met each, and the lowest Prophet / tf-mwms any schedule
    of the cell's bytes could reach (the ideal bound over tf-mwms's step);
    the counts over the cells that ran; the models the suite defines and
    ran no cell of. A target is None in a cell that lacks a run it needs.
    Ratios are compared as the tables print them, to two decimals."""
    def at_most(x, limit):
        return None if x is None else round(x, 2) <= limit
    rows = []
    for r in summary(result):
        rows.append({**r,
                     "floor_vs_tf_mwms": None if not r["tf_mwms_vs_ideal"]
                     else 1.0 / r["tf_mwms_vs_ideal"],
                     "met_vs_tf_mwms": at_most(r["prophet_vs_tf_mwms"], TARGETS["vs_tf_mwms"]),
                     "met_vs_ideal": at_most(r["prophet_vs_ideal"], TARGETS["vs_ideal"]),
                     "met_vs_rival": at_most(r["prophet_vs_rival"], TARGETS["vs_rival"]),
                     "met_vs_rival_somewhere": at_most(r["prophet_vs_rival"],
                                                       TARGETS["vs_rival_somewhere"])})

    def count(key):
        return sum(1 for r in rows if r[key])
    ran = {r["model"] for r in rows}
    return {"rows": rows, "cells": len(rows),
            "met": {k: count(f"met_{k}") for k in TARGETS},
            # Where even the ideal bound is above 0.7x tf-mwms, no schedule meets it.
            # Rounded as Prophet's ratio is, so a cell met is never counted unreachable.
            "reachable_vs_tf_mwms": sum(1 for r in rows if at_most(r["floor_vs_tf_mwms"],
                                                                   TARGETS["vs_tf_mwms"])),
            "models_not_run": [m for m in result["suite"]["models"] if m not in ran]}


def print_summary(result: dict, out=sys.stdout) -> None:
    """One line per cell: speedups over FIFO and Prophet's ratios."""
    rows = summary(result)
    names = result["suite"]["schedulers"].split(",")
    print(f"{'model':>12} {'workers':>7} {'Mbit/s':>7} {'FIFO ms':>8} "
          + " ".join(f"{n:>13}" for n in names if n != "fifo")
          + f" {'P/tf-mwms':>9} {'P/rival':>8} {'P/ideal':>8}", file=out)

    def f(x):
        return "-" if x is None else f"{x:.2f}"
    for r in rows:
        fifo = r["cluster_step_s"].get("fifo")
        print(f"{r['model']:>12} {r['workers']:>7} {r['bandwidth_mbit']:>7g} "
              f"{'-' if fifo is None else f'{fifo * 1e3:.1f}':>8} "
              + " ".join(f"{f(r['speedup_vs_fifo'].get(n)):>13}" for n in names if n != "fifo")
              + f" {f(r['prophet_vs_tf_mwms']):>9} {f(r['prophet_vs_rival']):>8} "
                f"{f(r['prophet_vs_ideal']):>8}", file=out)
