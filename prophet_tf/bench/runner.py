"""A configuration of `prophet-tf bench`, run: schedulers side by side, reps interleaved.

:func:`run_bench` builds the emulated network (``netns``; without namespaces the
transport shapes itself), runs every scheduler ``--reps`` times in turn on it
(``training_run.run_once``; the compute-only runs first), prints a line per run,
and returns the JSON (``results.bench_result``). The command line, and what it
measures: ``bench_cli``.
"""
from __future__ import annotations

import os
import secrets
import statistics
import sys
import tempfile
import time

from prophet_tf import environment, extras
from prophet_tf.bench import ideal as ideal_lib
from prophet_tf.bench import emulated, link_load, netns, saved_profiles
from prophet_tf.bench import results as results_lib
from prophet_tf.bench.results import WARMUP_STEPS
from prophet_tf.bench.training_run import Cluster, run_once
from prophet_tf.engine import schedulers as schedulers_lib

__all__ = ["run_bench", "BUSY_WARNING"]

#: Above this share of the machine's cores in use by a run's processes, the
#: machine rather than the emulated network may set the step time. Measured
#: (README, "The transport budget"): ResNet-50 runs at 0.79-0.84 of the cores
#: took 9-18% longer at the cluster's scale than at 0.62-0.68 with half the
#: link rate; the kernel's share for TCP and the links is not counted here.
BUSY_WARNING = 0.75


def run_bench(args, out=sys.stdout) -> dict:
    """Runs the configuration of ``args`` (see ``bench_cli._parse``); returns the JSON dict."""
    names = schedulers_lib.split_specs(args.schedulers)
    if "tf-mwms" in names:  # before any run: its workers import tf_keras
        extras.check("tf_keras", "the tf-mwms baseline (--schedulers ...,tf-mwms)")
    given: dict[str, dict] = {}  # scheduler spec -> the options it names
    for n in names:
        if n != "tf-mwms":
            _, given[n] = schedulers_lib.parse_scheduler(n)
    if args.steps <= WARMUP_STEPS:
        raise ValueError(f"--steps must exceed the {WARMUP_STEPS} warm-up steps. "
                         f"Received: --steps={args.steps}")
    if args.global_batch % args.workers:
        raise ValueError(f"--global-batch must be a multiple of --workers. Received: "
                         f"--global-batch={args.global_batch}, --workers={args.workers}")
    profile = saved_profiles.load_profile(args.model)
    # What the JSON records of the profile: the shipped one's name and hash
    # (and scale), unless a compute run below measures one.
    profile_record = saved_profiles.reference(args.model)
    if args.compute == "emulated":
        # The emulated model computes exactly its scaled profile.
        profiled_s = profile["compute_s"]
        args.scale = args.time_scale * (args.compute_ms / 1e3 / profile["compute_s"]
                                        if args.compute_ms else 1.0)
        profile = saved_profiles.scaled_profile(profile, args.scale)
        profile_record = saved_profiles.reference(args.model, args.scale)
        print("prophet-tf bench: " + emulated.compute_note(
            args.model, profiled_s, args.compute_ms, args.time_scale), file=out, flush=True)
    link_mbit = args.bandwidth_mbit / args.time_scale
    latency_ms = args.latency_ms * args.time_scale
    network = None
    shaping = "netns"
    # The PS tasks listen on namespace addresses, not loopback: they need a
    # shared token (prophet_tf.ps.security); a fresh one per invocation.
    shape_env: dict = {environment.TOKEN: secrets.token_hex(16)}
    ok, why = netns.available(need_latency=args.latency_ms > 0)
    if ok and args.host_queue == "fair":
        fair_ok, fair_why = netns.available(need_fair_queue=True)
        if not fair_ok:
            raise SystemExit(f"prophet-tf bench: --host-queue fair cannot be built here "
                             f"({fair_why}); pass --host-queue fifo")
    if ok:
        netns.cleanup_leftovers()  # of runs that were killed before their teardown
    else:
        shaping = "transport"
        shape_env[environment.SHAPE_MBIT] = str(link_mbit)
        print(f"prophet-tf bench: network namespaces unavailable ({why}); shaping inside the "
              f"transport instead (token bucket per worker connection, "
              f"PROPHET_TF_SHAPE_MBIT={link_mbit}); PS links are not shared and "
              f"tf-mwms is unshaped", file=out, flush=True)
    # The namespaces' tbf counts TCP/IP headers; the transport's bucket does not.
    framing = ideal_lib.TCP_FRAMING if shaping == "netns" else 1.0
    runs = {n: [] for n in ["compute"] + names}
    options = {n: o for n, o in given.items() if o}  # scheduler spec -> its options
    search: list[dict] = []
    pack_search: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="prophet-tf-bench-") as workdir:
        if ok:
            network = netns.EmulatedNetwork(
                Cluster.hosts(args.ps, args.workers, args.layout), link_mbit, latency_ms,
                host_queue=args.host_queue)
        try:
            if network:
                network.open()
                where = (f"{args.workers} worker hosts, {args.ps} PS task(s) on them"
                         if args.layout == "colocated" else
                         f"{args.ps} PS + {args.workers} worker hosts")
                scaled = (f" (a {args.bandwidth_mbit:g} Mbit/s cluster at time scale "
                          f"{args.time_scale:g})" if args.time_scale != 1 else "")
                print(f"prophet-tf bench: emulated network {network.run_id}: {where}, "
                      f"{link_mbit:g} Mbit/s per link each way, latency "
                      f"{latency_ms:g} ms{scaled}, {args.host_queue} host queues", file=out,
                      flush=True)
            cluster = Cluster(network, args.ps, args.workers, args.layout)
            # Emulated compute is its profile: nothing to measure.
            compute_reps = 0 if args.compute == "emulated" else min(args.reps, args.compute_reps)
            for rep in range(args.reps):
                order = (["compute"] if rep < compute_reps else []) + names
                for name in order:
                    if name == "bytescheduler" and "bytescheduler" not in options:
                        options["bytescheduler"], search = _tune_bytescheduler(
                            args, runs["compute"], profile, framing, out)
                    if name == "tf-mwms" and "tf-mwms" not in options:
                        options["tf-mwms"], pack_search = _tune_tf_mwms(
                            cluster, args, workdir, shape_env, out)
                    t0 = time.monotonic()
                    result = run_once(cluster, name, args, workdir, shape_env,
                                      options.get(name))
                    step = (statistics.fmean(r["profile"]["compute_s"] for r in result["reports"])
                            if name == "compute" else
                            results_lib.run_step_time(result["reports"], WARMUP_STEPS))
                    runs[name].append({"step_time_s": step, "reports": result["reports"],
                                       "cpu_busy": result["cpu_busy"],
                                       "link_load": result["link_load"],
                                       "link_phases": result["link_phases"],
                                       "message_costs": result["message_costs"],
                                       "startup_s": result["startup_s"]})
                    _print_run(rep, args.reps, name, step, time.monotonic() - t0, result, out)
        finally:
            if network:
                network.close()
    return results_lib.bench_result(args, names, runs, profile, profile_record, options=options,
                                    search=search, pack_search=pack_search,
                                    shaping=shaping, framing=framing,
                                    link_mbit=link_mbit, latency_ms=latency_ms)


