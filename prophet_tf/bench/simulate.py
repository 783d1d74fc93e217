"""`prophet-tf simulate`: a discrete-event simulation of synchronous PS training.

    prophet-tf simulate --model resnet50 --workers 16 --ps 4 --bandwidth-mbit 10000 \\
        --schedulers fifo,p3,bytescheduler,prophet --json out.json
    prophet-tf simulate --sweep --model resnet50 --plot docs/performance-resnet50.png
    prophet-tf simulate --profile resnet50        # measure and save a profile

It drives the engine's own scheduler objects
(:func:`prophet_tf.engine.schedulers.make_scheduler`) exactly as
``prophet_tf.engine.engine.Engine`` does, with virtual time in ns instead of
``time.monotonic_ns()``: each ready gradient is cut into the scheduler's
partitions (``sharding.plan``), every partition is ``add``-ed at the
gradient's ready time, then blocks are drained with ``next_block(now)`` into
per-link send queues; each link pushes at most ``Engine.MAX_RPCS_PER_LINK``
blocks at once, and a finished push calls ``on_sent(block, start, end)`` and
drains again.

What is modelled, per iteration of one worker (all workers are identical and
in lockstep, so one is simulated and every PS link is shared W ways):

- forward: variable i's forward time starts when variable i-1's has ended
  and variable i's parameters of this version are in (all partitions);
- backward starts when the forward ends; gradient i is ready
  ``backward_ready_s[i]`` later (the profile); the Keras step (the time the
  bench measures) ends with the last gradient, and the next forward starts;
- network: a push of a block crosses the worker's uplink and the PS's
  downlink, a pulled partition the PS's uplink and the worker's downlink.
  Links have the given bandwidth in each direction; a PS link carries the W
  workers' identical flows, so each gets 1/W of it; concurrent flows share
  a link max-min fairly (a fluid model of TCP). Each message costs
  ``rpc_overhead_s`` of fixed time before its bytes flow and a one-way
  latency after;
- PS: a partition's version k+1 exists once its step-k push has arrived
  (W pushes arrive together by symmetry); the apply takes no time;
- pulls: on the first gradient of step k the worker asks each PS for version
  k+1 of its partitions in priority order; the PS streams them one after
  another, each when it exists (as ``PSClient.pull``).

Step time: iteration k's time is from its forward's start to the next one's,
median over the iterations after ``warmup`` (the bench drops the same ones).
"""
from __future__ import annotations

import argparse
import heapq
import json
import logging
import math
import statistics
import sys
import types
from typing import Callable, Sequence

from prophet_tf.bench import ideal as ideal_lib
from prophet_tf.engine import schedulers as schedulers_lib
from prophet_tf.ps import sharding

__all__ = ["simulate", "sweep", "main", "MAX_RPCS_PER_LINK", "DEFAULT_RPC_OVERHEAD_S"]

logger = logging.getLogger(__name__)

#: prophet_tf.engine.Engine.MAX_RPCS_PER_LINK (not imported: that module needs TensorFlow).
MAX_RPCS_PER_LINK = 2
#: Fixed cost per message (serialisation, gRPC, Python), from the bench's
#: loopback figures: ~0.1 ms per message at the client plus the PS's handling.
DEFAULT_RPC_OVERHEAD_S = 0.0003
WARMUP_STEPS = (schedulers_lib.ProphetScheduler.WARMUP_ITERATIONS
                + schedulers_lib.ProphetScheduler.PROFILE_ITERATIONS + 1)
_NS = 1_000_000_000


class _Flow:
    __slots__ = ("remaining", "links", "rate", "done")

    def __init__(self, nbytes: float, links: tuple, done: Callable[[], None]):
        self.remaining = float(nbytes)
        self.links = links
        self.rate = 0.0
        self.done = done


