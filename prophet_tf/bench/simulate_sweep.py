"""Simulating a ``--schedulers`` spec (a PS scheduler's or tf-mwms's), and
``prophet-tf simulate --sweep``: every spec over worker counts and bandwidths, with its
plot of speedup over FIFO."""
from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
from typing import Sequence

from prophet_tf import extras
from prophet_tf.bench import simulate as simulate_lib
from prophet_tf.bench import simulate_ring
from prophet_tf.engine import schedulers as schedulers_lib
from prophet_tf.engine.dispatch import Dispatch
from prophet_tf.tools import _die_with_parent

__all__ = ["parse_spec", "simulate_spec", "simulate_specs", "estimated_cost",
           "default_processes", "sweep", "plot_sweep"]


def parse_spec(spec: str) -> tuple[str, dict]:
    """A ``--schedulers`` entry, a PS scheduler's or tf-mwms's: ``(name, options)``.

    Raises:
      ValueError: an unknown scheduler or option.
    """
    ring = simulate_ring.parse_spec(spec)
    return (simulate_ring.NAME, ring) if ring is not None else schedulers_lib.parse_scheduler(spec)


def simulate_spec(profile: dict, name: str, options: dict, workers: int, num_ps: int,
                  bandwidth_mbit: float | None, **kwargs) -> dict:
    """``simulate.simulate`` of a PS scheduler, or ``simulate_ring.simulate_ring``
    of tf-mwms (which sends no PS messages and has no fluid network: the
    message costs and the rate lag are left out)."""
    if name == simulate_ring.NAME:
        kwargs = {k: v for k, v in kwargs.items()
                  if not k.startswith("rpc_") and k != "rate_lag_s"}
        return simulate_ring.simulate_ring(profile, workers, num_ps, bandwidth_mbit,
                                           **options, **kwargs)
    return simulate_lib.simulate(profile, name, workers, num_ps, bandwidth_mbit,
                                 scheduler_options=options, **kwargs)


def default_processes() -> int:
    """The cores this process may run on: how many simulations run at once by default."""
    return len(os.sched_getaffinity(0))


def _simulate_job(job: dict) -> dict:
    return simulate_spec(**job)


def estimated_cost(job: dict) -> int:
    """A job's relative CPU time, to start the longest first: the messages its
    simulated workers send per iteration (each pushes and pulls every partition;
    every worker is simulated colocated, one stands for all dedicated). The
    ring model has no fluid network and takes next to nothing (0)."""
    if job["name"] == simulate_ring.NAME:
        return 0
    scheduler = schedulers_lib.make_scheduler(job["name"], **job["options"])
    specs = simulate_lib.specs_of(job["profile"])
    dispatch = Dispatch([spec.key for spec in specs], specs, job["num_ps"], scheduler,
                        num_workers=job["workers"])
    colocated = job.get("layout", "dedicated") == "colocated"
    return (job["workers"] if colocated else 1) * len(dispatch.partitions)


def simulate_specs(jobs: Sequence[dict], processes: int = 1) -> list[dict]:
    """:func:`simulate_spec` of every job (its keyword arguments), in job order.

    A simulation is one CPU-bound Python process and the jobs are independent:
    with ``processes`` > 1 they run in that many processes of their own, the
    costliest first (:func:`estimated_cost`) so that the last to start are the
    shortest. Each result is the one a single process gives, to the bit (a
    simulation reads no clock and no shared state).
    """
    if processes < 1:
        raise ValueError(f"processes must be at least 1. Received: {processes!r}")
    if processes == 1 or len(jobs) < 2:
        return [_simulate_job(job) for job in jobs]
    costs = [estimated_cost(job) for job in jobs]
    order = sorted(range(len(jobs)), key=lambda i: -costs[i])
    # spawn, not fork: the caller may hold threads (TensorFlow's, in a test
    # process), which a forked child would inherit mid-lock; and the children
    # are the caller's own, so they end with it (the simulator imports in a
    # quarter of a second).
    with concurrent.futures.ProcessPoolExecutor(
            min(processes, len(jobs)), mp_context=multiprocessing.get_context("spawn"),
            initializer=_die_with_parent.die_with, initargs=(os.getpid(),)) as pool:
        futures = {i: pool.submit(_simulate_job, jobs[i]) for i in order}
        return [futures[i].result() for i in range(len(jobs))]


def sweep(profile: dict, schedulers: Sequence[str], workers: Sequence[int],
          bandwidths_mbit: Sequence[float], num_ps: int | None = None,
          layout: str = "dedicated", processes: int = 1, **kwargs) -> list[dict]:
    """:func:`simulate_spec` over a grid; ``num_ps`` None = one PS per 4 workers (at least 1)
    when dedicated, one per worker when colocated. ``schedulers``: specs as
    ``--schedulers`` takes them (``"p3:slice_bytes=N"``), which name the rows.
    ``processes``: as in :func:`simulate_specs`."""
    parsed = {spec: parse_spec(spec) for spec in schedulers}
    rows, jobs = [], []
    for w in workers:
        ps = num_ps or (w if layout == "colocated" else max(1, w // 4))
        for bw in bandwidths_mbit:
            for spec, (name, options) in parsed.items():
                rows.append({"workers": w, "ps": ps, "bandwidth_mbit": bw, "scheduler": spec})
                jobs.append(dict(profile=profile, name=name, options=options, workers=w,
                                 num_ps=ps, bandwidth_mbit=bw, layout=layout, **kwargs))
    for row, r in zip(rows, simulate_specs(jobs, processes)):
        row["step_time_s"] = r["step_time_s"]
        row["ideal_step_time_s"] = r["ideal_step_time_s"]
    return rows


def plot_sweep(rows: list[dict], path: str, title: str) -> str:
    """PNG of speedup over FIFO against bandwidth, one panel per worker count."""
    matplotlib = extras.require("matplotlib", "--plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workers = sorted({r["workers"] for r in rows})
    names = [n for n in dict.fromkeys(r["scheduler"] for r in rows) if n != "fifo"]
    fig, axes = plt.subplots(1, len(workers), figsize=(3.2 * len(workers), 3.2), sharey=True,
                             squeeze=False)
    fifo = {(r["workers"], r["bandwidth_mbit"]): r["step_time_s"] for r in rows
            if r["scheduler"] == "fifo"}
    for ax, w in zip(axes[0], workers):
        for name in names:
            pts = sorted((r["bandwidth_mbit"] / 1000, fifo[w, r["bandwidth_mbit"]] / r["step_time_s"])
                         for r in rows if r["workers"] == w and r["scheduler"] == name)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ps = next(r["ps"] for r in rows if r["workers"] == w)
        ax.set_title(f"{w} workers, {ps} PS")
        ax.set_xscale("log")
        ax.set_xlabel("bandwidth per link (Gbit/s)")
    axes[0][0].set_ylabel("speedup over FIFO")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
