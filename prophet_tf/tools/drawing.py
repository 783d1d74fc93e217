"""Drawing for `prophet-tf plot`: a timeline's Gantt chart per worker, a bench result's bars.

The data come parsed and checked by prophet_tf.tools.plot_data; matplotlib is
imported here only, when a drawing is made.
"""
from __future__ import annotations

import logging
import textwrap

from prophet_tf import extras
from prophet_tf.tools.plot_data import (PlotError, Span, WorkerTimeline, parse_bench,
                                        parse_suite, plan_for_iteration, select_steps)

__all__ = ["plot_timelines", "plot_bench", "plot_suite"]

logger = logging.getLogger(__name__)

#: One colour per scheduler, in every bench and suite plot.
_PALETTE = {"fifo": "#9e9e9e", "p3": "#4c72b0", "bytescheduler": "#dd8452",
            "prophet": "#55a868", "tf-mwms": "#8172b3"}
#: Bench settings named first in the bench plot's title.
_BENCH_KEYS = ("model", "workers", "ps", "bandwidth_mbit", "latency_ms", "global_batch")


def _pyplot():
    matplotlib = extras.require("matplotlib", "drawing", extra="plot")
    matplotlib.use("Agg")  # Files only; no display needed.
    import matplotlib.pyplot as plt
    return plt


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{int(n)} B"


def plot_timelines(timelines: list[WorkerTimeline], out: str,
                   steps: tuple[int | None, int | None] | None = None) -> str:
    """Draws one Gantt panel per worker into `out` (PNG, SVG, PDF: by extension).

    Returns:
      `out`.

    Raises:
      PlotError: no timelines, or the steps select nothing.
      extras.MissingExtra: matplotlib is missing.
    """
    if not timelines:
        raise PlotError("no timeline to plot. Received: 0 files")
    windows = [select_steps(t, steps) for t in timelines]
    plt = _pyplot()
    from matplotlib import colors as mcolors
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    num_vars = max(len(t.names) for t in timelines) or 1
    cmap = plt.get_cmap("viridis")
    norm = mcolors.Normalize(vmin=0, vmax=max(num_vars - 1, 1))

    def color(priority):
        return cmap(norm(min(priority, num_vars - 1)))

    layouts = []
    for t in timelines:
        rows = ["forward\n(parameter reads)", "backward\n(gradients ready)"]
        rows += [f"push to PS {i}" for i in sorted(t.pushes)]
        rows += [f"pull from PS {i}" for i in sorted(t.pulls)]
        if t.scheduler == "prophet":
            rows.append("Prophet plan")
        layouts.append(rows)
    heights = [len(rows) + 1.5 for rows in layouts]
    fig_height = 1.9 + 0.62 * sum(heights)
    fig, axes = plt.subplots(len(timelines), 1, figsize=(15, fig_height),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    width_ms = max((t1 - t0) / 1e3 for _, t0, t1 in windows)
    for ax, t, rows, (chosen, t0, t1) in zip(axes[:, 0], timelines, layouts, windows):
        _draw_worker(ax, t, rows, chosen, t0, t1, color, num_vars, width_ms)
    handles = [
        Patch(facecolor=color(0), alpha=0.55, label="forward: waiting for the parameter "
              "(a lane per variable)"),
        Line2D([], [], marker="o", linestyle="", color=color(0), markersize=4,
               markeredgecolor="black", markeredgewidth=0.3,
               label="parameter there: that layer's forward can start"),
        Line2D([], [], marker="|", linestyle="", color=color(0), markersize=9,
               markeredgewidth=1.5, label="gradient ready"),
        Patch(facecolor=color(0), edgecolor="black", linewidth=0.4,
              label="transfer (colour: its most urgent variable)"),
        Patch(facecolor=color(0), edgecolor="black", linewidth=0.4, alpha=0.35, hatch="...",
              label="pull: request to first partition (waits for the new version)"),
        Line2D([], [], color="0.4", linestyle="--", linewidth=0.8, label="step start"),
    ]
    if any(t.scheduler == "prophet" for t in timelines):
        handles += [Patch(facecolor="0.75", edgecolor="0.3", label="plan: predicted burst"),
                    Patch(facecolor="white", edgecolor="0.3", hatch="///",
                          label="plan: idle gap a block may fill (budget)")]
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=9, frameon=False,
               bbox_to_anchor=(0.5, 0.0))
    top, bottom = 1 - 0.7 / fig_height, 1.45 / fig_height
    bar = fig.colorbar(plt.cm.ScalarMappable(norm=norm, cmap=cmap),
                       cax=fig.add_axes([0.915, bottom, 0.012, top - bottom]))
    bar.set_label("priority (0 = first layer, needed first)")
    if num_vars <= 12:
        bar.set_ticks(range(num_vars))
    # Margins in inches: the title on top, the legend below the last panel.
    fig.subplots_adjust(left=0.1, right=0.9, top=top, bottom=bottom, hspace=0.4)
    schedulers = sorted({t.scheduler for t in timelines})
    fig.suptitle(f"prophet_tf timeline: scheduler {', '.join(schedulers)}, "
                 f"{len(timelines)} worker(s)", fontsize=13)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    logger.info("wrote %s", out)
    return out