def _print_run(rep: int, reps: int, name: str, step: float, elapsed_s: float, result: dict,
               out) -> None:
    """One run's line; a warning when the machine was busy enough to set its step time."""
    busy = [b for b in result["cpu_busy"].values() if b is not None]
    print(f"rep {rep + 1}/{reps} {name:>13}: step {step * 1e3:8.1f} ms "
          f"(run {elapsed_s:.0f} s"
          + (f", {result['startup_s']:.0f} s to the first batch"
             if result["startup_s"] is not None else "")
          + f", CPU busy {sum(busy):.2f} of "
          f"{os.cpu_count()} cores, most {max(busy, default=0):.2f}"
          + _loads_text(result["link_load"]) + ")",
          file=out, flush=True)
    if sum(busy) > BUSY_WARNING * (os.cpu_count() or 1):
        print(f"prophet-tf bench: WARNING: the {name} run kept "
              f"{sum(busy):.2f} of {os.cpu_count()} cores busy: the machine, "
              f"not the emulated network, may set its step time",
              file=out, flush=True)


def _loads_text(loads: dict | None) -> str:
    if not loads:
        return ""
    up = [v for v in loads["sent"] if v is not None]
    return (f"; links sent {min(up):.2f}-{max(up):.2f} of their rate, busiest "
            f"{link_load.busiest_load(loads):.2f}" if up else "")


def _tune_bytescheduler(args, compute_runs: list, profile: dict, framing: float,
                        out) -> tuple[dict, list]:
    """ByteScheduler's partition size and credit for this configuration
    (``tuning.py``), from this bench's measured profile when it has one."""
    from prophet_tf.bench import tuning

    if compute_runs:
        profile = compute_runs[0]["reports"][0]["profile"]
    chosen, rows = tuning.tune_bytescheduler(
        profile, args.workers, args.ps, args.bandwidth_mbit / args.time_scale,
        latency_ms=args.latency_ms * args.time_scale, layout=args.layout, framing=framing)
    print(f"prophet-tf bench: bytescheduler tuned over {len(rows)} settings (simulated): "
          f"partition_bytes={chosen['partition_bytes']}, credit_bytes={chosen['credit_bytes']}",
          file=out, flush=True)
    return chosen, rows


def _tune_tf_mwms(cluster, args, workdir: str, shape_env: dict, out) -> tuple[dict, list]:
    """tf-mwms's pack size for this configuration: one measured run with each of
    ``tuning.TF_MWMS_PACK_BYTES``, the fastest kept (``tuning.choose_pack``); with
    ``--tf-mwms-bytes-per-pack`` that size, untried."""
    from prophet_tf.bench import tuning

    fixed = getattr(args, "tf_mwms_bytes_per_pack", None)
    if fixed is not None:
        return {"bytes_per_pack": fixed}, []
    rows = []
    for pack in tuning.TF_MWMS_PACK_BYTES:
        result = run_once(cluster, "tf-mwms", args, workdir, shape_env, {"bytes_per_pack": pack})
        rows.append({"bytes_per_pack": pack, "step_time_s": results_lib.run_step_time(
            result["reports"], WARMUP_STEPS)})
    chosen = tuning.choose_pack(rows)
    print("prophet-tf bench: tf-mwms tuned over bytes_per_pack (measured, one run each): "
          + ", ".join(f"{r['bytes_per_pack']}: {r['step_time_s'] * 1e3:.1f} ms" for r in rows)
          + f"; chose {chosen}", file=out, flush=True)
    return {"bytes_per_pack": chosen}, rows
