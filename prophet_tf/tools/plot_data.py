"""What `prophet-tf plot` draws, read and checked: timelines, bench results and suites.

Parsing only, no drawing and no matplotlib: prophet_tf.tools.plot (the command)
and prophet_tf.tools.drawing (matplotlib) both build on it. The file formats are
described in prophet_tf.tools.plot.
"""
from __future__ import annotations

import dataclasses
import json
import os

__all__ = ["PlotError", "WorkerTimeline", "Span", "DEFAULT_STEPS", "load", "parse_timeline",
           "parse_bench", "parse_suite", "parse_steps", "select_steps", "plan_for_iteration"]

#: Steps shown by default: the last ones before the final step.
DEFAULT_STEPS = 3


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
      ("timeline", trace), ("bench", bench) or ("suite", suite).

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
    if isinstance(data, dict) and isinstance(data.get("cells"), list) and \
            isinstance(data.get("suite"), dict):
        return "suite", data
    what = (f"top-level keys {sorted(data)[:10]}" if isinstance(data, dict)
            else f"a JSON {type(data).__name__}")
    raise PlotError(f"{path} is neither a prophet_tf timeline (a dict with \"traceEvents\"), "
                    f"a bench result (a dict with \"results\") nor a bench suite (a dict with "
                    f"\"suite\" and \"cells\"). Received: {what}")


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


def parse_suite(suite: dict, source: str = "<suite>") -> list[dict]:
    """A bench suite's cells as rows (``prophet_tf.bench.suite.summary``).

    Raises:
      PlotError: a cell lacks its configuration or results, or no cell ran FIFO.
    """
    from prophet_tf.bench import suite as suite_lib

    for i, c in enumerate(suite["cells"]):
        if not (isinstance(c, dict) and isinstance(c.get("cell"), dict)
                and isinstance(c.get("config"), dict) and isinstance(c.get("results"), list)):
            raise PlotError(f"{source}: cell {i} needs \"cell\", \"config\" and \"results\". "
                            f"Received: {c!r:.200}")
        parse_bench(c, f"{source} cell {i}")
    try:
        rows = suite_lib.summary(suite)
    except (KeyError, TypeError, ZeroDivisionError) as e:
        raise PlotError(f"{source}: a cell cannot be summarised ({type(e).__name__}: {e})") \
            from None
    if not rows or not any(r["speedup_vs_fifo"].get("fifo") for r in rows):
        raise PlotError(f"{source}: speedups are over FIFO, and no cell has a FIFO run. "
                        f"Received: {len(rows)} cell(s)")
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


# -- command line ----------------------------------------------------------------------------