def _draw_worker(ax, t: WorkerTimeline, rows: list[str], chosen: list[int], t0: float,
                 t1: float, color, num_vars: int, width_ms: float) -> None:
    def ms(us):
        return (us - t0) / 1e3

    lo, hi = ms(t0), ms(t1)
    pad = 0.02 * width_ms
    visible = (lo - pad * 3, lo + width_ms + pad)

    def shown(start_us, end_us):
        return ms(end_us) >= visible[0] and ms(start_us) <= visible[1]

    lane = 0.8 / max(num_vars, 1)

    def lane_y(row, priority):  # Priority 0 on top of its row.
        return row - 0.4 + lane * min(priority, num_vars - 1)

    # forward: reads, one lane per variable; a dot where the value arrived.
    for s in t.reads:
        if shown(s.start_us, s.end_us):
            y = lane_y(0, s.priority)
            ax.broken_barh([(ms(s.start_us), max(ms(s.end_us) - ms(s.start_us), 0.02))],
                           (y, lane * 0.9), facecolors=color(s.priority), alpha=0.55)
            ax.plot(ms(s.end_us), y + lane * 0.45, "o", color=color(s.priority),
                    markersize=3.2, markeredgecolor="black", markeredgewidth=0.3)
    for when, priority, _ in t.ready:
        if shown(when, when):
            ax.plot(ms(when), lane_y(1, priority) + lane * 0.45, "|", color=color(priority),
                    markersize=max(3.0, 22 * lane), markeredgewidth=1.6)
    row = 2
    for table, pulling in ((t.pushes, False), (t.pulls, True)):
        for ps in sorted(table):
            spans = [s for s in table[ps] if shown(s.start_us, s.end_us)]
            lanes = _lanes(spans)
            height = 0.76 / (max(lanes, default=0) + 1)
            first = _first_of_version(table[ps]) if pulling else set()
            for s, sub in zip(spans, lanes):
                x, w = ms(s.start_us), max(ms(s.end_us) - ms(s.start_us), 0.02)
                y = row - 0.38 + sub * height
                if id(s) in first:  # Requested early: mostly waiting for the new version.
                    ax.broken_barh([(x, w)], (y, height), facecolors=color(s.priority),
                                   edgecolors="black", linewidth=0.4, alpha=0.35, hatch="...")
                else:
                    ax.broken_barh([(x, w)], (y, height), facecolors=color(s.priority),
                                   edgecolors="black", linewidth=0.4)
                if len(set(s.keys)) > 1 and w > 0.025 * width_ms:
                    ax.text(x + w / 2, y + height / 2, f"{len(set(s.keys))} vars",
                            ha="center", va="center", fontsize=7, color="white")
            row += 1
    if t.scheduler == "prophet":
        _draw_plan(ax, t, row, chosen, ms, width_ms)
    # Step boundaries: each shown step's first parameter read.
    for step in chosen + [chosen[-1] + 1]:
        starts = [s.start_us for s in t.reads if s.step == step]
        if starts and shown(min(starts), min(starts)):
            x = ms(min(starts))
            ax.axvline(x, color="0.4", linestyle="--", linewidth=0.8, zorder=0)
            ax.text(x, -0.75, f" step {step}", fontsize=8, va="bottom", ha="left", color="0.25")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(rows, fontsize=9)
    ax.set_ylim(len(rows) - 0.5, -0.9)
    ax.set_xlim(*visible)
    ax.grid(axis="x", color="0.9", linewidth=0.6)
    ax.set_axisbelow(True)
    ax.set_xlabel(f"ms since step {chosen[0]} began (worker {t.worker})", fontsize=9)
    steps_text = f"step {chosen[0]}" if len(chosen) == 1 else f"steps {chosen[0]}-{chosen[-1]}"
    title = f"worker {t.worker}: {t.scheduler} scheduler, {steps_text} ({hi - lo:.1f} ms)"
    plan = plan_for_iteration(t, chosen[0]) if t.scheduler == "prophet" else None
    if plan and plan.get("bursts"):
        rates = plan.get("bandwidth_bytes_per_s", {})
        title += (f"; plan v{plan.get('version')} in step {chosen[0]}: "
                  f"{len(plan['bursts'])} burst(s), measured bandwidth "
                  + ", ".join(f"PS {k} {_fmt_bytes(b)}/s" for k, b in sorted(rates.items())))
    ax.set_title(title, fontsize=10, loc="left")