class _Sim:
    """Event queue plus a fluid network of max-min fair flows."""

    def __init__(self, capacity: dict):
        self.now = 0.0
        self._events: list = []
        self._seq = 0
        self.capacity = capacity  # link -> bytes/s (math.inf = unlimited)
        self.flows: list[_Flow] = []
        self._last = 0.0
        self._epoch = 0

    def at(self, t: float, fn: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._events, (max(t, self.now), self._seq, fn))

    def start_flow(self, nbytes: float, links: tuple, done: Callable[[], None]) -> None:
        self._advance()
        flow = _Flow(nbytes, links, done)
        if nbytes <= 0 or all(math.isinf(self.capacity[l]) for l in links):
            self.at(self.now, done)
            return
        self.flows.append(flow)
        self._reschedule()

    def _advance(self) -> None:
        dt = self.now - self._last
        if dt > 0:
            for f in self.flows:
                f.remaining -= f.rate * dt
        self._last = self.now

    def _reschedule(self) -> None:
        # Progressive filling: the most constrained link fixes its flows' rate.
        left = {l: c for l, c in self.capacity.items()}
        unfixed = set(range(len(self.flows)))
        while unfixed:
            counts: dict = {}
            for i in unfixed:
                for l in self.flows[i].links:
                    counts[l] = counts.get(l, 0) + 1
            link = min(counts, key=lambda l: left[l] / counts[l])
            share = left[link] / counts[link]
            for i in [i for i in unfixed if link in self.flows[i].links]:
                self.flows[i].rate = share
                unfixed.discard(i)
                for l in self.flows[i].links:
                    left[l] -= share
        self._epoch += 1
        epoch = self._epoch
        if self.flows:
            t = min(self.now + max(f.remaining, 0) / f.rate for f in self.flows)
            self.at(t, lambda: self._finish(epoch))

    def _finish(self, epoch: int) -> None:
        if epoch != self._epoch:
            return
        self._advance()
        done = [f for f in self.flows if f.remaining <= 1e-3]  # bytes; float rounding
        if not done:  # rounding: finish the nearest one
            done = [min(self.flows, key=lambda f: f.remaining)]
        self.flows = [f for f in self.flows if f not in done]
        self._reschedule()
        for f in done:
            f.done()

    def run(self, until: Callable[[], bool]) -> None:
        while self._events and not until():
            t, _, fn = heapq.heappop(self._events)
            self.now = t
            fn()


