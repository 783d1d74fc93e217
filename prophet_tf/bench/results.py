"""What `prophet-tf bench` reports: step times, CPU busy, its JSON and its table.

- :data:`WARMUP_STEPS`: the first steps of every run, left out for every scheduler.
- :func:`run_step_time`: a run's step time; :func:`measured_window` and
  :func:`busy_between`: when a run was measured, and how busy a process was then.
- :func:`bench_result`: the JSON of a configuration (``config`` and ``results``),
  from its runs (``runner.run_bench``); :func:`scheduler_settings`: what a
  scheduler ran with.
- :func:`print_table`: that JSON as the table the bench prints.
"""
from __future__ import annotations

import os
import statistics
import sys

from prophet_tf.bench import ideal as ideal_lib
from prophet_tf.bench import link_load, message_costs, models
from prophet_tf.engine import engine as engine_lib
from prophet_tf.engine import schedulers as schedulers_lib

__all__ = ["WARMUP_STEPS", "bench_result", "busy_between", "measured_window",
           "median_or_none", "print_table", "run_step_time", "scheduler_settings"]

WARMUP_STEPS = schedulers_lib.ProphetScheduler.ITERATIONS_BEFORE_PLAN


def run_step_time(reports: list[dict], warmup: int) -> float:
    """The median over the steps after ``warmup`` of the mean over the workers."""
    per_step = list(zip(*[r["step_times_s"] for r in reports]))
    measured = [statistics.fmean(s) for s in per_step[warmup:]]
    if not measured:
        raise RuntimeError(f"--steps must exceed the {warmup} warm-up steps")
    return statistics.median(measured)


def measured_window(reports: list[dict], warmup: int) -> tuple[float, float]:
    """When every worker was past its warm-up steps and none had finished."""
    begin = max(r["train_window"][0] + sum(r["step_times_s"][:warmup]) for r in reports)
    return begin, min(r["train_window"][1] for r in reports)


def busy_between(samples: list[tuple], i: int, begin: float, end: float) -> float | None:
    """Process i's CPU time over wall time between the samples nearest ``begin`` and ``end``."""
    inside = [(t, cpu[i]) for t, cpu in samples if begin <= t <= end and cpu[i] is not None]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return None
    return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


def median_or_none(values) -> float | None:
    """The median of the values that are not None; None if there is none."""
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def bench_result(args, names: list[str], runs: dict[str, list[dict]], profile: dict,
                 profile_record: dict, *, options: dict, search: list, pack_search: list,
                 shaping: str,
                 framing: float, link_mbit: float, latency_ms: float) -> dict:
    """The JSON of a configuration: ``config`` and each scheduler's ``results``.

    Args:
      args: the bench's arguments (``bench_cli``).
      names: the schedulers, in the order of ``--schedulers``.
      runs: per scheduler, and ``"compute"``, each run's record (``runner.run_bench``).
      profile, profile_record: the model's profile and how the JSON names it;
        replaced by the profile of the compute run nearest the median, if any.
      options: each scheduler's options; search: ByteScheduler's tuning;
        pack_search: tf-mwms's measured pack sizes (``runner._tune_tf_mwms``).
      shaping: ``"netns"`` or ``"transport"``; framing: the links' TCP framing.
      link_mbit, latency_ms: the links as emulated (at the time scale).
    """
    if runs["compute"]:
        # The compute run nearest the median: its worker-0 profile (measured
        # with every worker computing at once) is the one of this configuration.
        compute_s = statistics.median(r["step_time_s"] for r in runs["compute"])
        nearest = min(runs["compute"], key=lambda r: abs(r["step_time_s"] - compute_s))
        profile = profile_record = nearest["reports"][0]["profile"]
        compute_s = profile["compute_s"]
    else:
        compute_s = profile["compute_s"]
    bound = ideal_lib.ideal_step_time(profile, args.workers, args.ps, link_mbit,
                                      latency_ms, layout=args.layout, framing=framing)
    config = {"model": args.model, "workers": args.workers, "ps": args.ps,
              "layout": args.layout,
              "scheduler_settings": {n: scheduler_settings(n, profile, args.ps,
                                                           options.get(n), args.workers,
                                                           args.layout == "colocated")
                                     for n in names if n != "tf-mwms"},
              "bytescheduler_search": search,
              "tf_mwms": options.get("tf-mwms"), "tf_mwms_search": pack_search,
              "bandwidth_mbit": args.bandwidth_mbit, "latency_ms": args.latency_ms,
              "host_queue": args.host_queue if shaping == "netns" else None,
              "compute": args.compute, "compute_scale": args.scale,
              "time_scale": args.time_scale, "link_mbit": link_mbit,
              "link_latency_ms": latency_ms,
              "steps": args.steps, "warmup_steps": WARMUP_STEPS, "reps": args.reps,
              "global_batch": args.global_batch, "schedulers": names, "shaping": shaping,
              "global_clipnorm": getattr(args, "global_clipnorm", None),
              # The workers inherit the bench's environment (runs A/B it with "0").
              "answers_first": os.environ.get(engine_lib.ANSWERS_FIRST_ENV, "1") != "0",
              "num_params": profile["num_params"], "model_bytes": profile["trainable_bytes"],
              "compute_s": compute_s, "compute_s_all": [r["step_time_s"] for r in runs["compute"]],
              "ideal": bound, "threads": {"intra_op": models.INTRA_OP_THREADS,
                                          "inter_op": models.INTER_OP_THREADS},
              "profile": profile_record}
    results = []
    for name in names:
        times = [r["step_time_s"] for r in runs[name]]
        step = statistics.median(times)
        busy = [r["cpu_busy"] for r in runs[name]]
        results.append({"scheduler": name, "step_time_s": step, "step_time_s_all": times,
                        "cluster_step_time_s": step / args.time_scale,
                        "cpu_busy": {p: statistics.median(b[p] for b in busy
                                                          if b.get(p) is not None)
                                     for p in busy[0] if any(b.get(p) is not None
                                                             for b in busy)},
                        "samples_per_s": args.global_batch / step,
                        "message_costs": message_costs.combine(
                            [r["message_costs"] for r in runs[name]]),
                        "startup_s": median_or_none(r["startup_s"] for r in runs[name]),
                        "link_load": link_load.median_loads([r["link_load"] for r in runs[name]]),
                        "link_phases": link_load.median_loads(
                            [r["link_phases"] for r in runs[name]]),
                        "ideal_step_time_s": bound["ideal_s"],
                        "per_step_s": [[statistics.fmean(s) for s in zip(
                            *[w["step_times_s"] for w in r["reports"]])] for r in runs[name]]})
    return {"config": config, "results": results}


