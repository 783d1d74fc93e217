"""`prophet-tf simulate`: a discrete-event simulation of synchronous PS training.

    prophet-tf simulate --model resnet50 --workers 16 --ps 4 --bandwidth-mbit 10000 \\
        --schedulers fifo,p3,bytescheduler,prophet --json out.json
    prophet-tf simulate --sweep --model resnet50 --plot docs/performance-resnet50.png
    prophet-tf simulate --profile resnet50        # measure and save a profile

It drives the engine's own send decisions, a
:class:`prophet_tf.engine.dispatch.Dispatch` around the engine's scheduler
(:func:`prophet_tf.engine.schedulers.make_scheduler`), exactly as
``prophet_tf.engine.engine.Engine`` does, with virtual time in ns instead of
``time.monotonic_ns()``: each ready gradient is ``add``-ed at its ready time
(the dispatch cuts it into the scheduler's partitions), every block
``next_blocks(now)`` releases is pushed at once (the dispatch's window bounds
what is in flight), and a finished push calls ``on_sent(block, start, end)``
and drains again.

What is modelled, per iteration of one worker (all workers are identical and
in lockstep, so one is simulated and every PS link is shared W ways):

- forward: variable i's forward time (``models.variable_forward_s``) starts
  when variable i-1's has ended
  and variable i's parameters of this version are in (all partitions);
- backward starts when the forward ends; gradient i is ready
  ``backward_ready_s[i]`` later (the profile); the iteration (the Keras step
  the bench measures) ends with the last gradient, and the next forward starts;
- network: a push of a block crosses the worker's uplink and the PS's
  downlink, a pulled partition the PS's uplink and the worker's downlink.
  A worker's pushes to one PS share one connection, so their bytes go in
  order: a push's flow starts when the one before it has arrived (in the
  bench's timelines, of the pushes sent while the one before them to the
  same PS was on the wire, 92.5–99.5% arrived after it: ``breakdown.push_order``).
  Links have the given bandwidth in each direction; a PS link carries the W
  workers' identical flows, so each gets 1/W of it; concurrent flows share
  a link max-min fairly (a fluid model of TCP), or with ``share_sigma`` by
  a log-normal weight per message: TCP connections through a shaped link
  take turns (``benchmarks/flow_share.py``), so one host's messages can get
  ahead of another's (``--validate --flow-share``). The shares follow
  messages' starts and ends up to ``rate_lag_s`` late (what keeps many
  workers fast: ``simulate_network``). Each message costs
  ``rpc_overhead_s + nbytes * rpc_per_byte_s`` at its ends before its bytes
  flow (serialising, gRPC, Python, the PS's checks and sum: a bench run
  measures both, ``message_costs.py``) and a one-way latency after;
- PS: a partition's version k+1 exists once its iteration-k push has arrived
  (W pushes arrive together by symmetry); the apply takes no time;
- pulls: on the first gradient of iteration k the worker asks each PS for version
  k+1 of its partitions in priority order; the PS streams them one message
  after another, each with the first partition that exists and the next ones
  that do while they add at most ``PULL_PACK_BYTES`` (as ``PSClient.pull``).
- answers first (colocated, as the engine by default,
  ``prophet_tf.engine.answers_first``): before a block of step s goes to a PS
  on another host, the worker waits, asking every ``ANSWERS_POLL_S``, until
  the PS tasks on its own host owe no partition of version s or older to
  workers on other hosts (a pull in progress, not yet sent). Without it a
  worker that is ahead pushes over its PS's answers to the others and stays
  ahead, a whole step ahead at times, which the bench does not show.

Step time: iteration k's time is from its forward's start to the next one's,
median over the iterations after ``warmup`` (the bench drops the same ones).

Here: the workers, the PS's versions and :func:`simulate`. The network (the
event queue, links shared by flows, each layout's links) is
:mod:`prophet_tf.bench.simulate_network`; fitting ``share_sigma`` to a
measured link is :mod:`prophet_tf.bench.simulate_flow_share`.
"""
from __future__ import annotations

import gc
import logging
import math
import statistics
import types
from functools import partial  # events: bound methods with arguments, no closures

from prophet_tf.bench import ideal as ideal_lib
from prophet_tf.bench import models
from prophet_tf.bench.simulate_links import ClusterLinks
from prophet_tf.bench.simulate_network import FluidSim, fluid_sim
from prophet_tf.bench.simulate_servers import Servers, partition_id
from prophet_tf.engine import schedulers as schedulers_lib
from prophet_tf.engine.answers_first import AnswersFirst
from prophet_tf.engine.dispatch import Dispatch
from prophet_tf.ps.protocol import PULL_PACK_BYTES