def _lanes(spans: list[Span]) -> list[int]:
    """Sub-lane of each span so that overlapping transfers (RPCs in flight
    together) sit side by side instead of hiding each other."""
    ends: list[float] = []
    out = []
    for s in spans:
        for lane, end in enumerate(ends):
            if end <= s.start_us + 1.0:  # 1 µs: back-to-back spans differ by rounding.
                ends[lane] = s.end_us
                out.append(lane)
                break
        else:
            ends.append(s.end_us)
            out.append(len(ends) - 1)
    return out


def _first_of_version(spans: list[Span]) -> set[int]:
    """The first pulled partition of each version: its span starts at the
    request, so it includes the wait for the PS to make that version."""
    first: dict[int, Span] = {}
    for s in spans:
        if s.step not in first or s.start_us < first[s.step].start_us:
            first[s.step] = s
    return {id(s) for s in first.values()}


def _draw_plan(ax, t: WorkerTimeline, row: int, chosen: list[int], ms, width_ms: float) -> None:
    for step in chosen:
        plan = plan_for_iteration(t, step)
        ready = [when for when, _, s in t.ready if s == step]
        if plan is None or not ready:
            continue
        origin = min(ready)
        if not plan.get("bursts"):
            label = "profiling" if plan.get("profiling") else "no plan"
            ax.text(ms(origin), row, f" {label} (sends by priority)", fontsize=8,
                    va="center", ha="left", color="0.3")
            continue
        for s in plan["bursts"]:
            start = ms(origin + s["start_ns"] / 1e3)
            arrive = ms(origin + s["arrive_ns"] / 1e3)
            ax.broken_barh([(start, max(arrive - start, 0.004 * width_ms))], (row - 0.38, 0.76),
                           facecolors="0.75", edgecolors="0.3", linewidth=0.4)
            if s.get("gap_ns", 0) > 0:
                gap = s["gap_ns"] / 1e6
                ax.broken_barh([(arrive, gap)], (row - 0.38, 0.76), facecolors="white",
                               edgecolors="0.3", hatch="///", linewidth=0.4)
                budget = sum(s.get("budget_bytes", {}).values())
                if gap > 0.06 * width_ms:
                    ax.text(arrive + gap / 2, row, f"{_fmt_bytes(budget)}", ha="center",
                            va="center", fontsize=7,
                            bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.5})


