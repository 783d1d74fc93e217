"""`prophet-tf plot`: a Gantt chart of timelines, or bars of a bench result.

    prophet-tf plot out/worker-0.json out/worker-1.json -o schedule.png [--steps A:B] [--worker I]
    prophet-tf plot out/ -o schedule.png           # every worker-<i>.json in out/
    prophet-tf plot bench.json -o bench.png

The kind of file is told by its content: a Chrome-trace timeline (see
prophet_tf.engine.timeline; ``{"traceEvents": [...]}``) or a bench result
(``{"config": {...}, "results": [{"scheduler": ..., "step_time_s": ...}, ...]}``).

Timelines: one panel per worker, with the steps A..B-1 (default: the last
three steps before the final one), time in ms from the first shown step's
first parameter read. Rows, top to bottom:

- forward: each parameter read (AwaitParam) from when it started waiting to
  when the value was there (a dot: that layer's forward could start), one
  lane per variable, the first layer on top;
- backward: when each gradient became ready, in the same lanes;
- push to PS i / pull from PS i: each transfer, coloured by the priority of
  its most urgent variable (0 = the first layer, needed first); a push block
  of several variables is labelled with their count. The first pull of a
  version starts when it was requested, so it includes the wait for the PS;
- plan (Prophet): for each shown iteration, the plan in force: each predicted
  burst of gradients (grey) and the idle gap after it (hatched) that a block
  of at most the budget shown may fill.

Priority: the op library numbers trainable variables in creation order, and
Keras lists trainable variables (whose order is the priority) in creation
order; so a variable's priority is its rank among the trained variables' keys.

Bench results: one bar per scheduler, the median step time, with the spread
of the measured steps (min to max) and the ideal bound as a line.

Needs matplotlib (``pip install prophet_tf[plot]``), imported only here.
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import logging
import os
import sys
import textwrap

logger = logging.getLogger(__name__)

__all__ = ["PlotError", "WorkerTimeline", "Span", "load", "parse_timeline", "parse_bench",
           "parse_steps", "select_steps", "plan_for_iteration", "plot_timelines", "plot_bench",
           "main"]

#: Steps shown by default: the last ones before the final step.
DEFAULT_STEPS = 3
#: Bench settings named first in the bench plot's title.
_BENCH_KEYS = ("model", "workers", "ps", "bandwidth_mbit", "latency_ms", "global_batch")


class PlotError(ValueError):
    """Input that cannot be plotted; the message names what was received."""


@dataclasses.dataclass(frozen=True)
class Span:
    """One bar: a parameter read or a transfer (times in µs of the trace's clock)."""

    start_us: float
    end_us: float
    priority: int  # of the most urgent variable involved
    step: int  # training step; for a pull, the version
    keys: tuple[str, ...]  # variable names
    nbytes: int = 0


@dataclasses.dataclass
class WorkerTimeline:
    """What one worker's timeline says, ready to draw."""

    source: str
    worker: int
    scheduler: str
    names: list[str]  # by priority
    reads: list[Span]
    ready: list[tuple[float, int, int]]  # (t_us, priority, step)
    pushes: dict[int, list[Span]]  # by PS index
    pulls: dict[int, list[Span]]
    plans: list[tuple[float, dict]]  # (t_us, plan), in time order

    @property
    def steps(self) -> list[int]:
        """The training steps whose gradients are in the timeline."""
        return sorted({step for _, _, step in self.ready})


# -- reading ---------------------------------------------------------------------------------


def load(path: str) -> tuple[str, dict]:
    """Reads a file and tells its kind.

    Returns:
      ("timeline", trace) or ("bench", bench).

    Raises:
      PlotError: unreadable, not JSON, or neither kind.
    """
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise PlotError(f"cannot read {path}: {e.strerror or e}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise PlotError(f"{path} is not JSON ({e}). Received: a file of "
                        f"{os.path.getsize(path)} bytes") from None
    if isinstance(data, dict) and isinstance(data.get("traceEvents"), list):
        return "timeline", data
    if isinstance(data, dict) and isinstance(data.get("results"), list):
        return "bench", data
    what = (f"top-level keys {sorted(data)[:10]}" if isinstance(data, dict)
            else f"a JSON {type(data).__name__}")
    raise PlotError(f"{path} is neither a prophet_tf timeline (a dict with \"traceEvents\") nor "
                    f"a bench result (a dict with \"results\"). Received: {what}")


def parse_timeline(trace: dict, source: str = "<timeline>") -> WorkerTimeline:
    """Turns a worker's Chrome trace (prophet_tf.engine.timeline) into spans and marks.

    Raises:
      PlotError: the trace is not a prophet_tf worker timeline or has no
        training step.
    """
    events = [e for e in trace.get("traceEvents", []) if isinstance(e, dict)]
    metadata = trace.get("metadata") if isinstance(trace.get("metadata"), dict) else {}
    worker = metadata.get("worker")
    if not isinstance(worker, int):
        worker = next((e.get("pid") for e in events if isinstance(e.get("pid"), int)), None)
    by_cat: dict[str, list[dict]] = {}
    try:
        for e in events:
            by_cat.setdefault(e.get("cat"), []).append(e)
        # Op-library key -> name, from the events that carry both.
        key_names: dict[int, str] = {}
        for cat, prefix in (("backward", "grad "), ("forward", "read ")):
            for e in by_cat.get(cat, []):
                key_names.setdefault(int(e["args"]["key"]), e["name"][len(prefix):])
        trained = sorted({int(e["args"]["key"]) for e in by_cat.get("backward", [])}) \
            or sorted(key_names)
        names = [key_names[k] for k in trained]
        priority_of_key = {k: p for p, k in enumerate(trained)}
        priority_of_name = {key_names[k]: p for k, p in priority_of_key.items()}
        lowest = len(names)  # Unknown variables sort after the trained ones.

        def span(e, step_field):
            keys = tuple(e["args"]["keys"])
            ts = float(e["ts"])
            return Span(ts, ts + float(e["dur"]),
                        min((priority_of_name.get(k, lowest) for k in keys), default=lowest),
                        int(e["args"][step_field]), keys, int(e["args"].get("bytes", 0)))

        reads = []
        for e in by_cat.get("forward", []):
            key = int(e["args"]["key"])
            ts = float(e["ts"])
            reads.append(Span(ts, ts + float(e["dur"]), priority_of_key.get(key, lowest),
                              int(e["args"]["step"]), (key_names.get(key, str(key)),)))
        ready = sorted((float(e["ts"]), priority_of_key.get(int(e["args"]["key"]), lowest),
                        int(e["args"]["step"])) for e in by_cat.get("backward", []))
        pushes: dict[int, list[Span]] = {}
        pulls: dict[int, list[Span]] = {}
        for cat, rows, base, field in (("push", pushes, 100, "step"),
                                       ("pull", pulls, 200, "version")):
            for e in by_cat.get(cat, []):
                rows.setdefault(int(e["tid"]) - base, []).append(span(e, field))
        plans = sorted(((float(e["ts"]), dict(e["args"])) for e in by_cat.get("plan", [])),
                       key=lambda p: p[0])
    except (KeyError, TypeError, ValueError) as e:
        raise PlotError(f"{source} is not a prophet_tf worker timeline: an event lacks or "
                        f"mangles {e}. Received: {len(events)} events") from None
    if worker is None or not ready:
        cats = sorted(c for c in by_cat if c)
        raise PlotError(f"{source} has no training step to plot (no gradient-ready events). "
                        f"Received: {len(events)} events, categories {cats}")
    scheduler = next((p.get("scheduler") for _, p in plans if p.get("scheduler")), "unknown")
    return WorkerTimeline(source, int(worker), str(scheduler), names, reads, ready,
                          pushes, pulls, plans)


def parse_bench(bench: dict, source: str = "<bench>") -> list[dict]:
    """The bench results as rows: scheduler, median, spread and ideal, in seconds.

    Raises:
      PlotError: a result lacks its scheduler or step time.
    """
    rows = []
    for i, r in enumerate(bench.get("results", [])):
        if not isinstance(r, dict) or not isinstance(r.get("scheduler"), str) or \
                not isinstance(r.get("step_time_s"), (int, float)):
            raise PlotError(f"{source}: result {i} needs \"scheduler\" and a numeric "
                            f"\"step_time_s\". Received: {r!r:.200}")
        samples = r.get("step_time_s_all", r.get("step_times_s")) or [r["step_time_s"]]
        samples = [float(x) for x in samples if isinstance(x, (int, float))] or \
            [float(r["step_time_s"])]
        ideal = r.get("ideal_step_time_s")
        rows.append({"scheduler": r["scheduler"], "median": float(r["step_time_s"]),
                     "min": min(samples), "max": max(samples), "n": len(samples),
                     "samples_per_s": r.get("samples_per_s"),
                     "ideal": float(ideal) if isinstance(ideal, (int, float)) else None})
    if not rows:
        raise PlotError(f"{source} has no results to plot. Received: \"results\": []")
    return rows


def parse_steps(text: str | None) -> tuple[int | None, int | None] | None:
    """``A:B`` (steps A to B-1, like a Python slice; either may be left out) or ``A``.

    Raises:
      PlotError: anything else.
    """
    if text is None:
        return None
    try:
        if ":" in text:
            first, _, stop = text.partition(":")
            parsed = (int(first) if first.strip() else None, int(stop) if stop.strip() else None)
        else:
            parsed = (int(text), int(text) + 1)
    except ValueError:
        raise PlotError(f"--steps takes A:B (steps A to B-1), A: , :B or A. "
                        f"Received: --steps {text}") from None
    if any(v is not None and v < 0 for v in parsed):
        raise PlotError(f"--steps takes step numbers >= 0. Received: --steps {text}")
    return parsed


def select_steps(timeline: WorkerTimeline, steps: tuple[int | None, int | None] | None):
    """The steps to show and their time window.

    Returns:
      (steps, t0_us, t1_us): t0 is the first shown step's first parameter
      read, t1 the end of the last transfer of the shown steps (pushes of the
      steps, pulls of the versions they make).

    Raises:
      PlotError: the range holds no step of this timeline.
    """
    have = timeline.steps
    if steps is None:
        last = have[-2] if len(have) > DEFAULT_STEPS else have[-1]
        chosen = [s for s in have if last - DEFAULT_STEPS < s <= last]
    else:
        first, stop = steps
        chosen = [s for s in have if (first is None or s >= first) and (stop is None or s < stop)]
    if not chosen:
        text = f"{'' if steps[0] is None else steps[0]}:{'' if steps[1] is None else steps[1]}"
        raise PlotError(f"--steps {text} selects no step of worker {timeline.worker} "
                        f"({timeline.source} has steps {have[0]} to {have[-1]}). "
                        f"Received: --steps {text}")
    lo, hi = chosen[0], chosen[-1]
    starts = [s.start_us for s in timeline.reads if s.step == lo] + \
        [t for t, _, step in timeline.ready if step == lo]
    ends = [t for t, _, step in timeline.ready if lo <= step <= hi]
    ends += [s.end_us for spans in timeline.pushes.values() for s in spans if lo <= s.step <= hi]
    ends += [s.end_us for spans in timeline.pulls.values() for s in spans
             if lo < s.step <= hi + 1]
    return chosen, min(starts), max(ends)


def plan_for_iteration(timeline: WorkerTimeline, step: int) -> dict | None:
    """The scheduler plan in force during training step `step`.

    A plan is recorded (with the iteration it was recorded in) when the first
    gradient of a later step arrives and the plan changed since the last record;
    the plan in force during `step` is the latest one recorded in `step` or before.
    """
    chosen = None
    for _, plan in timeline.plans:
        iteration = plan.get("iteration")
        if (-1 if iteration is None else iteration) <= step:
            chosen = plan
    return chosen


# -- drawing ---------------------------------------------------------------------------------


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("prophet-tf plot needs matplotlib: pip install prophet_tf[plot] "
                           "(or pip install matplotlib)") from None
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
      RuntimeError: matplotlib is missing.
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
      RuntimeError: matplotlib is missing.
    """
    rows = parse_bench(bench, source)
    plt = _pyplot()
    width = max(6.0, 1.3 * len(rows) + 2.5)
    fig, ax = plt.subplots(figsize=(width, 5.0))
    x = list(range(len(rows)))
    medians = [r["median"] * 1e3 for r in rows]
    spread = [[m - r["min"] * 1e3 for m, r in zip(medians, rows)],
              [r["max"] * 1e3 - m for m, r in zip(medians, rows)]]
    palette = {"fifo": "#9e9e9e", "p3": "#4c72b0", "bytescheduler": "#dd8452",
               "prophet": "#55a868"}
    ax.bar(x, medians, color=[palette.get(r["scheduler"], "#8172b3") for r in rows],
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


# -- command line ----------------------------------------------------------------------------


def _expand(paths: list[str]) -> list[str]:
    files = []
    for path in paths:
        if os.path.isdir(path):
            found = sorted(glob.glob(os.path.join(path, "worker-*.json")))
            if not found:
                raise PlotError(f"{path} is a directory without worker-<i>.json timelines. "
                                f"Received: {sorted(os.listdir(path))[:10]}")
            files.extend(found)
        else:
            files.append(path)
    return files


def run(paths: list[str], out: str, steps: str | None = None, worker: int | None = None) -> str:
    """Plots the files (timelines or one bench result) into `out`; returns `out`.

    Raises:
      PlotError: bad input (see the module doc); RuntimeError: no matplotlib.
    """
    out_dir = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(out_dir):
        raise PlotError(f"the directory of the output does not exist. Received: -o {out}")
    loaded = [(path, *load(path)) for path in _expand(paths)]
    kinds = {kind for _, kind, _ in loaded}
    if kinds == {"bench"}:
        if len(loaded) > 1 or steps is not None or worker is not None:
            raise PlotError("a bench result is plotted alone, without --steps or --worker. "
                            f"Received: {len(loaded)} file(s), --steps {steps}, "
                            f"--worker {worker}")
        path, _, data = loaded[0]
        return plot_bench(data, out, path)
    if len(kinds) > 1:
        raise PlotError("give timelines or one bench result, not both. Received: "
                        + ", ".join(f"{path} ({kind})" for path, kind, _ in loaded))
    timelines = [parse_timeline(data, path) for path, _, data in loaded]
    if worker is not None:
        chosen = [t for t in timelines if t.worker == worker]
        if not chosen:
            raise PlotError(f"no timeline of worker {worker} among the files given. Received: "
                            f"--worker {worker}; workers {sorted({t.worker for t in timelines})}")
        timelines = chosen
    timelines.sort(key=lambda t: t.worker)
    return plot_timelines(timelines, out, parse_steps(steps))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="prophet-tf plot", description=__doc__.split("\n\n")[0],
        usage="prophet-tf plot TIMELINE.json [more.json ...] -o OUT.png [--steps A:B] "
              "[--worker I]\n       prophet-tf plot BENCH.json -o OUT.png")
    parser.add_argument("files", nargs="+",
                        help="worker timelines (files or directories of worker-<i>.json), or "
                             "one bench result JSON")
    parser.add_argument("-o", "--output", required=True,
                        help="image to write; the format follows the extension (png, svg, pdf)")
    parser.add_argument("--steps", default=None, metavar="A:B",
                        help="training steps A to B-1 (A:, :B and A also work); default: "
                             f"the last {DEFAULT_STEPS} before the final step")
    parser.add_argument("--worker", type=int, default=None, metavar="I",
                        help="only worker I's timeline")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        path = run(args.files, args.output, args.steps, args.worker)
    except PlotError as e:
        print(f"prophet-tf plot: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # matplotlib missing
        print(f"prophet-tf plot: {e}", file=sys.stderr)
        return 1
    except ValueError as e:  # e.g. matplotlib does not know the extension
        print(f"prophet-tf plot: cannot write {args.output}: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
