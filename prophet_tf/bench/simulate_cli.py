"""`prophet-tf simulate`: the command line around prophet_tf.bench.simulate.

One configuration, a sweep over worker counts and bandwidths with its plot
(prophet_tf.bench.simulate_sweep), a prediction of a `prophet-tf bench` run
(``--validate``), or a new per-layer profile (``--profile``). The simulation
itself is prophet_tf.bench.simulate, and tf-mwms's ring all-reduce
prophet_tf.bench.simulate_ring.
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import logging
import os
import statistics
import sys
from typing import Sequence

from prophet_tf import extras
from prophet_tf.bench import message_costs, saved_profiles, simulate as simulate_lib
from prophet_tf.bench import simulate_ring, simulate_sweep
from prophet_tf.bench.simulate_sweep import parse_spec
from prophet_tf.bench.simulate_flow_share import share_sigma_for, uplink_connections
from prophet_tf.bench import suite as suite_lib
from prophet_tf.engine import schedulers as schedulers_lib

__all__ = ["validate", "main"]

#: What `prophet-tf simulate` runs without --schedulers (--validate: every one the run has).
DEFAULT_SCHEDULERS = "fifo,p3,bytescheduler,prophet"


def _parse(argv):
    parser = argparse.ArgumentParser(
        prog="prophet-tf simulate", description=simulate_lib.__doc__.split("\n\n")[0],
        epilog="Profiles live in prophet_tf/bench/profiles/<model>.json "
               "(make one with --profile MODEL).")
    parser.add_argument("--model", default="resnet50",
                        help="profiled model name or a profile .json (default resnet50)")
    parser.add_argument("--workers", type=int, default=16, help="W (default 16)")
    parser.add_argument("--ps", type=int, default=None,
                        help="PS tasks (default: one per worker host when colocated, else 1, "
                             "as in `prophet-tf bench`)")
    # The same default as `prophet-tf bench`: the layout the README recommends.
    parser.add_argument("--layout", default=None, choices=simulate_lib.LAYOUTS,
                        help="colocated: PS task i on worker host i %% W (--ps a multiple of "
                             "--workers); dedicated: PS hosts of their own (default "
                             "colocated, as in `prophet-tf bench`; dedicated with --sweep)")
    parser.add_argument("--bandwidth-mbit", type=float, default=10000.0,
                        help="each link's bandwidth per direction (default 10000)")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="one-way latency")
    parser.add_argument("--schedulers", default=None,
                        help="comma-separated, each with options as in `prophet-tf bench`, "
                             "e.g. fifo,prophet:blocks_in_flight=4, and tf-mwms (its ring "
                             "all-reduce; tf-mwms:bytes_per_pack=N) (default "
                             f"{DEFAULT_SCHEDULERS}; with --validate, every one the run has)")
    parser.add_argument("--iterations", type=int, default=None,
                        help=f"steps to simulate (default {simulate_lib.WARMUP_ITERATIONS} warm-up + 8)")
    parser.add_argument("--compute-s", type=float, default=None,
                        help="scale the profile to this compute time per step")
    parser.add_argument("--rpc-overhead-ms", type=float, default=simulate_lib.DEFAULT_RPC_OVERHEAD_S * 1e3,
                        help="fixed cost per message (default %(default)s; --validate uses "
                             "the costs the bench measured)")
    parser.add_argument("--rate-lag-ms", type=float,
                        default=simulate_lib.DEFAULT_RATE_LAG_S * 1e3,
                        help="how late the links' shares may follow flows' starts and ends "
                             "(default %(default)s; 0 recomputes them at every change, "
                             "exact but slow from 16 workers)")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--jobs", type=int, default=None,
                        help="simulations run at once, one process each (default: the "
                             "cores this process may use); results do not depend on it")
    parser.add_argument("--sweep", action="store_true",
                        help="workers x 1-25 Gbit/s: dedicated, one PS host per 4 workers; "
                             "colocated, a PS task on every worker host")
    parser.add_argument("--sweep-workers", default="2,4,8,16,32,64",
                        help="the worker counts of --sweep (default %(default)s)")
    parser.add_argument("--plot", default=None, help="PNG of speedup over FIFO (with --sweep)")
    parser.add_argument("--validate", default=None, metavar="BENCH_JSON[,BENCH_JSON...]",
                        help="predict `prophet-tf bench` runs (or every cell of a "
                             "`--suite` run) and compare per scheduler")
    parser.add_argument("--costs-from", default=None, metavar="BENCH_JSON[,BENCH_JSON...]",
                        help="with --validate: charge each message the costs fitted on these "
                             "other runs of the same cluster shape (held out), not those "
                             "measured in the runs predicted (in-sample)")
    parser.add_argument("--timeline-dir", default=None,
                        help="with --validate: the run's --timeline-dir, to measure the "
                             "message costs from (default: those in the bench JSON)")
    parser.add_argument("--flow-share", default=None, metavar="JSON[,JSON...]",
                        help="with --validate: share links as unevenly as these "
                             "benchmarks/flow_share.py results measured, the one at the "
                             "nearest link rate (default: evenly)")
    parser.add_argument("--seeds", type=int, default=5,
                        help="with --flow-share: seeded simulations per run, their median "
                             "predicts it (default %(default)s)")
    parser.add_argument("--profile", default=None, metavar="MODEL",
                        help="measure MODEL's per-variable compute profile and save it")
    parser.add_argument("--batch", type=int, default=32, help="per-worker batch of --profile")
    parser.add_argument("--profile-iterations", type=int, default=7,
                        help="measured iterations of --profile (after 2 warm-up)")
    args = parser.parse_args(argv)
    if args.layout is None:  # the committed dedicated sweeps' commands name no layout
        args.layout = "dedicated" if args.sweep else "colocated"
    try:
        workers = [int(w) for w in args.sweep_workers.split(",")]
    except ValueError:
        workers = []
    if not workers or any(w < 1 for w in workers):
        parser.error("--sweep-workers takes positive worker counts, comma-separated. "
                     f"Received: {args.sweep_workers!r}")
    args.sweep_workers = workers
    if args.ps is None:
        args.ps = args.workers if args.layout == "colocated" else 1
    if args.jobs is None:
        args.jobs = simulate_sweep.default_processes()
    elif args.jobs < 1:
        parser.error(f"--jobs takes a positive count. Received: {args.jobs}")
    return args


def _without_profile(config: dict) -> dict:
    """A bench config without its copy of the model profile (the bench JSON has it)."""
    return {k: v for k, v in config.items() if k != "profile"}


def _load_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _print_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    print("  ".join(f"{title:>{len(title) + 2}}" for title, _, _ in columns))
    for r in rows:
        print("  ".join(f"{format(r[key], fmt) if r.get(key) is not None else '-':>{len(title) + 2}}"
                        for title, key, fmt in columns))


# The configuration that a message-cost fit is of: costs fitted on one cluster
# shape say nothing of another's (its load on the shared cores differs).
_FIT_SHAPE = ("model", "workers", "ps", "layout", "bandwidth_mbit", "compute", "host_queue")


@dataclasses.dataclass(frozen=True)
class CostFit:
    """Message costs fitted on bench runs of one cluster shape (``_FIT_SHAPE``)."""
    shape: dict
    by_scheduler: dict  # scheduler spec -> {"overhead_s", "per_byte_s", "messages"}


def _shape(config: dict) -> dict:
    return {k: config.get(k) for k in _FIT_SHAPE}


def fit_costs(benches: Sequence[dict]) -> CostFit:
    """Each PS scheduler's message costs fitted on ``benches`` (bench JSONs of
    one cluster shape, none of them a run to be predicted): the median over
    the runs of each cost (``message_costs.combine``)."""
    if not benches:
        raise ValueError("a message-cost fit needs at least one bench run. Received none")
    shapes = [_shape(b["config"]) for b in benches]
    if any(shape != shapes[0] for shape in shapes):
        raise ValueError(f"a message-cost fit is of one cluster shape. Received: {shapes}")
    by_scheduler: dict[str, list] = {}
    for b in benches:
        for r in b["results"]:
            if r.get("message_costs"):
                by_scheduler.setdefault(r["scheduler"], []).append(r["message_costs"])
    return CostFit(shapes[0], {name: message_costs.combine(costs)
                               for name, costs in by_scheduler.items()})


def validate(bench: dict, profile: dict,
             rpc_overhead_s: float = simulate_lib.DEFAULT_RPC_OVERHEAD_S,
             timeline_dir: str | None = None, flow_shares: Sequence[dict] | None = None,
             seeds: int = 5, fitted: CostFit | None = None,
             schedulers: Sequence[str] | None = None,
             rate_lag_s: float = simulate_lib.DEFAULT_RATE_LAG_S) -> list:
    """Predicted vs measured step time per scheduler of a bench JSON (those
    named in ``schedulers``, default all), tf-mwms by the ring model
    (``simulate_ring.validate_row``).

    With ``fitted`` (``fit_costs`` of other runs) each message costs what
    those runs measured: a held-out prediction. Otherwise it costs what this
    run measured (in-sample): from its timelines when ``timeline_dir`` (the
    run's ``--timeline-dir``) holds them, else its JSON's ``message_costs``;
    without either, ``rpc_overhead_s``. Each row's ``costs`` says which. With
    ``flow_shares`` (``benchmarks/flow_share.py`` results, one per link
    rate) the links are shared as unevenly as measured (``share_sigma_for``),
    and the prediction is the median over ``seeds`` seeded simulations.
    ``rate_lag_s``: as ``simulate.simulate`` takes it.
    """
    if not isinstance(seeds, int) or seeds < 1:
        raise ValueError(f"seeds must be an int >= 1. Received: {seeds!r}")
    config = bench["config"]
    results = [r for r in bench["results"] if schedulers is None or r["scheduler"] in schedulers]
    if fitted is not None:
        if _shape(config) != fitted.shape:
            raise ValueError(f"the message costs were fitted on runs of {fitted.shape}; "
                             f"the run to predict is of {_shape(config)}")
        missing = [r["scheduler"] for r in results
                   if r["scheduler"].partition(":")[0] in schedulers_lib.SCHEDULERS
                   and r["scheduler"] not in fitted.by_scheduler]
        if missing:
            raise ValueError(f"the message-cost fit has no runs of {missing} (it has "
                             f"{sorted(fitted.by_scheduler)})")
    if "profile" in config:  # what the bench ran: measured in it, or a shipped one
        profile = saved_profiles.resolve(config["profile"])
    rows = []
    for r in results:
        if r["scheduler"].partition(":")[0] == simulate_ring.NAME:
            rows.append(simulate_ring.validate_row(config, r, profile))
            continue
        name, options = schedulers_lib.parse_scheduler(r["scheduler"])
        runs = sorted(glob.glob(os.path.join(timeline_dir, r["scheduler"] + "-*"))) \
            if timeline_dir else []
        # A suite resumed in another --timeline-dir has no timelines for its
        # earlier cells: those keep the costs their JSON recorded.
        if fitted is not None:
            costs, source = fitted.by_scheduler[r["scheduler"]], "held-out"
        else:
            costs = message_costs.combine([
                message_costs.measure(d, config["workers"], config["ps"],
                                      config.get("layout", "dedicated"),
                                      config["warmup_steps"])
                for d in runs]) or r.get("message_costs")
            source = "in-sample" if costs else "default"
            costs = costs or {"overhead_s": rpc_overhead_s, "per_byte_s": 0.0, "messages": 0}
        # The options the run used: those its spec gave, and ByteScheduler's
        # tuned ones, which the run records with every effective setting.
        settings = config.get("scheduler_settings", {}).get(r["scheduler"], {})
        options.update({k: v for k, v in settings.items()
                        if k in schedulers_lib.SCHEDULERS[name].OPTIONS})
        layout = config.get("layout", "dedicated")
        link_mbit = config.get("link_mbit", config["bandwidth_mbit"])
        sigma = share_sigma_for(flow_shares, link_mbit,
                                uplink_connections(config["workers"], config["ps"], layout))
        # A time-scaled run is simulated as it ran: its links, its scaled profile.
        runs = [simulate_lib.simulate(
            profile, name, config["workers"], config["ps"], link_mbit,
            latency_ms=config.get("link_latency_ms", config.get("latency_ms", 0.0)),
            rpc_overhead_s=costs["overhead_s"], rpc_per_byte_s=costs["per_byte_s"],
            scheduler_options=options, layout=layout,
            framing=config.get("ideal", {}).get("framing", 1.0),
            share_sigma=sigma, seed=seed, rate_lag_s=rate_lag_s,
            # As the run did (bench runs record it; older ones ran with it on).
            answers_first=config.get("answers_first") is not False)
            for seed in range(seeds if sigma else 1)]
        predicted = [run["step_time_s"] for run in runs]
        step = statistics.median(predicted)
        # The workers' phase spread over the iterations the step time is of.
        spread = statistics.median(s for run in runs
                                   for s in run["phase_spread_s"][simulate_lib.WARMUP_ITERATIONS:])
        rows.append({"scheduler": r["scheduler"], "measured_s": r["step_time_s"],
                     "predicted_s": step, "predicted_range_s": [min(predicted), max(predicted)],
                     "share_sigma": sigma, "error": step / r["step_time_s"] - 1,
                     "predicted_phase_spread_s": spread, "message_costs": costs,
                     "costs": source})
    return rows


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from prophet_tf.bench import models
    if args.profile:
        profile = models.profile_model(args.profile, args.batch, args.profile_iterations)
        command = (f"prophet-tf simulate --profile {args.profile} --batch {args.batch} "
                   f"--profile-iterations {args.profile_iterations}")
        path = saved_profiles.save_profile(profile, command)
        print(f"{args.profile}: {profile['num_params']:,} parameters, "
              f"{profile['trainable_bytes'] / 1e6:.1f} MB, batch {args.batch}: forward "
              f"{profile['forward_s'] * 1e3:.1f} ms, backward {profile['backward_s'] * 1e3:.1f} "
              f"ms; saved to {path}")
        return 0
    try:
        profile = saved_profiles.load_profile(args.model)
        names = schedulers_lib.split_specs(args.schedulers or DEFAULT_SCHEDULERS)
        # Parsed (and so validated) before any simulation runs.
        parsed = {n: parse_spec(n) for n in names}
        wanted = names if args.schedulers else None  # --validate: those rows only
        overhead = args.rpc_overhead_ms / 1e3
        lag = args.rate_lag_ms / 1e3
        if args.plot:  # before the sweep, not after it
            extras.check("matplotlib", "--plot")
            if args.sweep and "fifo" not in names:
                raise ValueError(f"--sweep --plot draws the speedup over FIFO: --schedulers "
                                 f"must name fifo. Received: --schedulers {args.schedulers}")
        if args.costs_from and not args.validate:
            raise ValueError(f"--costs-from is for --validate. Received: --costs-from "
                             f"{args.costs_from} without --validate")
        if args.validate:
            paths = [p for p in args.validate.split(",") if p]
            benches = [_load_json(p) for p in paths]
            fitted, fit_paths = None, []
            if args.costs_from:
                fit_paths = [p for p in args.costs_from.split(",") if p]
                both = {os.path.realpath(p) for p in fit_paths} & \
                    {os.path.realpath(p) for p in paths}
                if both:
                    raise ValueError(f"a run cannot be predicted with costs fitted on "
                                     f"itself. Received in both --validate and "
                                     f"--costs-from: {sorted(both)}")
                fitted = fit_costs([_load_json(p) for p in fit_paths])
            flow_shares = []
            for path in filter(None, (args.flow_share or "").split(",")):
                with open(path) as f:
                    flow_shares.append(json.load(f))
                if not (isinstance(flow_shares[-1], dict)
                        and {"link_mbit", "by_connections"} <= set(flow_shares[-1])):
                    raise ValueError(f"--flow-share {path}: not a benchmarks/flow_share.py "
                                     f"result. Received: {str(flow_shares[-1])[:80]}")
            columns = [("scheduler", "scheduler", ""), ("measured s", "measured_s", ".4f"),
                       ("predicted s", "predicted_s", ".4f"), ("error", "error", "+.1%"),
                       ("workers apart s", "predicted_phase_spread_s", ".2f")]
            if len(benches) == 1 and isinstance(benches[0].get("cells"), list):
                if fitted is not None:
                    raise ValueError("--costs-from predicts single bench runs; a suite's "
                                     f"cells are of many shapes. Received: {paths[0]}")
                bench = benches[0]  # a bench suite: every cell
                rows = [{**{k: c["cell"][k] for k in ("model", "workers", "bandwidth_mbit")},
                         **row} for c in bench["cells"] for row in validate(
                             c, profile, overhead, args.timeline_dir and os.path.join(
                                 args.timeline_dir, suite_lib.cell_directory(c["cell"])),
                             flow_shares, args.seeds, schedulers=wanted, rate_lag_s=lag)]
                columns = [("model", "model", ""), ("workers", "workers", "d"),
                           ("Mbit/s", "bandwidth_mbit", ".0f")] + columns
                out = {"validation": rows, "suite": bench["suite"]}
            elif len(benches) == 1:
                rows = validate(benches[0], profile, overhead, args.timeline_dir, flow_shares,
                                args.seeds, fitted, wanted, lag)
                out = {"validation": rows, "bench_config": _without_profile(benches[0]["config"])}
            else:  # several runs, each predicted alone
                if args.timeline_dir:
                    raise ValueError("--timeline-dir is of one run; several --validate "
                                     f"runs were given: {paths}")
                rows = [{"run": os.path.basename(path), **row}
                        for path, bench in zip(paths, benches)
                        for row in validate(bench, profile, overhead, None, flow_shares,
                                            args.seeds, fitted, wanted, lag)]
                columns = [("run", "run", "")] + columns
                out = {"validation": rows, "bench_config": _without_profile(benches[0]["config"])}
            out["costs_from"] = [os.path.basename(p) for p in fit_paths] or None
            out["flow_share"], out["seeds"] = args.flow_share, args.seeds
            out["rate_lag_s"] = lag  # what the predictions were made with
            _print_table(rows, columns)
        elif args.sweep:
            rows = simulate_sweep.sweep(profile, names, args.sweep_workers,
                         [1000, 2500, 5000, 10000, 25000], iterations=args.iterations,
                         rpc_overhead_s=overhead, compute_s=args.compute_s, rate_lag_s=lag,
                         layout=args.layout, processes=args.jobs)
            by = {(r["workers"], r["bandwidth_mbit"], r["scheduler"]): r for r in rows}
            for r in rows:  # None without fifo in the sweep
                fifo = by.get((r["workers"], r["bandwidth_mbit"], "fifo"))
                r["speedup_vs_fifo"] = fifo and fifo["step_time_s"] / r["step_time_s"]
            _print_table(rows, [("workers", "workers", "d"), ("ps", "ps", "d"),
                                ("Mbit/s", "bandwidth_mbit", ".0f"), ("scheduler", "scheduler", ""),
                                ("step s", "step_time_s", ".4f"), ("ideal s", "ideal_step_time_s", ".4f"),
                                ("vs fifo", "speedup_vs_fifo", ".2f")])
            out = {"model": args.model, "layout": args.layout, "compute_s": args.compute_s,
                   "rate_lag_s": lag, "command": "prophet-tf simulate " + " ".join(argv if argv is not None
                                                               else sys.argv[1:]),
                   "sweep": rows}
            if args.plot:
                simulate_sweep.plot_sweep(rows, args.plot, f"{args.model}: simulated speedup over FIFO")
                print(f"plot written to {args.plot}")
        else:
            jobs = [dict(profile=profile, name=name, options=options, workers=args.workers,
                         num_ps=args.ps, bandwidth_mbit=args.bandwidth_mbit,
                         latency_ms=args.latency_ms, iterations=args.iterations,
                         compute_s=args.compute_s, rpc_overhead_s=overhead,
                         layout=args.layout, rate_lag_s=lag)
                    for name, options in parsed.values()]
            rows = [{**r, "scheduler": spec} for spec, r in
                    zip(parsed, simulate_sweep.simulate_specs(jobs, args.jobs))]
            fifo = next((r["step_time_s"] for r in rows if r["scheduler"] == "fifo"), None)
            for r in rows:
                r["speedup_vs_fifo"] = fifo / r["step_time_s"] if fifo else None
            _print_table(rows, [("scheduler", "scheduler", ""), ("step s", "step_time_s", ".4f"),
                                ("ideal s", "ideal_step_time_s", ".4f"),
                                ("vs fifo", "speedup_vs_fifo", ".2f")])
            out = {"config": {"model": args.model, "workers": args.workers, "ps": args.ps,
                              "layout": args.layout,
                              "bandwidth_mbit": args.bandwidth_mbit,
                              "latency_ms": args.latency_ms, "rpc_overhead_s": overhead,
                              "rate_lag_s": lag},
                   "results": rows}
    except extras.MissingExtra:
        raise  # the command line says which extra to install (exit 1)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"prophet-tf simulate: {e}", file=sys.stderr)
        return 2
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
