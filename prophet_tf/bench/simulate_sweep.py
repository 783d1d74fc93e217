"""Simulating a ``--schedulers`` spec (a PS scheduler's or tf-mwms's), and
``prophet-tf simulate --sweep``: every spec over worker counts and bandwidths, with its
plot of speedup over FIFO."""
from __future__ import annotations

from typing import Sequence

from prophet_tf import extras
from prophet_tf.bench import simulate as simulate_lib
from prophet_tf.bench import simulate_ring
from prophet_tf.engine import schedulers as schedulers_lib

__all__ = ["parse_spec", "simulate_spec", "sweep", "plot_sweep"]


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


def sweep(profile: dict, schedulers: Sequence[str], workers: Sequence[int],
          bandwidths_mbit: Sequence[float], num_ps: int | None = None,
          layout: str = "dedicated", **kwargs) -> list[dict]:
    """:func:`simulate_spec` over a grid; ``num_ps`` None = one PS per 4 workers (at least 1)
    when dedicated, one per worker when colocated. ``schedulers``: specs as
    ``--schedulers`` takes them (``"p3:slice_bytes=N"``), which name the rows."""
    parsed = {spec: parse_spec(spec) for spec in schedulers}
    rows = []
    for w in workers:
        ps = num_ps or (w if layout == "colocated" else max(1, w // 4))
        for bw in bandwidths_mbit:
            for spec, (name, options) in parsed.items():
                r = simulate_spec(profile, name, options, w, ps, bw, layout=layout, **kwargs)
                rows.append({"workers": w, "ps": ps, "bandwidth_mbit": bw, "scheduler": spec,
                             "step_time_s": r["step_time_s"],
                             "ideal_step_time_s": r["ideal_step_time_s"]})
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
