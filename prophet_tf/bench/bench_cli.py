"""`prophet-tf bench`: schedulers side by side on an emulated bandwidth-limited cluster.

    prophet-tf bench                      # the default configuration (below)
    prophet-tf bench --model cnn --workers 2 --layout dedicated --ps 1 \\
        --bandwidth-mbit 300 --steps 30 --reps 5 \\
        --schedulers fifo,p3,bytescheduler,prophet,tf-mwms --json out.json

Every host runs in its own network namespace with a shaped link
(``prophet_tf.bench.netns``); one network serves the whole invocation. The
layout says where PS tasks live: ``colocated`` (the default, as BytePS and
most deployments run) puts PS task i on worker host ``i % workers``, sharing
that host's link, with ``--ps`` = ``--workers`` unless given (a multiple of
it); ``dedicated`` gives each PS task a host of its own (``--ps`` default 1).
Repetitions are interleaved (rep 1: every scheduler, rep 2: every scheduler,
...) so that noise from the shared machine hits all of them alike. In the
first ``--compute-reps`` reps, a ``compute`` run first profiles the model on
every worker host at once with no communication (each worker on its share of
the batch; ``models.profile_model``): its forward + backward time is the
compute time C of the ideal bound, and the profile (per-variable compute
under the same CPU sharing) goes into the JSON's config, for the ideal bound
and for ``prophet-tf simulate --validate``.

Per run: fresh PS tasks (``python -m prophet_tf ps``) and workers
(``python -m prophet_tf.bench.worker``), which report every step's time. The
first :data:`WARMUP_STEPS` steps are dropped for every scheduler alike
(Prophet skips 2 and profiles 5 iterations, and plans when the 8th begins);
the run's step time is the median over the remaining steps of the mean over
workers. A scheduler's ``step_time_s`` is the median of its runs' step times
(``step_time_s_all``).

Compute (``--compute``): ``real`` trains the model itself, on the CPUs the PS
tasks and the transport also need; ``emulated`` trains the emulated model of
the model's saved profile (``prophet_tf.bench.emulated``: real variables and
gradients, compute time that uses no CPU, as on a GPU worker), the profile's
times scaled so that a step computes ``--compute-ms`` (default: as profiled),
and the paper's models (``resnet50``, ``vgg16``, ``inceptionv3``) can run.
``--time-scale k`` multiplies compute times and latency by k and divides the
links' bandwidth by k: the compute/communication ratio of the cluster asked
for (``--bandwidth-mbit``) is kept while the transport moves k times fewer
bytes per second, which 2 cores can carry. Step times are reported as
measured and, divided by k, at the cluster's scale. Every run records each
process' CPU busy fraction (CPU time over wall time); the bench warns when
the processes together keep the machine's cores busy, since then the
machine, not the emulated network, sets the step time.

Every prophet_tf run records its workers' timelines (kept with
``--timeline-dir``, else in a temporary directory) and the JSON carries what a
message cost at its ends in that run (``message_costs``: per message and per
byte, measured from the pushes to the PS on the worker's own host), which
``prophet-tf simulate --validate`` uses.

Without network namespaces (not root, no iproute2), the workers' transport
shapes itself (``PROPHET_TF_SHAPE_MBIT``, a token bucket per PS connection
and direction, see ``prophet_tf.ps.shaping``) on loopback: the output says
so; PS links are then not shared between workers, and tf-mwms is not shaped.

Here: the command line. A configuration's runs: ``runner``; one run:
``training_run``; the JSON and the table: ``results``.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys

from prophet_tf.bench import ideal as ideal_lib
from prophet_tf.bench import models, netns
from prophet_tf.bench import suite as suite_lib
from prophet_tf.bench.results import WARMUP_STEPS, print_table
from prophet_tf.bench.runner import run_bench

__all__ = ["main", "ALL_SCHEDULERS", "COMPUTE_MODES", "DEFAULTS"]

ALL_SCHEDULERS = ("fifo", "p3", "bytescheduler", "prophet", "tf-mwms")
#: The target configuration: the bench CNN, 2 workers with a PS task on each
#: worker host, global batch 64, and 200 Mbit/s per link (each host link
#: carries 4.47 MB each way per step, as one link of an all-reduce does).
#: ``ps`` None: one per worker host (colocated), else 1.
DEFAULTS = {"model": "cnn", "workers": 2, "layout": "colocated", "ps": None,
            "bandwidth_mbit": 200.0, "host_queue": "fair",
            "latency_ms": 0.0, "steps": 30, "reps": 5, "global_batch": 64,
            "schedulers": ",".join(ALL_SCHEDULERS)}
COMPUTE_MODES = ("real", "emulated")


def _parse(argv):
    d = DEFAULTS
    parser = argparse.ArgumentParser(
        prog="prophet-tf bench", description=__doc__.split("\n\n")[0],
        epilog=f"Defaults (the target configuration): --model {d['model']} --workers "
               f"{d['workers']} --layout {d['layout']} --bandwidth-mbit {d['bandwidth_mbit']:g} "
               f"--steps {d['steps']} --reps {d['reps']} --global-batch {d['global_batch']} "
               f"--schedulers {d['schedulers']}. The first {WARMUP_STEPS} steps of every run "
               "are warm-up (Prophet's 2 skipped + 5 profiled iterations, and the "
               "one that plans) and are left out for every scheduler.")
    parser.add_argument("--model", default=d["model"], choices=models.MODELS + models.APPLICATIONS,
                        help="the paper's models (resnet50, vgg16, inceptionv3) need "
                             "--compute emulated")
    parser.add_argument("--compute", default="real", choices=COMPUTE_MODES,
                        help="real: train the model; emulated: its profile's compute "
                             "times without using a CPU (default %(default)s)")
    parser.add_argument("--compute-ms", type=float, default=None,
                        help="emulated: one step's compute per worker (default: as profiled)")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="emulated: compute and latency x k, link bandwidth / k "
                             "(default 1)")
    parser.add_argument("--workers", type=int, default=d["workers"],
                        help="worker processes, each on an emulated host of its own "
                             "(default %(default)s)")
    parser.add_argument("--layout", default=d["layout"], choices=ideal_lib.LAYOUTS,
                        help="colocated: PS tasks on the worker hosts; dedicated: hosts of "
                             "their own (default %(default)s, as in `prophet-tf simulate`)")
    parser.add_argument("--ps", type=int, default=d["ps"],
                        help="PS tasks (default: one per worker host when colocated, else 1)")
    parser.add_argument("--bandwidth-mbit", type=float, default=d["bandwidth_mbit"],
                        help="each host link's bandwidth, each direction")
    parser.add_argument("--latency-ms", type=float, default=d["latency_ms"],
                        help="one-way latency between two hosts")
    parser.add_argument("--host-queue", default=d["host_queue"], choices=netns.HOST_QUEUES,
                        help="how each emulated host queues what it sends: fair (its "
                             "connections in turn, as fq_codel) or fifo (one queue) "
                             "(default %(default)s)")
    parser.add_argument("--steps", type=int, default=d["steps"], help="steps per run")
    parser.add_argument("--reps", type=int, default=d["reps"], help="interleaved repetitions")
    parser.add_argument("--global-batch", type=int, default=d["global_batch"],
                        help="samples per step over all workers, split evenly (a multiple of --workers) "
                             "(default %(default)s)")
    parser.add_argument("--schedulers", default=d["schedulers"],
                        help="comma-separated: fifo, p3, bytescheduler, prophet, tf-mwms; a "
                             "scheduler may name options (prophet:partition_bytes=200000)")
    parser.add_argument("--tf-mwms-bytes-per-pack", type=int, default=None, metavar="N",
                        help="tf-mwms's CommunicationOptions(bytes_per_pack); default: "
                             "the fastest of 0, 1, 4 and 16 MiB, one measured run each")
    parser.add_argument("--global-clipnorm", type=float, default=None, metavar="X",
                        help="every run's SGD clips by the global norm X (default: no "
                             "clipping): what clipping costs, against a run without")
    parser.add_argument("--compute-reps", type=int, default=2,
                        help="compute-only runs (first reps); 0 = the profile's compute time")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--timeline-dir", default=None,
                        help="keep each prophet_tf run's worker and PS timelines here, "
                             "with its step marks and link counters (run.json)")
    parser.add_argument("--suite", default=None, choices=sorted(suite_lib.SUITES),
                        help="run a grid of configurations into one JSON (paper: the "
                             "paper's models, bandwidths and worker counts; smoke: a "
                             "one-minute check); the suite sets every option but --json "
                             "and --timeline-dir, and an existing --json of the same suite "
                             "is resumed")
    args = parser.parse_args(argv)
    if args.suite:
        defaults = vars(parser.parse_args([]))
        given = sorted(k for k, v in vars(args).items()
                       if k not in ("suite", "json", "timeline_dir") and v != defaults[k])
        if given:
            parser.error(f"--suite sets every option but --json and --timeline-dir. "
                         f"Received: {', '.join('--' + k.replace('_', '-') for k in given)}")
        return args
    if args.ps is None:
        args.ps = args.workers if args.layout == "colocated" else 1
    if args.compute == "real" and (args.model not in models.MODELS or args.compute_ms
                                   or args.time_scale != 1):
        parser.error(f"--model {args.model}, --compute-ms and --time-scale need --compute "
                     f"emulated (this machine computes only {', '.join(models.MODELS)} for "
                     f"real). Received: --model={args.model}, --compute-ms={args.compute_ms}, "
                     f"--time-scale={args.time_scale}")
    if not args.time_scale > 0 or (args.compute_ms is not None and not args.compute_ms > 0):
        parser.error(f"--time-scale and --compute-ms must be > 0. Received: "
                     f"--time-scale={args.time_scale}, --compute-ms={args.compute_ms}")
    args.scale = 1.0  # run_bench sets it for emulated compute
    if args.layout == "colocated" and args.workers >= 1 and args.ps % args.workers:
        parser.error(f"--layout colocated puts the same number of PS tasks on every worker "
                     f"host: --ps must be a multiple of --workers. Received: --ps={args.ps}, "
                     f"--workers={args.workers}")
    if args.workers < 1 or args.ps < 1 or args.reps < 1 or not args.bandwidth_mbit > 0 \
            or args.latency_ms < 0:
        parser.error(f"need --workers, --ps, --reps >= 1, --bandwidth-mbit > 0, --latency-ms "
                     f">= 0. Received: --workers={args.workers}, --ps={args.ps}, "
                     f"--reps={args.reps}, --bandwidth-mbit={args.bandwidth_mbit}, "
                     f"--latency-ms={args.latency_ms}")
    if args.global_clipnorm is not None and not args.global_clipnorm > 0:
        parser.error(f"--global-clipnorm must be > 0. "
                     f"Received: --global-clipnorm={args.global_clipnorm}")
    if args.tf_mwms_bytes_per_pack is not None and args.tf_mwms_bytes_per_pack < 0:
        parser.error(f"--tf-mwms-bytes-per-pack must be >= 0. "
                     f"Received: --tf-mwms-bytes-per-pack={args.tf_mwms_bytes_per_pack}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.suite:
        return _main_suite(args)
    try:
        result = run_bench(args)
    except (ValueError, RuntimeError, FileNotFoundError, netns.NetnsUnavailable) as e:
        print(f"prophet-tf bench: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("prophet-tf bench: interrupted; the emulated network was removed", file=sys.stderr)
        return 130
    print_table(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"results written to {args.json}")
    return 0


def _run_cell(argv: list[str], out) -> dict:
    """One cell of a suite: `prophet-tf bench ARGV`, its table printed to ``out``."""
    bench = run_bench(_parse(argv), out)
    print_table(bench, out)
    return bench


def _main_suite(args) -> int:
    try:
        result = suite_lib.run_suite(args.suite, args.json, _run_cell, DEFAULTS["host_queue"],
                                     args.timeline_dir)
    except (ValueError, RuntimeError, FileNotFoundError, netns.NetnsUnavailable) as e:
        print(f"prophet-tf bench: suite {args.suite}: {e}", file=sys.stderr)
        if args.json:
            print(f"prophet-tf bench: the cells finished so far are in {args.json}; the same "
                  f"command resumes", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("prophet-tf bench: interrupted; the emulated network was removed", file=sys.stderr)
        return 130
    walls = [c["wall_s"] for c in result["cells"] if "wall_s" in c]
    print(f"\nsuite {args.suite}: {len(result['cells'])} cells, "
          f"{result['elapsed_s'] / 60:.1f} min in this invocation"
          + (f", {sum(walls) / 60:.1f} min over {len(walls)} timed cell(s)" if walls else ""))
    suite_lib.print_summary(result)
    if args.json:
        print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
