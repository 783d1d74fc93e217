"""`prophet-tf plot`: a Gantt chart of timelines, or bars of a bench result or suite.

    prophet-tf plot out/worker-0.json out/worker-1.json -o schedule.png [--steps A:B] [--worker I]
    prophet-tf plot out/ -o schedule.png           # every worker-<i>.json in out/
    prophet-tf plot bench.json -o bench.png
    prophet-tf plot suite.json -o suite.png

The kind of file is told by its content: a Chrome-trace timeline (see
prophet_tf.engine.timeline; ``{"traceEvents": [...]}``), a bench result
(``{"config": {...}, "results": [{"scheduler": ..., "step_time_s": ...}, ...]}``)
or a bench suite (``prophet-tf bench --suite``; ``{"suite": {...}, "cells":
[...]}``).

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

Bench suites (as the paper draws its results): one panel per worker count,
one group of bars per model and bandwidth, each bar a scheduler's speedup over
FIFO in that cell (FIFO's step time over the scheduler's).

Needs matplotlib (``pip install prophet_tf[plot]``), imported only by the drawing
(prophet_tf.tools.drawing), when one is made.
"""
from __future__ import annotations

import argparse
import glob
import os
import sys

# The parsing, re-exported: `prophet_tf.tools.plot.parse_timeline` and the others.
from prophet_tf.tools.plot_data import (DEFAULT_STEPS, PlotError, Span, WorkerTimeline, load,
                                        parse_bench, parse_steps, parse_suite, parse_timeline,
                                        plan_for_iteration, select_steps)

__all__ = ["PlotError", "WorkerTimeline", "Span", "load", "parse_timeline", "parse_bench",
           "parse_suite", "parse_steps", "select_steps", "plan_for_iteration", "run", "main"]


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
      PlotError: bad input (see the module doc); extras.MissingExtra: no matplotlib.
    """
    out_dir = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(out_dir):
        raise PlotError(f"the directory of the output does not exist. Received: -o {out}")
    loaded = [(path, *load(path)) for path in _expand(paths)]
    kinds = {kind for _, kind, _ in loaded}
    whole = {"bench": ("a bench result", "plot_bench"), "suite": ("a bench suite", "plot_suite")}
    if len(kinds) == 1 and next(iter(kinds)) in whole:
        what, draw = whole[next(iter(kinds))]
        if len(loaded) > 1 or steps is not None or worker is not None:
            raise PlotError(f"{what} is plotted alone, without --steps or --worker. "
                            f"Received: {len(loaded)} file(s), --steps {steps}, "
                            f"--worker {worker}")
        path, _, data = loaded[0]
        from prophet_tf.tools import drawing  # matplotlib: only when drawing
        return getattr(drawing, draw)(data, out, path)
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
    from prophet_tf.tools import drawing  # matplotlib: only when drawing
    return drawing.plot_timelines(timelines, out, parse_steps(steps))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="prophet-tf plot", description=__doc__.split("\n\n")[0],
        usage="prophet-tf plot TIMELINE.json [more.json ...] -o OUT.png [--steps A:B] "
              "[--worker I]\n       prophet-tf plot BENCH.json -o OUT.png\n"
              "       prophet-tf plot SUITE.json -o OUT.png")
    parser.add_argument("files", nargs="+",
                        help="worker timelines (files or directories of worker-<i>.json), "
                             "one bench result JSON, or one bench suite JSON")
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
    except ValueError as e:  # e.g. matplotlib does not know the extension
        print(f"prophet-tf plot: cannot write {args.output}: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