class _Worker:
    """One worker's engine, compute and pulls, in virtual time."""

    def __init__(self, sim: _Sim, profile: dict, scheduler, partitions, num_ps: int,
                 iterations: int, compute_scale: float, latency_s: float, rpc_overhead_s: float):
        self.sim, self.s = sim, scheduler
        self.vars = profile["variables"]
        self.fwd = [v["forward_s"] * compute_scale for v in self.vars]
        self.ready = [v["backward_ready_s"] * compute_scale for v in self.vars]
        self.num_ps, self.iterations = num_ps, iterations
        self.latency, self.overhead = latency_s, rpc_overhead_s
        self.parts_of: dict[int, list] = {}
        for p in partitions:
            self.parts_of.setdefault(p.key, []).append(p)
        self.owned = [sorted((p for p in partitions if p.ps_index == i),
                             key=lambda p: (p.key, p.partition)) for i in range(num_ps)]
        self.available: dict[tuple, float] = {}  # (key, partition, version) -> time at PS
        self.waiting_pull: dict[int, Callable] = {}  # ps -> resume when a version appears
        self.pull_queue: list[list[int]] = [[] for _ in range(num_ps)]  # versions asked for
        self.pulling = [False] * num_ps
        self.blocked = False  # the forward waits for a parameter
        self.first_ready = min(range(len(self.vars)), key=lambda i: (self.ready[i], -i))
        self.arrived: dict[tuple[int, int], int] = {}  # (key, version) -> partitions in
        self.queues = [[] for _ in range(num_ps)]
        self.rpcs = [0] * num_ps
        self.starts: list[float] = []
        self.iteration = 0
        self.var = 0
        self.pushed_bytes = 0

    # -- compute --------------------------------------------------------------------

    def start(self) -> None:
        for key, parts in self.parts_of.items():
            self.arrived[key, 0] = len(parts)
        self.starts.append(0.0)
        self._forward()

    def _param_in(self, key: int, version: int) -> bool:
        return self.arrived.get((key, version), 0) == len(self.parts_of[key])

    def _forward(self) -> None:
        if self.var < len(self.vars):
            if not self._param_in(self.var, self.iteration):
                self.blocked = True  # resumed by _deliver
                return
            i, self.var = self.var, self.var + 1
            self.sim.at(self.sim.now + self.fwd[i], self._forward)
            return
        begin = self.sim.now
        order = sorted(range(len(self.vars)), key=lambda i: (self.ready[i], -i))
        step = self.iteration
        for i in order:
            self.sim.at(begin + self.ready[i], lambda i=i: self._grad_ready(i, step))
        self.sim.at(begin + max(self.ready), self._step_end)

    def _step_end(self) -> None:
        self.iteration += 1
        self.var = 0
        self.starts.append(self.sim.now)
        if self.iteration >= self.iterations:
            self.s.flush()
            self._drain()
            return
        self._forward()

    # -- gradients out (Engine._pump / _sender / _pushed) -----------------------------

    def _grad_ready(self, key: int, step: int) -> None:
        now_ns = int(self.sim.now * _NS)
        if key == self.first_ready:
            for ps in range(self.num_ps):  # first gradient of the step: ask for k+1
                self.pull_queue[ps].append(step + 1)
                self._next_pull(ps)
        for p in self.parts_of[key]:
            self.s.add(schedulers_lib.ReadyItem(
                key=key, partition=p.partition, ps_index=p.ps_index, step=step, priority=key,
                nbytes=p.nbytes, ready_ns=now_ns))
        self._drain()

    def _drain(self) -> None:
        while block := self.s.next_block(int(self.sim.now * _NS)):
            self.queues[block[0].ps_index].append(block)
        for ps in range(self.num_ps):
            self._send(ps)

    def _send(self, ps: int) -> None:
        while self.queues[ps] and self.rpcs[ps] < MAX_RPCS_PER_LINK:
            block = self.queues[ps].pop(0)
            self.rpcs[ps] += 1
            start = self.sim.now
            nbytes = sum(item.nbytes for item in block)
            self.pushed_bytes += nbytes
            self.sim.at(start + self.overhead, lambda b=block, n=nbytes, t=start, ps=ps:
                        self.sim.start_flow(n, (("w", "up"), ("ps", ps, "down")),
                                            lambda: self._arrived_at_ps(b, t, ps)))

    def _arrived_at_ps(self, block, start: float, ps: int) -> None:
        at_ps = self.sim.now + self.latency
        for item in block:
            self.available[item.key, item.partition, item.step + 1] = at_ps
        if ps in self.waiting_pull:
            self.sim.at(at_ps, self.waiting_pull.pop(ps))
        end = at_ps + self.latency  # the response

        def pushed():
            self.rpcs[ps] -= 1
            self.s.on_sent(block, int(start * _NS), int(end * _NS))
            self._drain()
        self.sim.at(end, pushed)

    # -- parameters in (Engine._pull_version) ---------------------------------------

    def _next_pull(self, ps: int) -> None:
        """One stream per PS at a time, versions in the order asked (the puller thread)."""
        if not self.pulling[ps] and self.pull_queue[ps]:
            self.pulling[ps] = True
            self._pull(ps, self.pull_queue[ps].pop(0), 0)

    def _pull(self, ps: int, version: int, index: int) -> None:
        owned = self.owned[ps]
        if index >= len(owned):
            self.pulling[ps] = False
            self._next_pull(ps)
            return
        p = owned[index]
        t = self.available.get((p.key, p.partition, version))
        if t is None or t > self.sim.now:
            def resume(ps=ps, version=version, index=index):
                self._pull(ps, version, index)
            if t is None:
                self.waiting_pull[ps] = resume
            else:
                self.sim.at(t, resume)
            return
        def delivered(p=p):
            self.sim.at(self.sim.now + self.latency, lambda: self._deliver(p, version))
            self._pull(ps, version, index + 1)
        self.sim.at(self.sim.now + self.overhead, lambda: self.sim.start_flow(
            p.nbytes, (("ps", ps, "up"), ("w", "down")), delivered))

    def _deliver(self, p, version: int) -> None:
        self.arrived[p.key, version] = self.arrived.get((p.key, version), 0) + 1
        if (self.blocked and version == self.iteration and p.key == self.var
                and self._param_in(p.key, version)):
            self.blocked = False
            self._forward()