def scheduler_settings(name: str, profile: dict, num_ps: int,
                       options: dict | None = None, num_workers: int = 1,
                       ps_on_host: bool = True) -> dict:
    """What a scheduler runs with in this configuration: its options, the
    partition size the workers declare, the partitions it cuts (how many, the
    largest) and its in-flight window per link."""
    from prophet_tf.bench import simulate  # the profile's specs, as simulated
    from prophet_tf.engine.dispatch import Dispatch

    scheduler = schedulers_lib.make_scheduler(name.partition(":")[0], **(options or {}))
    specs = simulate.specs_of(profile)
    dispatch = Dispatch([s.key for s in specs], specs, num_ps, scheduler,
                        num_workers=num_workers, ps_on_host=ps_on_host)
    options = {k: getattr(scheduler, k) for k in scheduler.OPTIONS}
    return {**options, "partition_bytes": dispatch.partition_bytes,
            "partitions": len(dispatch.partitions),
            "largest_partition_bytes": max(p.nbytes for p in dispatch.partitions),
            "window_blocks": scheduler.window_blocks,
            "window_bytes": scheduler.window_bytes}


def print_table(result: dict, out=sys.stdout) -> None:
    """Prints a configuration's JSON (:func:`bench_result`) as the bench's table."""
    c = result["config"]
    k = c.get("time_scale", 1.0)
    scale = (f", time scale {k:g} (links {c['link_mbit']:g} Mbit/s; 'cluster ms' = step / {k:g})"
             if k != 1 else "")
    print(f"\nmodel {c['model']} ({c['num_params']:,} parameters, "
          f"{c.get('compute', 'real')} compute), {c['workers']} workers, "
          f"{c['ps']} PS ({c.get('layout', 'dedicated')}), {c['bandwidth_mbit']:g} Mbit/s, "
          f"latency {c['latency_ms']:g} ms{scale}, "
          f"global batch {c['global_batch']}, {c['steps']} steps ({c['warmup_steps']} warm-up), "
          f"{c['reps']} reps, shaping: {c['shaping']}"
          + (f" ({c['host_queue']} host queues)" if c.get("host_queue") else ""), file=out)
    b = c["ideal"]
    print(f"compute {c['compute_s'] * 1e3:.1f} ms; ideal {b['ideal_s'] * 1e3:.1f} ms = max("
          f"compute {b['compute_s'] * 1e3:.1f}, busiest link {b['busiest_link_s'] * 1e3:.1f}, "
          f"critical chain {b['chain_s'] * 1e3:.1f} of variable {b['chain_variable']})",
          file=out)
    fifo = next((r["step_time_s"] for r in result["results"] if r["scheduler"] == "fifo"), None)
    cluster = f" {'cluster ms':>10}" if k != 1 else ""
    print(f"{'scheduler':>13} {'step ms':>9} {'min-max ms':>15} {'samples/s':>10} "
          f"{'vs fifo':>8} {'vs ideal':>9} {'CPU busy':>8} {'link load':>9}{cluster}",
          file=out)
    for r in result["results"]:
        lo, hi = min(r["step_time_s_all"]), max(r["step_time_s_all"])
        vs = f"{r['step_time_s'] / fifo:.2f}" if fifo else "-"
        busy = sum((r.get("cpu_busy") or {}).values())
        at_scale = f" {r['step_time_s'] / k * 1e3:10.1f}" if k != 1 else ""
        load = link_load.busiest_load(r.get("link_load"))
        load = "-" if load is None else f"{load:.2f}"
        print(f"{r['scheduler']:>13} {r['step_time_s'] * 1e3:9.1f} "
              f"{lo * 1e3:7.1f}-{hi * 1e3:<7.1f} {r['samples_per_s']:10.1f} {vs:>8} "
              f"{r['step_time_s'] / r['ideal_step_time_s']:9.2f} {busy:8.2f} {load:>9}"
              f"{at_scale}", file=out)
