"""Partitions cut along rows or along flattened elements, simulated: how evenly the
PS tasks' bytes spread, and what each cut does to the step at scale.

Today's partitions are row ranges along dimension 0 (``prophet_tf/ps/sharding.py``);
ResNet-50's 1x1 kernels are one row each, so many PS tasks cannot be balanced. A
cut along each variable's flattened elements is simulated here by giving the
simulator the profile with every variable's shape flattened: its bytes, timing and
priority stay; ``sharding.plan`` then cuts element ranges. The PS load spread is
computed from the same plans the workers would declare.

    python benchmarks/partition_cut.py --json benchmarks/partition-cut-resnet50.json

Dedicated layout (one PS per 4 workers on hosts of their own, as the committed
sweep), ResNet-50 scaled to 0.25 s of compute per step.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

from prophet_tf.bench import saved_profiles, simulate
from prophet_tf.engine import schedulers
from prophet_tf.ps import sharding

SCHEDULERS = ("fifo", "p3", "bytescheduler", "prophet")
CELLS = ((16, 1000), (32, 1000), (64, 1000), (64, 10000))
PS_COUNTS = (4, 8, 16, 32, 64)
COMPUTE_S = 0.25


def flattened(profile: dict) -> dict:
    """``profile`` with every variable's shape flattened to its element count."""
    return {**profile, "variables": [{**v, "shape": [math.prod(v["shape"]) or 1]}
                                     for v in profile["variables"]]}


def ps_spread(profile: dict, num_ps: int) -> dict:
    """The busiest PS task's bytes over the mean, and the partition count, as the
    workers would plan them (``Dispatch``: the balanced limit, then LPT)."""
    specs = simulate.specs_of(profile)
    limit = sharding.balanced_limit(specs, num_ps, schedulers.DEFAULT_PARTITION_BYTES)
    plan = sharding.plan(specs, num_ps, limit)
    loads = [0] * num_ps
    for p in plan:
        loads[p.ps_index] += p.nbytes
    return {"busiest_over_mean": max(loads) / (sum(loads) / num_ps), "partitions": len(plan)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    cuts = {"rows": saved_profiles.load_profile(args.model)}
    cuts["elements"] = flattened(cuts["rows"])
    spread = [{"ps": n, "cut": cut, **ps_spread(profile, n)}
              for n in PS_COUNTS for cut, profile in cuts.items()]
    rows = []
    for workers, mbit in CELLS:
        for cut, profile in cuts.items():
            for name in SCHEDULERS:
                r = simulate.simulate(profile, name, workers, workers // 4, mbit,
                                      compute_s=COMPUTE_S)
                rows.append({"workers": workers, "ps": workers // 4, "bandwidth_mbit": mbit,
                             "cut": cut, "scheduler": name, "step_time_s": r["step_time_s"],
                             "ideal_step_time_s": r["ideal_step_time_s"]})
                print(json.dumps(rows[-1]), flush=True)
    command = "python benchmarks/partition_cut.py " + " ".join(sys.argv[1:] if argv is None
                                                                else argv)
    with open(args.json, "w") as f:
        json.dump({"model": args.model, "compute_s": COMPUTE_S, "layout": "dedicated",
                   "command": command, "spread": spread, "runs": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