def _specs(profile: dict):
    return [types.SimpleNamespace(key=i, shape=v["shape"], dtype="float32")
            for i, v in enumerate(profile["variables"])]


def simulate(profile: dict, scheduler: str, workers: int, num_ps: int,
             bandwidth_mbit: float | None, *, latency_ms: float = 0.0,
             iterations: int | None = None, warmup: int = WARMUP_STEPS,
             compute_s: float | None = None, rpc_overhead_s: float = DEFAULT_RPC_OVERHEAD_S,
             scheduler_options: dict | None = None) -> dict:
    """Simulates training with one scheduler; returns step times and the ideal bound.

    Args:
      profile: a model profile (per variable ``shape``, ``nbytes``,
        ``forward_s``, ``backward_ready_s``; see ``models.profile_model``).
      scheduler: a name of :data:`prophet_tf.engine.schedulers.SCHEDULERS`.
      workers, num_ps: W >= 1 and P >= 1.
      bandwidth_mbit: every link's bandwidth each way (Mbit/s); None = unlimited.
      latency_ms: one-way latency between two hosts.
      iterations: steps to simulate (default ``warmup + 8``).
      warmup: first steps left out of the median.
      compute_s: scale the profile's compute to this step compute time.
      rpc_overhead_s: fixed time per message.
      scheduler_options: the scheduler's options.

    Returns:
      ``{"scheduler", "step_time_s", "step_times_s", "ideal_step_time_s", "ideal",
      "scheduler_class", "pushed_bytes_per_step"}``.

    Raises:
      ValueError: bad arguments (unknown scheduler, non-positive counts...).
    """
    if not isinstance(workers, int) or workers < 1 or not isinstance(num_ps, int) or num_ps < 1:
        raise ValueError(f"workers and num_ps must be ints >= 1. Received: workers={workers!r}, "
                         f"num_ps={num_ps!r}")
    if bandwidth_mbit is not None and not bandwidth_mbit > 0:
        raise ValueError(f"bandwidth_mbit must be positive or None. "
                         f"Received: bandwidth_mbit={bandwidth_mbit!r}")
    iterations = warmup + 8 if iterations is None else iterations
    if iterations <= warmup:
        raise ValueError(f"iterations must exceed warmup. Received: iterations={iterations}, "
                         f"warmup={warmup}")
    s = schedulers_lib.make_scheduler(scheduler, **(scheduler_options or {}))
    partition_bytes = s.partition_bytes or schedulers_lib.DEFAULT_PARTITION_BYTES
    partitions = sharding.plan(_specs(profile), num_ps, partition_bytes)
    rate = math.inf if bandwidth_mbit is None else bandwidth_mbit * 1e6 / 8
    capacity = {("w", "up"): rate, ("w", "down"): rate}
    for ps in range(num_ps):
        capacity["ps", ps, "up"] = capacity["ps", ps, "down"] = rate / workers
    sim = _Sim(capacity)
    scale = 1.0 if compute_s is None else compute_s / profile["compute_s"]
    worker = _Worker(sim, profile, s, partitions, num_ps, iterations, scale,
                     latency_ms / 1e3, rpc_overhead_s)
    sim.at(0.0, worker.start)
    sim.run(until=lambda: len(worker.starts) > iterations)
    if len(worker.starts) <= iterations:
        raise RuntimeError(f"simulation of {scheduler} stalled at iteration {worker.iteration} "
                           f"(t={sim.now:.4f} s); a scheduler held items it never released")
    steps = [b - a for a, b in zip(worker.starts, worker.starts[1:])]
    measured = steps[warmup:iterations]
    bound = ideal_lib.ideal_step_time(profile, workers, num_ps, bandwidth_mbit, latency_ms,
                                      compute_s)
    return {"scheduler": scheduler, "scheduler_class": f"{type(s).__module__}.{type(s).__name__}",
            "step_time_s": statistics.median(measured), "step_times_s": steps,
            "ideal_step_time_s": bound["ideal_s"], "ideal": bound,
            "pushed_bytes_per_step": worker.pushed_bytes / iterations}