__all__ = ["simulate", "DEFAULT_RPC_OVERHEAD_S", "DEFAULT_RATE_LAG_S", "WARMUP_ITERATIONS"]

logger = logging.getLogger(__name__)

#: Fixed cost per message (serialisation, gRPC, Python), from the bench's
#: loopback figures: ~0.1 ms per message at the client plus the PS's handling.
DEFAULT_RPC_OVERHEAD_S = 0.0003
#: How late the links' shares may follow flows' starts and ends
#: (``simulate_network.FluidSim``'s ``rate_lag_s``): the validation runs
#: predict within 0.5% of recomputing them at every change, and 16 workers
#: and more run several times faster.
DEFAULT_RATE_LAG_S = 0.0002
WARMUP_ITERATIONS = schedulers_lib.ProphetScheduler.ITERATIONS_BEFORE_PLAN
#: How often a worker held by answers first asks its host's PS tasks again.
ANSWERS_POLL_S = AnswersFirst.POLL_S
_NS = 1_000_000_000
LAYOUTS = ideal_lib.LAYOUTS


class _Worker:
    """One worker's engine, compute and pulls, in virtual time."""

    def __init__(self, sim: FluidSim, profile: dict, dispatch: Dispatch, num_ps: int,
                 iterations: int, compute_scale: float, latency_s: float, rpc_overhead_s: float,
                 network: ClusterLinks, servers: Servers, index: int = 0,
                 rpc_per_byte_s: float = 0.0, finished: list | None = None,
                 answers_first: bool = True):
        self.sim, self.dispatch, self.servers = sim, dispatch, servers
        self.push_links = [network.push_links(index, ps) for ps in range(num_ps)]
        self.pull_links = [network.pull_links(index, ps) for ps in range(num_ps)]
        # Their link ids, looked up at the first message (that numbers the links).
        self.push_routes: list = [False] * num_ps
        self.pull_routes: list = [False] * num_ps
        self.finished = [] if finished is None else finished  # workers past their last iteration
        self.vars = profile["variables"]
        self.fwd = [f * compute_scale for f in models.variable_forward_s(profile)]
        self.ready = [v["backward_ready_s"] * compute_scale for v in self.vars]
        self.num_ps, self.iterations = num_ps, iterations
        self.latency, self.overhead, self.per_byte = latency_s, rpc_overhead_s, rpc_per_byte_s
        self.parts_of = dispatch.partitions_of
        # Each PS's partitions by id, in the order to pull them.
        self.owned = [[partition_id(p.key, p.partition) for p in dispatch.pull_order(i)]
                      for i in range(num_ps)]
        self.partition_of = {partition_id(p.key, p.partition): p for p in dispatch.partitions}
        # Each partition's pull message's time at the ends (_cost), by id.
        self.pull_cost = {uid: self._cost(p.nbytes) for uid, p in self.partition_of.items()}
        self.pull_queue: list[list[int]] = [[] for _ in range(num_ps)]  # versions asked for
        # Per PS, the pushes whose bytes wait for the one flowing on the
        # connection (None: none flows): their bytes go in order (_push_flow).
        self.push_queue: list[list | None] = [None] * num_ps
        self.pulling = [False] * num_ps
        self.index = index
        # Answers first (the engine's default): the PS tasks on this worker's host,
        # and the workers on other hosts they may owe answers to.
        self.local_ps = network.local_ps(index, num_ps)
        self.other_workers = (set(range(network.workers)) - {index}
                              if self.local_ps and answers_first else set())
        self.cleared = -1  # pushes of steps up to this one go without asking
        self.blocked = False  # the forward waits for a parameter
        self.arrived: dict[tuple[int, int], int] = {}  # (key, version) -> partitions in
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
        iteration = self.iteration
        self.sim.at_sorted([(begin + self.ready[i], lambda i=i: self._grad_ready(i, iteration))
                            for i in order] + [(begin + max(self.ready), self._iteration_end)])

    def _iteration_end(self) -> None:
        self.iteration += 1
        self.var = 0
        self.starts.append(self.sim.now)
        if self.iteration >= self.iterations:
            self.finished.append(self)
            self.dispatch.flush()
            self._drain()
            return
        self._forward()

    # -- gradients out (GradientsOut.pump / sender / _pushed) -----------------------

    def _grad_ready(self, key: int, iteration: int) -> None:
        if self.dispatch.starts_iteration(iteration):
            for ps in range(self.num_ps):  # first gradient of the iteration: ask for k+1
                self.pull_queue[ps].append(iteration + 1)
                self._next_pull(ps)
        # Native keys are the variables' positions here, as their PS keys.
        self.dispatch.add(key, iteration, int(self.sim.now * _NS))
        self._drain()

    def _drain(self) -> None:
        for block in self.dispatch.next_blocks(int(self.sim.now * _NS)):
            self._send(block)

    def _send(self, block) -> None:
        ps = block[0].ps_index
        step = block[0].iteration if len(block) == 1 else min(item.iteration for item in block)
        if self.other_workers and ps not in self.local_ps and step > self.cleared:
            if self.servers.owed(self.local_ps, step, self.other_workers):
                self.sim.at(self.sim.now + ANSWERS_POLL_S, lambda: self._send(block))
                return
            self.cleared = step
        start = self.sim.now
        nbytes = block[0].nbytes if len(block) == 1 else sum(item.nbytes for item in block)
        self.pushed_bytes += nbytes
        self.dispatch.release(block)  # serialized at the start, as in the engine
        self.sim.at(start + self._cost(nbytes), partial(self._push_flow, block, start, ps, nbytes))

    def _push_flow(self, block, start: float, ps: int, nbytes: int) -> None:
        """A push's bytes flow once those of the pushes before it to this PS
        have: one connection carries them (gRPC's streams of one TCP
        connection), so a small push does not overtake a large one."""
        waiting = self.push_queue[ps]
        if waiting is not None:
            waiting.append((block, start, nbytes))
            return
        self.push_queue[ps] = []
        self._push_bytes(block, start, ps, nbytes)

    def _push_bytes(self, block, start: float, ps: int, nbytes: int) -> None:
        routes = self.push_routes
        if routes[ps] is False:
            routes[ps] = self.sim.route(self.push_links[ps])
        self.sim.start_flow(nbytes, self.push_links[ps],
                            partial(self._arrived_at_ps, block, start, ps), routes[ps])

    def _arrived_at_ps(self, block, start: float, ps: int) -> None:
        waiting = self.push_queue[ps]
        if waiting:  # the next push's bytes follow on the connection
            queued, queued_start, queued_bytes = waiting.pop(0)
            self._push_bytes(queued, queued_start, ps, queued_bytes)
        else:
            self.push_queue[ps] = None
        at_ps = self.sim.now + self.latency
        self.servers.arrived(ps, block, at_ps)
        end = at_ps + self.latency  # the response
        self.sim.at(end, partial(self._pushed, block, start, end))

    def _pushed(self, block, start: float, end: float) -> None:
        self.dispatch.on_sent(block, int(start * _NS), int(end * _NS))
        self._drain()

    # -- parameters in (ParametersIn.pull_version) -----------------------------------

    def _next_pull(self, ps: int) -> None:
        """One stream per PS at a time, versions in the order asked (the puller thread)."""
        if not self.pulling[ps] and self.pull_queue[ps]:
            self.pulling[ps] = True
            version, left = self.pull_queue[ps].pop(0), list(self.owned[ps])
            self.servers.pulls[ps][self.index] = (version, left)  # owed (answers first)
            self._pull(ps, version, left)

    def _pull(self, ps: int, version: int, left: list) -> None:
        """The PS streams each partition of ``version`` once it is applied; of
        those applied, the most urgent first (``left`` is in priority order)."""
        if not left:
            self.servers.pulls[ps].pop(self.index, None)
            self.pulling[ps] = False
            self._next_pull(ps)
            return
        available, now = self.servers.available[version], self.sim.now
        applied = available.__contains__
        for i, uid in enumerate(left):  # the first one applied (most often the first)
            if applied(uid) and available[uid] <= now:
                break
        else:
            def resume(ps=ps, version=version, left=left):
                self._pull(ps, version, left)
            known = [available[uid] for uid in filter(applied, left)]
            if known:
                self.sim.at(min(known), resume)
            else:
                self.servers.wait(ps, resume)
            return
        del left[i]
        message = [self.partition_of[uid], *self._pack(left, i, available, now)]
        if len(message) == 1:
            nbytes, cost = message[0].nbytes, self.pull_cost[uid]
        else:
            nbytes = sum(q.nbytes for q in message)
            cost = self._cost(nbytes)
        self.sim.at(now + cost, partial(self._pull_flow, ps, version, left, message, nbytes))

    def _pack(self, left: list, start: int, available: dict, now: float) -> list:
        """Removed from ``left``, the next ones applied after ``start`` (those
        before it were not), in order, while they add at most PULL_PACK_BYTES
        (``prophet_tf.ps.pulls``; here payload bytes): they ride with the one taken."""
        pack, added, i = [], 0, start
        while i < len(left):
            uid = left[i]
            if available.get(uid, math.inf) > now:
                i += 1
                continue
            q = self.partition_of[uid]
            added += q.nbytes
            if added > PULL_PACK_BYTES:
                break
            del left[i]
            pack.append(q)
        return pack

    def _pull_flow(self, ps: int, version: int, left: list, message: list, nbytes: int) -> None:
        """The bytes of a pull message (its partitions, in order) flow."""
        routes = self.pull_routes
        if routes[ps] is False:
            routes[ps] = self.sim.route(self.pull_links[ps])
        self.sim.start_flow(nbytes, self.pull_links[ps],
                            partial(self._pulled, ps, version, left, message), routes[ps])

    def _pulled(self, ps: int, version: int, left: list, message: list) -> None:
        """A message's last byte is in: its partitions delivered after the
        latency; the next one."""
        sim = self.sim
        for p in message:
            sim.at(sim.now + self.latency, partial(self._deliver, p, version))
        self._pull(ps, version, left)

    def _cost(self, nbytes: int) -> float:
        """A message's time at the ends, besides the link: per message and per byte."""
        return self.overhead + nbytes * self.per_byte

    def _deliver(self, p, version: int) -> None:
        key = p.key, version
        self.arrived[key] = self.arrived.get(key, 0) + 1
        if (self.blocked and version == self.iteration and p.key == self.var
                and self._param_in(p.key, version)):
            self.blocked = False
            self._forward()