def plot_bench(bench: dict, out: str, source: str = "<bench>") -> str:
    """Bars of the median step time per scheduler, min-max spread, ideal bound.

    Raises:
      PlotError: the results cannot be read.
      extras.MissingExtra: matplotlib is missing.
    """
    rows = parse_bench(bench, source)
    plt = _pyplot()
    width = max(6.0, 1.3 * len(rows) + 2.5)
    fig, ax = plt.subplots(figsize=(width, 5.0))
    x = list(range(len(rows)))
    medians = [r["median"] * 1e3 for r in rows]
    spread = [[m - r["min"] * 1e3 for m, r in zip(medians, rows)],
              [r["max"] * 1e3 - m for m, r in zip(medians, rows)]]
    ax.bar(x, medians, color=[_PALETTE.get(r["scheduler"], "#8172b3") for r in rows],
           edgecolor="black", linewidth=0.5, label="median step time")
    ax.errorbar(x, medians, yerr=spread, fmt="none", ecolor="black", capsize=5,
                linewidth=1, label="min to max of the measurements")
    ideals = [r["ideal"] for r in rows]
    if any(i is not None for i in ideals):
        if len({i for i in ideals if i is not None}) == 1:
            ax.axhline(next(i for i in ideals if i is not None) * 1e3, color="crimson",
                       linestyle="--", linewidth=1.2, label="ideal bound")
        else:
            for xi, ideal in zip(x, ideals):
                if ideal is not None:
                    ax.hlines(ideal * 1e3, xi - 0.45, xi + 0.45, color="crimson",
                              linestyle="--", linewidth=1.2,
                              label="ideal bound" if xi == ideals.index(ideal) else None)
    for xi, m, r in zip(x, medians, rows):
        text = f"{m:.3g} ms"
        if isinstance(r["samples_per_s"], (int, float)):
            text += f"\n{r['samples_per_s']:.4g} samples/s"
        ax.text(xi, m / 2, text, ha="center", va="center", fontsize=8,
                bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1})
    ax.set_xticks(x)
    ax.set_xticklabels([f"{r['scheduler']}\n({r['n']} measurement{'s' * (r['n'] > 1)})"
                        for r in rows], fontsize=9)
    ax.set_ylabel("step time (ms)")
    ax.set_ylim(0, max(max(r["max"] for r in rows) * 1e3,
                       max((i or 0) for i in ideals) * 1e3) * 1.15)
    config = bench.get("config") if isinstance(bench.get("config"), dict) else {}
    # The settings that tell runs apart first, then any other plain value.
    order = [k for k in _BENCH_KEYS if k in config] + [k for k in config if k not in _BENCH_KEYS]
    details = ", ".join(f"{k}={config[k]:.3g}" if isinstance(config[k], float) else
                        f"{k}={config[k]}" for k in order
                        if isinstance(config[k], (str, int, float))
                        and not isinstance(config[k], bool))
    details = textwrap.shorten(details, 3 * int(width * 13), placeholder=" ...")
    ax.set_title("\n".join(["step time per scheduler",
                            *textwrap.wrap(details, int(width * 13))]), fontsize=9)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3,
              frameon=False)
    ax.grid(axis="y", color="0.9")
    ax.set_axisbelow(True)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    logger.info("wrote %s", out)
    return out


def plot_suite(suite: dict, out: str, source: str = "<suite>") -> str:
    """Speedup over FIFO per scheduler, grouped by model and bandwidth, one
    panel per worker count (``prophet-tf bench --suite``).

    Raises:
      PlotError: the suite cannot be read.
      extras.MissingExtra: matplotlib is missing.
    """
    rows = parse_suite(suite, source)
    names = [n for n in dict.fromkeys(n for r in rows for n in r["speedup_vs_fifo"])
             if n != "fifo"]
    workers = sorted({r["workers"] for r in rows})
    plt = _pyplot()
    groups = max(len([r for r in rows if r["workers"] == w]) for w in workers)
    width = max(6.0, 0.3 * groups * (len(names) + 1) + 2.0)
    fig, axes = plt.subplots(len(workers), 1, figsize=(width, 3.2 * len(workers) + 1.0),
                             squeeze=False)
    bar = 0.8 / max(1, len(names))
    for ax, w in zip(axes[:, 0], workers):
        cells = [r for r in rows if r["workers"] == w]
        for i, name in enumerate(names):
            xs = [g + (i - (len(names) - 1) / 2) * bar for g in range(len(cells))]
            ys = [r["speedup_vs_fifo"].get(name) for r in cells]
            shown = [(x, y) for x, y in zip(xs, ys) if y is not None]
            ax.bar([x for x, _ in shown], [y for _, y in shown], bar, label=name,
                   color=_PALETTE.get(name, "#8c8c8c"), edgecolor="black", linewidth=0.4)
            for x, y in shown:
                ax.text(x, y, f"{y:.2f}", ha="center", va="bottom", fontsize=6, rotation=90)
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        top = max((y for r in cells for y in r["speedup_vs_fifo"].values() if y), default=1)
        ax.set_ylim(0, top * 1.2)
        ax.set_xticks(range(len(cells)))
        ax.set_xticklabels([f"{r['model']}\n{r['bandwidth_mbit'] / 1e3:g} Gbit/s" for r in cells],
                           fontsize=8)
        ax.set_ylabel("speedup over FIFO")
        ax.set_title(f"{w} workers, {w} PS (one per worker host)", fontsize=9)
        ax.grid(axis="y", color="0.9")
        ax.set_axisbelow(True)
    definition = suite.get("suite", {})
    axes[0, 0].legend(fontsize=8, ncol=len(names), loc="lower center",
                      bbox_to_anchor=(0.5, 1.12), frameon=False)
    fig.suptitle(f"prophet-tf bench --suite {definition.get('name', '?')}: emulated "
                 f"GPU compute, {definition.get('steps', '?')} steps per run"
                 + ("" if suite.get("complete") else " (incomplete)"), fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    logger.info("wrote %s", out)
    return out