def sweep(profile: dict, schedulers: Sequence[str], workers: Sequence[int],
          bandwidths_mbit: Sequence[float], num_ps: int | None = None, **kwargs) -> list[dict]:
    """:func:`simulate` over a grid; ``num_ps`` None = one PS per 4 workers (at least 1)."""
    rows = []
    for w in workers:
        ps = num_ps or max(1, w // 4)
        for bw in bandwidths_mbit:
            for name in schedulers:
                r = simulate(profile, name, w, ps, bw, **kwargs)
                rows.append({"workers": w, "ps": ps, "bandwidth_mbit": bw, "scheduler": name,
                             "step_time_s": r["step_time_s"],
                             "ideal_step_time_s": r["ideal_step_time_s"]})
    return rows


def plot_sweep(rows: list[dict], path: str, title: str) -> str:
    """PNG of speedup over FIFO against bandwidth, one panel per worker count."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workers = sorted({r["workers"] for r in rows})
    names = [n for n in dict.fromkeys(r["scheduler"] for r in rows) if n != "fifo"]
    fig, axes = plt.subplots(1, len(workers), figsize=(3.2 * len(workers), 3.2), sharey=True,
                             squeeze=False)
    fifo = {(r["workers"], r["bandwidth_mbit"]): r["step_time_s"] for r in rows
            if r["scheduler"] == "fifo"}
    for ax, w in zip(axes[0], workers):
        for name in names:
            pts = sorted((r["bandwidth_mbit"] / 1000, fifo[w, r["bandwidth_mbit"]] / r["step_time_s"])
                         for r in rows if r["workers"] == w and r["scheduler"] == name)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ps = next(r["ps"] for r in rows if r["workers"] == w)
        ax.set_title(f"{w} workers, {ps} PS")
        ax.set_xscale("log")
        ax.set_xlabel("bandwidth per link (Gbit/s)")
    axes[0][0].set_ylabel("speedup over FIFO")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _parse(argv):
    parser = argparse.ArgumentParser(
        prog="prophet-tf simulate", description=__doc__.split("\n\n")[0],
        epilog="Profiles live in prophet_tf/bench/profiles/<model>.json "
               "(make one with --profile MODEL).")
    parser.add_argument("--model", default="resnet50",
                        help="profiled model name or a profile .json (default resnet50)")
    parser.add_argument("--workers", type=int, default=16, help="W (default 16)")
    parser.add_argument("--ps", type=int, default=4, help="PS tasks (default 4)")
    parser.add_argument("--bandwidth-mbit", type=float, default=10000.0,
                        help="each link's bandwidth per direction (default 10000)")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="one-way latency")
    parser.add_argument("--schedulers", default="fifo,p3,bytescheduler,prophet")
    parser.add_argument("--iterations", type=int, default=None,
                        help=f"steps to simulate (default {WARMUP_STEPS} warm-up + 8)")
    parser.add_argument("--compute-s", type=float, default=None,
                        help="scale the profile to this compute time per step")
    parser.add_argument("--rpc-overhead-ms", type=float, default=DEFAULT_RPC_OVERHEAD_S * 1e3,
                        help="fixed cost per message (default %(default)s)")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--sweep", action="store_true",
                        help="2-64 workers x 1-25 Gbit/s (one PS per 4 workers)")
    parser.add_argument("--plot", default=None, help="PNG of speedup over FIFO (with --sweep)")
    parser.add_argument("--validate", default=None, metavar="BENCH_JSON",
                        help="predict a `prophet-tf bench` run and compare per scheduler")
    parser.add_argument("--profile", default=None, metavar="MODEL",
                        help="measure MODEL's per-variable compute profile and save it")
    parser.add_argument("--batch", type=int, default=32, help="per-worker batch of --profile")
    parser.add_argument("--profile-iterations", type=int, default=7,
                        help="measured iterations of --profile (after 2 warm-up)")
    return parser.parse_args(argv)


def _print_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    print("  ".join(f"{title:>{len(title) + 2}}" for title, _, _ in columns))
    for r in rows:
        print("  ".join(f"{format(r[key], fmt) if r.get(key) is not None else '-':>{len(title) + 2}}"
                        for title, key, fmt in columns))


def validate(bench: dict, profile: dict, rpc_overhead_s: float = DEFAULT_RPC_OVERHEAD_S) -> list:
    """Predicted vs measured step time per scheduler of a bench JSON."""
    config = bench["config"]
    profile = config.get("profile", profile)  # measured in the bench itself
    rows = []
    for r in bench["results"]:
        if r["scheduler"] not in schedulers_lib.SCHEDULERS:
            continue
        pred = simulate(profile, r["scheduler"], config["workers"], config["ps"],
                        config["bandwidth_mbit"], latency_ms=config.get("latency_ms", 0.0),
                        rpc_overhead_s=rpc_overhead_s)
        rows.append({"scheduler": r["scheduler"], "measured_s": r["step_time_s"],
                     "predicted_s": pred["step_time_s"],
                     "error": pred["step_time_s"] / r["step_time_s"] - 1})
    return rows


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from prophet_tf.bench import models
    if args.profile:
        profile = models.profile_model(args.profile, args.batch, args.profile_iterations)
        command = (f"prophet-tf simulate --profile {args.profile} --batch {args.batch} "
                   f"--profile-iterations {args.profile_iterations}")
        path = models.save_profile(profile, command)
        print(f"{args.profile}: {profile['num_params']:,} parameters, "
              f"{profile['trainable_bytes'] / 1e6:.1f} MB, batch {args.batch}: forward "
              f"{profile['forward_s'] * 1e3:.1f} ms, backward {profile['backward_s'] * 1e3:.1f} "
              f"ms; saved to {path}")
        return 0
    try:
        profile = models.load_profile(args.model)
        names = [n.strip() for n in args.schedulers.split(",") if n.strip()]
        for n in names:
            schedulers_lib.validate_scheduler(n)
        overhead = args.rpc_overhead_ms / 1e3
        if args.validate:
            with open(args.validate) as f:
                bench = json.load(f)
            rows = validate(bench, profile, overhead)
            _print_table(rows, [("scheduler", "scheduler", ""), ("measured s", "measured_s", ".4f"),
                                ("predicted s", "predicted_s", ".4f"), ("error", "error", "+.1%")])
            out = {"validation": rows, "bench_config": bench["config"]}
        elif args.sweep:
            rows = sweep(profile, names, [2, 4, 8, 16, 32, 64],
                         [1000, 2500, 5000, 10000, 25000], iterations=args.iterations,
                         rpc_overhead_s=overhead, compute_s=args.compute_s)
            by = {(r["workers"], r["bandwidth_mbit"], r["scheduler"]): r for r in rows}
            for r in rows:
                f = by[r["workers"], r["bandwidth_mbit"], "fifo"]["step_time_s"]
                r["speedup_vs_fifo"] = f / r["step_time_s"]
            _print_table(rows, [("workers", "workers", "d"), ("ps", "ps", "d"),
                                ("Mbit/s", "bandwidth_mbit", ".0f"), ("scheduler", "scheduler", ""),
                                ("step s", "step_time_s", ".4f"), ("ideal s", "ideal_step_time_s", ".4f"),
                                ("vs fifo", "speedup_vs_fifo", ".2f")])
            out = {"model": args.model, "sweep": rows}
            if args.plot:
                plot_sweep(rows, args.plot, f"{args.model}: simulated speedup over FIFO")
                print(f"plot written to {args.plot}")
        else:
            rows = [simulate(profile, n, args.workers, args.ps, args.bandwidth_mbit,
                             latency_ms=args.latency_ms, iterations=args.iterations,
                             compute_s=args.compute_s, rpc_overhead_s=overhead) for n in names]
            fifo = next((r["step_time_s"] for r in rows if r["scheduler"] == "fifo"), None)
            for r in rows:
                r["speedup_vs_fifo"] = fifo / r["step_time_s"] if fifo else None
            _print_table(rows, [("scheduler", "scheduler", ""), ("step s", "step_time_s", ".4f"),
                                ("ideal s", "ideal_step_time_s", ".4f"),
                                ("vs fifo", "speedup_vs_fifo", ".2f")])
            out = {"config": {"model": args.model, "workers": args.workers, "ps": args.ps,
                              "bandwidth_mbit": args.bandwidth_mbit,
                              "latency_ms": args.latency_ms, "rpc_overhead_s": overhead},
                   "results": rows}
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"prophet-tf simulate: {e}", file=sys.stderr)
        return 2
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
