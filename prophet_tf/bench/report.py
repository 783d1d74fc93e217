"""`prophet-tf report`: the README's result tables, rendered from committed JSON.

    prophet-tf report README.md            # rewrite every marked table
    prophet-tf report README.md --check    # exit 1 if one differs from its JSON

A table is marked in the Markdown by the JSON it comes from::

    <!-- table: bench benchmarks/bench-colocated.json -->
    ...generated lines...
    <!-- end table -->

Kinds: ``bench`` (a ``prophet-tf bench --json`` result: median step time,
range, throughput, ratios to FIFO, tf-mwms and the ideal bound), ``suite``
(a ``prophet-tf bench --suite`` result: one row per cell, each scheduler's
speedup over FIFO and Prophet's ratios), ``targets`` (the same result against
the suite's targets, each marked met or missed) and ``validate`` (a ``prophet-tf
simulate --validate --json`` result: measured against predicted) and
``runs`` (a glob of bench results of one configuration, e.g. a setting on
and off: a row per run and scheduler) and ``phases`` (a bench result's
``link_phases``: the links' load through the step) and ``events`` (the
``step_events`` of ``benchmarks/timeline_breakdown.py --json``: where in
the step its exchange ends, run by run; ``leads``: its ``answer_leads``, how
early gRPC took each answer, and phase offsets; ``modes``: steps together
and apart) and ``flowshare`` (a ``benchmarks/flow_share.py`` result: how
evenly connections shared a shaped link, message by message); the rest of
``_KINDS`` in modules of their own. Paths are relative to the Markdown file.
One kind names a module instead of JSON: ``environment`` (the user guide's
environment variables, ``<!-- table: environment prophet_tf.environment -->``).
The tests run ``--check`` on every Markdown file: no table can drift from its data.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys

from prophet_tf.bench import (cut_table, leads_table, profile_table, speed_table, sweep_table,
                              transport_table)

__all__ = ["bench_table", "events_table", "flow_share_table", "phases_table", "runs_table",
           "suite_table", "targets_table", "validate_table", "environment_table", "render",
           "main"]

_BLOCK = re.compile(r"(<!-- table: (\w+) (\S+) -->\n)(.*?)(<!-- end table -->)", re.S)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def _vs_ideal(config: dict, r: dict) -> str:
    """A run's step over the ideal bound. The bound holds for the all-reduce
    only with colocated PS tasks (``ideal``'s module doc; with dedicated PS
    hosts it counts the PS links' bytes, which tf-mwms does not send) and
    emulated compute (with real compute, tf_keras's model computes in its own
    time, not in the profile's)."""
    if r["scheduler"] == "tf-mwms" and (config.get("layout"), config.get("compute")) != (
            "colocated", "emulated"):
        return "–"
    return f"{r['step_time_s'] / r['ideal_step_time_s']:.2f}"


def _link_columns(loads: dict | None) -> str:
    """A run's uplink loads (lowest–highest host) and its busiest link, over
    hosts and directions (``link_load.link_loads``)."""
    from prophet_tf.bench import link_load

    sent = [v for v in (loads or {}).get("sent", []) if v is not None]
    busiest = link_load.busiest_load(loads)
    return (f"{min(sent):.2f}–{max(sent):.2f}" if sent else "–") + " | " + (
        "–" if busiest is None else f"{busiest:.2f}")


def bench_table(result: dict) -> str:
    """Markdown lines for a bench result, one row per scheduler; results that
    measured the link loads (on the emulated network) add two columns."""
    config, rows = result["config"], result["results"]
    by = {r["scheduler"]: r["step_time_s"] for r in rows}
    links = any(r.get("link_load") for r in rows)
    lines = ["| scheduler | step time (median) | range over runs | samples/s | vs FIFO | "
             "vs tf-mwms | vs ideal | CPU busy |" + (" uplinks' load | busiest link |"
                                                    if links else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|---|" if links else "")]
    for r in rows:
        step = r["step_time_s"]
        ratios = [f"{step / by[ref]:.2f}" if ref in by else "–" for ref in ("fifo", "tf-mwms")]
        vs_ideal = _vs_ideal(config, r)
        # Cores in use by the run's processes together (older runs lack it).
        busy = r.get("cpu_busy")
        busy = f"{sum(busy.values()):.2f}" if busy else "–"
        lines.append(
            f"| {r['scheduler']} | {_ms(step)} ms | {_ms(min(r['step_time_s_all']))}–"
            f"{_ms(max(r['step_time_s_all']))} | {r['samples_per_s']:.1f} | {ratios[0]} | "
            f"{ratios[1]} | {vs_ideal} | {busy} |"
            + (f" {_link_columns(r.get('link_load'))} |" if links else ""))
    lines.append("")
    lines.append(_caption(config, _count(len(rows[0]["step_time_s_all"]), "run")))
    return "\n".join(lines) + "\n"


def _caption(config: dict, runs: str) -> str:
    ideal = config["ideal"]
    layout = config.get("layout", "dedicated")
    scale = config.get("time_scale", 1.0)
    return (
        f"{config['model']}, {config['workers']} workers, {config['ps']} PS ({layout}), "
        f"{config['bandwidth_mbit']:g} Mbit/s"
        + (f" at time scale {scale:g} (links {config['link_mbit']:g} Mbit/s, compute "
           f"×{scale:g}; step times as measured)" if scale != 1 else "")
        + f", {runs} of "
        f"{config['steps']} steps; compute {_ms(config['compute_s'])} ms; ideal "
        f"{_ms(ideal['ideal_s'])} ms = max(compute {_ms(ideal['compute_s'])}, busiest link "
        f"{_ms(ideal['busiest_link_s'])}"
        + (f", critical chain {_ms(ideal['chain_s'])}" if "chain_s" in ideal else "") + ").")


#: What may differ between the runs of one ``runs`` table: settings (pushes_first
#: only at commit 24fed3e), the schedulers, and what each run measures (its compute).
_RUN_SETTINGS = ("answers_first", "pushes_first", "host_queue", "schedulers", "global_clipnorm",
                 "compute_s", "compute_s_all", "ideal", "profile")


def runs_table(runs: list[tuple[str, dict]]) -> str:
    """Markdown lines for several bench results of one configuration (named
    by their files, e.g. side-by-side runs of a setting), a row per run and
    scheduler.

    Raises:
      ValueError: runs of different configurations.
    """
    def setup(config):
        return {k: v for k, v in config.items() if k not in _RUN_SETTINGS}
    first = setup(runs[0][1]["config"])
    for name, result in runs[1:]:
        if setup(result["config"]) != first:
            differ = sorted(k for k in set(first) | set(setup(result["config"]))
                            if first.get(k) != result["config"].get(k))
            raise ValueError(f"a runs table needs runs of one configuration. Received: "
                             f"{name} differs from {runs[0][0]} in {differ}")
    lines = ["| run | scheduler | step time | vs ideal | CPU busy |", "|---|---|---|---|---|"]
    for name, result in runs:
        for r in result["results"]:
            busy = r.get("cpu_busy")
            busy = f"{sum(busy.values()):.2f}" if busy else "–"
            vs_ideal = _vs_ideal(result["config"], r)
            lines.append(f"| {os.path.splitext(name)[0]} | {r['scheduler']} | "
                         f"{_ms(r['step_time_s'])} ms | {vs_ideal} | {busy} |")
    lines.append("")
    config = runs[0][1]["config"]  # compute and ideal: the first run's (a row's: its own)
    lines.append(_caption(config, f"{_count(len(runs), 'run')} of "
                          f"{_count(config.get('reps', 1), 'rep')} each"))
    return "\n".join(lines) + "\n"


def suite_table(result: dict) -> str:
    """Markdown lines for a bench suite: per cell, FIFO's step at the cluster's
    scale, every other scheduler's speedup over FIFO, and Prophet's ratios."""
    from prophet_tf.bench import suite as suite_lib

    rows = suite_lib.summary(result)
    names = [n for n in result["suite"]["schedulers"].split(",") if n != "fifo"]

    def f(x):
        return "–" if x is None else f"{x:.2f}"
    lines = ["| model | workers | Gbit/s | FIFO step | "
             + " | ".join(f"{n} vs FIFO" for n in names)
             + " | Prophet / tf-mwms | Prophet / best of P3, BS | Prophet / ideal"
             " | tf-mwms / ideal | answers first |",
             "|---|---|---|---|" + "---|" * (len(names) + 5)]
    setting = {True: "on", False: "off", None: "–"}
    for r in rows:
        fifo = r["cluster_step_s"].get("fifo")
        lines.append(f"| {r['model']} | {r['workers']} | {r['bandwidth_mbit'] / 1e3:g} | "
                     f"{'–' if fifo is None else _ms(fifo) + ' ms'} | "
                     + " | ".join(f"{f(r['speedup_vs_fifo'].get(n))}×" for n in names)
                     + f" | {f(r['prophet_vs_tf_mwms'])} | {f(r['prophet_vs_rival'])} | "
                       f"{f(r['prophet_vs_ideal'])} | {f(r['tf_mwms_vs_ideal'])} | "
                       f"{setting[r['answers_first']]} |")
    d = result["suite"]
    lines.append("")
    lines.append(f"{len(rows)} of {len(suite_lib.cells(suite_lib.Suite.from_json(d)))} "
                 f"cells{'' if result.get('complete') else ' (incomplete)'}; "
                 f"{d['steps']} steps per run ({d['reps']} run per scheduler and cell), step "
                 f"times at the cluster's scale (measured / time scale)"
                 + ("; answers first –: run before the bench recorded the setting."
                    if any(r["answers_first"] is None for r in rows) else "."))
    return "\n".join(lines) + "\n"


def targets_table(result: dict) -> str:
    """Markdown lines for a bench suite against its targets
    (``suite.TARGETS``): per cell Prophet's ratios, each marked met or
    missed, and the lowest ratio to tf-mwms the ideal bound allows; a line
    of counts."""
    from prophet_tf.bench import suite as suite_lib

    t = suite_lib.targets(result)
    limit = {k: f"{x:.1f}" if round(x, 1) == x else f"{x:.2f}"
             for k, x in suite_lib.TARGETS.items()}

    def f(x, met=None):
        if x is None:
            return "–"
        return f"{x:.2f}" + ("" if met is None else " ✓" if met else " ✗")
    lines = [f"| model | workers | Gbit/s | Prophet / tf-mwms (≤ {limit['vs_tf_mwms']}) | "
             f"lowest possible (ideal / tf-mwms) | Prophet / ideal (≤ {limit['vs_ideal']}) | "
             f"Prophet / best of P3, BS (≤ {limit['vs_rival']}; "
             f"≤ {limit['vs_rival_somewhere']} somewhere) |",
             "|---|---|---|---|---|---|---|"]
    for r in t["rows"]:
        lines.append(f"| {r['model']} | {r['workers']} | {r['bandwidth_mbit'] / 1e3:g} | "
                     f"{f(r['prophet_vs_tf_mwms'], r['met_vs_tf_mwms'])} | "
                     f"{f(r['floor_vs_tf_mwms'])} | "
                     f"{f(r['prophet_vs_ideal'], r['met_vs_ideal'])} | "
                     f"{f(r['prophet_vs_rival'], r['met_vs_rival'])} |")
    met, n = t["met"], t["cells"]
    lines.append("")
    lines.append(f"Of {n} cells, Prophet is at most {limit['vs_tf_mwms']}x tf-mwms in "
                 f"{met['vs_tf_mwms']} (the ideal bound allows it in "
                 f"{t['reachable_vs_tf_mwms']}), at most {limit['vs_ideal']}x the bound in "
                 f"{met['vs_ideal']}, at most {limit['vs_rival']}x the better of P3 and "
                 f"ByteScheduler in {met['vs_rival']} and at most "
                 f"{limit['vs_rival_somewhere']}x in {met['vs_rival_somewhere']}"
                 + (f"; no cell of {', '.join(t['models_not_run'])} ran." if t["models_not_run"]
                    else "."))
    return "\n".join(lines) + "\n"


def validate_table(result: dict) -> str:
    """Markdown lines for a ``simulate --validate`` result (of several runs: a
    column names each); with uneven link
    sharing (``--flow-share``), also each run's range over the seeds and how
    far apart the simulated workers started their steps (median)."""
    cells = "model" in (result["validation"] or [{}])[0]  # of a bench suite
    runs = "run" in (result["validation"] or [{}])[0]  # several runs predicted
    seeded = any(r.get("share_sigma") for r in result["validation"])
    lines = ["| " + ("model | workers | Gbit/s | " if cells else "")
             + ("run | " if runs else "")
             + "scheduler | measured | predicted | error |"
             + (" range over seeds | workers apart |" if seeded else ""),
             "|---|---|---|---|" + ("---|---|---|" if cells else "")
             + ("---|" if runs else "") + ("---|---|" if seeded else "")]
    for r in result["validation"]:
        where = (f"{r['model']} | {r['workers']} | {r['bandwidth_mbit'] / 1e3:g} | "
                 if cells else "")
        if runs:
            where += f"{r['run'].removesuffix('.json')} | "
        spread = ""
        if seeded:
            low, high = r["predicted_range_s"]
            spread = (f" {_ms(low)}–{_ms(high)} ms | "
                      f"{r['predicted_phase_spread_s']:.2f} s |")
        lines.append(f"| {where}{r['scheduler']} | {_ms(r['measured_s'])} ms | "
                     f"{_ms(r['predicted_s'])} ms | {r['error']:+.1%} |{spread}")
    return "\n".join(lines) + "\n"


def phases_table(result: dict) -> str:
    """Markdown lines for a bench result's ``link_phases``: per scheduler and
    direction, the hosts' mean link load in each part of the step.

    Raises:
      ValueError: a result that did not measure them.
    """
    rows = [r for r in result["results"] if r.get("link_phases")]
    if not rows:
        raise ValueError("a phases table needs a bench result with link_phases (a run on "
                         f"the emulated network). Received: schedulers "
                         f"{[r['scheduler'] for r in result['results']]} without them")
    bins = len(next(h for h in rows[0]["link_phases"]["sent"] if h))
    lines = ["| scheduler | link | " + " | ".join(
        f"{100 * k // bins}–{100 * (k + 1) // bins}%" for k in range(bins)) + " |",
        "|---|---|" + "---|" * bins]
    for r in rows:
        for side, name in (("sent", "up"), ("received", "down")):
            hosts = [h for h in r["link_phases"][side] if h]
            means = [sum(part) / len(hosts) for part in zip(*hosts)]
            lines.append(f"| {r['scheduler']} | {name} | "
                         + " | ".join(f"{m:.2f}" for m in means) + " |")
    lines.append("")
    lines.append(_caption(result["config"], _count(len(rows[0]["step_time_s_all"]), "run"))
                 + " Each host's load in each part of its worker's step, averaged over "
                   "the measured steps and then over the hosts.")
    return "\n".join(lines) + "\n"


def _fraction(x: float) -> str:
    """Two decimals, without a "-0.00" for a hair before the step's start."""
    return f"{0.0 if -0.005 < x < 0 else x:.2f}"


def events_table(result: dict) -> str:
    """Markdown lines for the ``step_events`` of ``benchmarks/timeline_breakdown.py
    --json``: a row per event, a column per run, each the median fraction of
    the worker's step at which the event came (and its range), then the
    links' load per tenth of the step.

    Raises:
      ValueError: a result without step events.
    """
    runs = result.get("step_events") or {}
    if not runs:
        raise ValueError("an events table needs the step_events of timeline_breakdown.py "
                         f"--json (runs kept with their run.json). Received: keys "
                         f"{sorted(result)}")
    names = list(runs)
    lines = ["| event | " + " | ".join(os.path.basename(n) for n in names) + " |",
             "|---|" + "---|" * len(names)]
    first = runs[names[0]]["events"]
    for event in first:
        cells = []
        for n in names:
            low, high = runs[n]["events_range"][event]
            median = runs[n]["events"][event]
            cells.append(f"{_fraction(median)} ({_fraction(low)}–{_fraction(high)})")
        lines.append(f"| {event} | " + " | ".join(cells) + " |")
    bins = len(runs[names[0]]["link_load"]["sent"])
    for side, name in (("sent", "up"), ("received", "down")):
        lines.append(f"| link load {name} | " + " | ".join(
            " ".join("–" if x is None else f"{x:.2f}" for x in runs[n]["link_load"][side])
            for n in names) + " |")
    lines.append("")
    lines.append(f"Fractions of each worker's step (batch end to batch end), median over "
                 f"workers and measured steps (range); link loads per {100 // bins}% of the "
                 f"step, averaged over hosts and steps. From `{result['command']}`.")
    return "\n".join(lines) + "\n"


def flow_share_table(result: dict) -> str:
    """Markdown lines for a ``benchmarks/flow_share.py`` result: per number
    of connections, the messages' rate over the fair share, their times,
    the simulator's fitted ``share_sigma``, and where the result has them,
    each run's slowest connection's share of the messages and what the
    sender's queue dropped and its TCP retransmitted."""
    cases = sorted(result["by_connections"].items(), key=lambda kv: int(kv[0]))
    by_connection = all("connection_shares_by_run" in c for _, c in cases)
    extra = (" slowest connection's share, by run | dropped / retransmitted |"
             if by_connection else "")
    lines = ["| connections | messages | rate / fair share (median) | median by run "
             "| time 10% / 50% / 90% | time at the fair share | share_sigma |" + extra,
             "|---|---|---|---|---|---|---|" + ("---|---|" if by_connection else "")]
    for k, c in cases:
        deciles = c["duration_deciles_ms"]
        line = (f"| {k} | {c['messages']} | {c['median_ratio']:.2f} | "
                + ", ".join(f"{x:.2f}" for x in c["median_ratio_by_run"])
                + f" | {deciles[0]:.1f} / {deciles[4]:.1f} / {deciles[8]:.1f} ms | "
                f"{result['message_bytes'] * int(k) / result['payload_bytes_per_s'] * 1e3:.1f}"
                f" ms | {c['share_sigma']:.2f} |")
        if by_connection:
            line += (" " + ", ".join(f"{min(shares):.2f}"
                                     for shares in c["connection_shares_by_run"])
                     + f" | {c['dropped_packets']} / {c['retransmitted_segments']} |")
        lines.append(line)
    lines.append("")
    queue = (f", {result['host_queue']} sender queue, TCP {result['congestion']}"
             if "host_queue" in result and "congestion" in result else "")
    lines.append(f"Links at {result['link_mbit']:g} Mbit/s{queue}, messages of "
                 f"{result['message_bytes'] // 1024} KiB, {_count(result['reps'], 'run')} of "
                 f"{result['measured_s']:g} s per case. From `{result['command']}`.")
    return "\n".join(lines) + "\n"


_KINDS = {"bench": bench_table, "suite": suite_table, "targets": targets_table,
          "validate": validate_table, "runs": runs_table, "phases": phases_table,
          "events": events_table, "flowshare": flow_share_table, "cuts": cut_table.cuts_table,
          "sweep": sweep_table.sweep_table, "profile": profile_table.profile_table,
          "leads": leads_table.leads_table, "modes": leads_table.modes_table,
          "simspeed": speed_table.speed_table, **transport_table.KINDS}


def environment_table(module: str) -> str:
    """The environment variables' table, from the module that declares them."""
    from prophet_tf import environment

    if module != environment.__name__:
        raise ValueError(f"an environment table comes from {environment.__name__}. "
                         f"Received: {module!r}")
    return environment.markdown_table()


# Kinds rendered from a module named in the marker, not from a JSON file.
_MODULE_KINDS = {"environment": environment_table}


def render(markdown: str, base: str) -> str:
    """``markdown`` with every marked table regenerated from its JSON.

    Raises:
      ValueError: an unknown kind; FileNotFoundError: a missing JSON.
    """
    def one(match):
        kind, path = match.group(2), match.group(3)
        if kind in _MODULE_KINDS:
            return match.group(1) + _MODULE_KINDS[kind](path) + match.group(5)
        if kind not in _KINDS:
            raise ValueError(f"unknown table kind; valid: {', '.join([*_KINDS, *_MODULE_KINDS])}. "
                             f"Received: {kind!r} for {path}")
        if kind == "runs":  # a glob: several files, in name order
            paths = sorted(glob.glob(os.path.join(base, path)))
            if not paths:
                raise FileNotFoundError(f"no file matches {path}")
            data = []
            for p in paths:
                with open(p) as f:
                    data.append((os.path.basename(p), json.load(f)))
        else:
            with open(os.path.join(base, path)) as f:
                data = json.load(f)
        return match.group(1) + _KINDS[kind](data) + match.group(5)
    return _BLOCK.sub(one, markdown)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prophet-tf report",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("markdown", help="a Markdown file with marked tables (README.md)")
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 if a table differs from its JSON")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        with open(args.markdown) as f:
            text = f.read()
        new = render(text, os.path.dirname(os.path.abspath(args.markdown)))
    except (OSError, ValueError, KeyError) as e:
        print(f"prophet-tf report: {e}", file=sys.stderr)
        return 2
    tables = len(_BLOCK.findall(text))
    if args.check:
        if new != text:
            print(f"prophet-tf report: {args.markdown}: a table differs from its JSON; run "
                  f"`prophet-tf report {args.markdown}`", file=sys.stderr)
            return 1
        print(f"{args.markdown}: {tables} table(s) match their JSON")
        return 0
    if new != text:
        with open(args.markdown, "w") as f:
            f.write(new)
    print(f"{args.markdown}: {tables} table(s) rendered")
    return 0


if __name__ == "__main__":
    sys.exit(main())