def specs_of(profile: dict):
    """The variable specs of a profile, as the engine registers them (key = priority)."""
    return [types.SimpleNamespace(key=i, shape=v["shape"], dtype="float32", priority=i)
            for i, v in enumerate(profile["variables"])]


def simulate(profile: dict, scheduler: str, workers: int, num_ps: int,
             bandwidth_mbit: float | None, *, latency_ms: float = 0.0,
             iterations: int | None = None, warmup: int = WARMUP_ITERATIONS,
             compute_s: float | None = None, rpc_overhead_s: float = DEFAULT_RPC_OVERHEAD_S,
             rpc_per_byte_s: float = 0.0, scheduler_options: dict | None = None, layout: str = "dedicated",
             framing: float = ideal_lib.TCP_FRAMING, share_sigma: float = 0.0,
             seed: int = 0, answers_first: bool = True,
             rate_lag_s: float = DEFAULT_RATE_LAG_S, compiled: bool = True) -> dict:
    """Simulates training with one scheduler; returns step times and the ideal bound.

    Args:
      profile: a model profile (per variable ``shape``, ``nbytes``,
        ``forward_s``, ``backward_ready_s``; see ``models.profile_model``).
      scheduler: a name of :data:`prophet_tf.engine.schedulers.SCHEDULERS`.
      workers, num_ps: W >= 1 and P >= 1.
      bandwidth_mbit: every link's bandwidth each way (Mbit/s); None = unlimited.
      latency_ms: one-way latency between two hosts.
      iterations: iterations to simulate (default ``warmup + 8``).
      warmup: first iterations left out of the median.
      compute_s: scale the profile's compute to this compute time per iteration.
      rpc_overhead_s: fixed time per message.
      rpc_per_byte_s: time per message byte at the ends (serialising, copying,
        parsing), before the bytes flow.
      scheduler_options: the scheduler's options.
      layout: "dedicated" (PS tasks on hosts of their own) or "colocated" (PS p
        on worker host p % W; ``num_ps`` a multiple of ``workers``).
      framing: wire bytes per message byte (``ideal.TCP_FRAMING``: TCP
        headers; 1.0 for a shaper that counts message bytes).
      share_sigma: 0 shares every link evenly among its flows; above 0, each
        message's weight is log-normal with this sigma (see
        ``simulate_network.FluidSim``), drawn from a generator seeded with
        ``seed``. In the dedicated layout one worker stands for all, so the
        workers cannot drift apart there.
      answers_first: colocated, a worker holds its pushes to other hosts while
        its host's PS tasks owe the other hosts' workers answers, as the engine
        does unless ``PROPHET_TF_ANSWERS_FIRST=0`` (see the module docstring).
      rate_lag_s: how late the links' shares may follow flows' starts and
        ends (``simulate_network.FluidSim``); 0 recomputes them at every change.
      compiled: with a rate lag, the network in compiled code (the same
        results to the bit; False: the Python path, the reference).

    Returns:
      ``{"scheduler", "step_time_s", "step_times_s", "ideal_step_time_s", "ideal",
      "scheduler_class", "pushed_bytes_per_step", "phase_spread_s"}``.

    Raises:
      ValueError: bad arguments (unknown scheduler, non-positive counts...).
    """
    if not isinstance(workers, int) or workers < 1 or not isinstance(num_ps, int) or num_ps < 1:
        raise ValueError(f"workers and num_ps must be ints >= 1. Received: workers={workers!r}, "
                         f"num_ps={num_ps!r}")
    if bandwidth_mbit is not None and not bandwidth_mbit > 0:
        raise ValueError(f"bandwidth_mbit must be positive or None. "
                         f"Received: bandwidth_mbit={bandwidth_mbit!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}. Received: layout={layout!r}")
    if not (isinstance(share_sigma, (int, float)) and 0 <= share_sigma < math.inf):
        raise ValueError(f"share_sigma must be a finite number >= 0. "
                         f"Received: share_sigma={share_sigma!r}")
    if layout == "colocated" and num_ps % workers:
        raise ValueError(f"the colocated layout puts the same number of PS tasks on every "
                         f"worker host, so num_ps must be a multiple of workers. Received: "
                         f"num_ps={num_ps}, workers={workers}")
    iterations = warmup + 8 if iterations is None else iterations
    if iterations <= warmup:
        raise ValueError(f"iterations must exceed warmup. Received: iterations={iterations}, "
                         f"warmup={warmup}")
    specs = specs_of(profile)
    rate = ideal_lib.payload_bytes_per_s(bandwidth_mbit, framing) or math.inf
    network = ClusterLinks(layout, workers, num_ps, rate)
    sim = fluid_sim(network.capacity, share_sigma, seed, rate_lag_s, compiled)
    servers = Servers(sim, network.simulated)
    scale = 1.0 if compute_s is None else compute_s / profile["compute_s"]
    simulated, finished = [], []
    for index in range(network.simulated):
        s = schedulers_lib.make_scheduler(scheduler, **(scheduler_options or {}))
        dispatch = Dispatch([spec.key for spec in specs], specs, num_ps, s, num_workers=workers,
                            ps_on_host=bool(network.local_ps(index, num_ps)))
        simulated.append(_Worker(sim, profile, dispatch, num_ps, iterations, scale,
                                 latency_ms / 1e3, rpc_overhead_s, network, servers, index,
                                 rpc_per_byte_s, finished, answers_first))
        sim.at(0.0, simulated[-1].start)
    worker = simulated[0]
    # Millions of short-lived objects (events, closures), no cycles worth
    # collecting: the collector's passes took a fifth of the time at 32 workers.
    collecting = gc.isenabled()
    gc.disable()
    try:
        sim.run(until=(finished, len(simulated)))  # checked at every event: O(1)
    finally:
        if collecting:
            gc.enable()
    if len(worker.starts) <= iterations:
        raise RuntimeError(f"simulation of {scheduler} stalled at iteration {worker.iteration} "
                           f"(t={sim.now:.4f} s); a scheduler held items it never released")
    times = [b - a for a, b in zip(worker.starts, worker.starts[1:])]
    measured = times[warmup:iterations]
    # How far apart the simulated workers started each iteration (0 where
    # one worker stands for all).
    spread = [max(w.starts[k] for w in simulated) - min(w.starts[k] for w in simulated)
              for k in range(iterations + 1)]
    bound = ideal_lib.ideal_step_time(profile, workers, num_ps, bandwidth_mbit, latency_ms,
                                      compute_s, layout=layout, framing=framing)
    return {"scheduler": scheduler, "scheduler_class": f"{type(s).__module__}.{type(s).__name__}",
            "step_time_s": statistics.median(measured), "step_times_s": times,
            "ideal_step_time_s": bound["ideal_s"], "ideal": bound,
            "pushed_bytes_per_step": worker.pushed_bytes / iterations,
            "phase_spread_s": spread}
