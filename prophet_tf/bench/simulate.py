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
  Links have the given bandwidth in each direction; a PS link carries the W
  workers' identical flows, so each gets 1/W of it; concurrent flows share
  a link max-min fairly (a fluid model of TCP), or with ``share_sigma`` by
  a log-normal weight per message: TCP connections through a shaped link
  take turns (``benchmarks/flow_share.py``), so one host's messages can get
  ahead of another's (``--validate --flow-share``). Each message costs
  ``rpc_overhead_s + nbytes * rpc_per_byte_s`` at its ends before its bytes
  flow (serialising, gRPC, Python, the PS's checks and sum: a bench run
  measures both, ``message_costs.py``) and a one-way latency after;
- PS: a partition's version k+1 exists once its iteration-k push has arrived
  (W pushes arrive together by symmetry); the apply takes no time;
- pulls: on the first gradient of iteration k the worker asks each PS for version
  k+1 of its partitions in priority order; the PS streams them one after
  another, each when it exists (as ``PSClient.pull``).

Step time: iteration k's time is from its forward's start to the next one's,
median over the iterations after ``warmup`` (the bench drops the same ones).
"""
from __future__ import annotations

import heapq
import logging
import math
import random
import statistics
import types
from typing import Callable

from prophet_tf.bench import ideal as ideal_lib
from prophet_tf.bench import models
from prophet_tf.engine import schedulers as schedulers_lib
from prophet_tf.engine.dispatch import Dispatch

__all__ = ["simulate", "DEFAULT_RPC_OVERHEAD_S", "WARMUP_ITERATIONS"]

logger = logging.getLogger(__name__)

#: Fixed cost per message (serialisation, gRPC, Python), from the bench's
#: loopback figures: ~0.1 ms per message at the client plus the PS's handling.
DEFAULT_RPC_OVERHEAD_S = 0.0003
WARMUP_ITERATIONS = schedulers_lib.ProphetScheduler.ITERATIONS_BEFORE_PLAN
_NS = 1_000_000_000


class _Flow:
    __slots__ = ("remaining", "links", "rate", "done", "weight")

    def __init__(self, nbytes: float, links: tuple, done: Callable[[], None], weight: float):
        self.remaining = float(nbytes)
        self.links = links
        self.rate = 0.0
        self.done = done
        self.weight = weight


class _Sim:
    """Event queue plus a fluid network of weighted max-min fair flows.

    Each flow's weight is 1, or with ``share_sigma`` > 0 drawn from a
    log-normal distribution (median 1, that sigma of its log) when it
    starts: TCP connections through a shaped link take turns rather than
    share it evenly (``benchmarks/flow_share.py`` measures how unevenly).
    """

    def __init__(self, capacity: dict, share_sigma: float = 0.0, seed: int = 0):
        self.share_sigma = share_sigma
        self._random = random.Random(seed)
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
        weight = math.exp(self._random.gauss(0.0, self.share_sigma)) if self.share_sigma else 1.0
        flow = _Flow(nbytes, links, done, weight)
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
        # Progressive filling: the most constrained link (least capacity per
        # unit of weight) fixes its flows' rates, in proportion to their weights.
        left = {l: c for l, c in self.capacity.items()}
        unfixed = set(range(len(self.flows)))
        while unfixed:
            weights: dict = {}
            for i in unfixed:
                for l in self.flows[i].links:
                    weights[l] = weights.get(l, 0.0) + self.flows[i].weight
            link = min(weights, key=lambda l: left[l] / weights[l])
            share = left[link] / weights[link]
            for i in [i for i in unfixed if link in self.flows[i].links]:
                flow = self.flows[i]
                flow.rate = share * flow.weight
                unfixed.discard(i)
                for l in flow.links:
                    left[l] -= flow.rate
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


class _Servers:
    """The PS tasks' versions: a partition's version k+1 exists once every
    simulated worker's iteration-k push of it has arrived."""

    def __init__(self, sim: _Sim, pushers: int):
        self.sim, self.pushers = sim, pushers
        self.available: dict[tuple, float] = {}  # (key, partition, version) -> time at PS
        self._pushes: dict[tuple, int] = {}
        self._waiting: dict[int, list[Callable]] = {}  # ps -> pulls to resume

    def arrived(self, ps: int, items, at: float) -> None:
        for item in items:
            version = (item.key, item.partition, item.iteration + 1)
            count = self._pushes.pop(version, 0) + 1
            if count == self.pushers:
                self.available[version] = at
            else:
                self._pushes[version] = count
        for resume in self._waiting.pop(ps, []):
            self.sim.at(at, resume)

    def wait(self, ps: int, resume: Callable) -> None:
        self._waiting.setdefault(ps, []).append(resume)


class _Worker:
    """One worker's engine, compute and pulls, in virtual time."""

    def __init__(self, sim: _Sim, profile: dict, dispatch: Dispatch, num_ps: int,
                 iterations: int, compute_scale: float, latency_s: float, rpc_overhead_s: float,
                 network: "_Network", servers: _Servers, index: int = 0,
                 rpc_per_byte_s: float = 0.0):
        self.sim, self.dispatch, self.servers = sim, dispatch, servers
        self.push_links = lambda ps: network.push_links(index, ps)
        self.pull_links = lambda ps: network.pull_links(index, ps)
        self.vars = profile["variables"]
        self.fwd = [f * compute_scale for f in models.variable_forward_s(profile)]
        self.ready = [v["backward_ready_s"] * compute_scale for v in self.vars]
        self.num_ps, self.iterations = num_ps, iterations
        self.latency, self.overhead, self.per_byte = latency_s, rpc_overhead_s, rpc_per_byte_s
        self.parts_of = dispatch.partitions_of
        self.owned = [dispatch.pull_order(i) for i in range(num_ps)]
        self.pull_queue: list[list[int]] = [[] for _ in range(num_ps)]  # versions asked for
        self.pulling = [False] * num_ps
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
        for i in order:
            self.sim.at(begin + self.ready[i], lambda i=i: self._grad_ready(i, iteration))
        self.sim.at(begin + max(self.ready), self._iteration_end)

    def _iteration_end(self) -> None:
        self.iteration += 1
        self.var = 0
        self.starts.append(self.sim.now)
        if self.iteration >= self.iterations:
            self.dispatch.flush()
            self._drain()
            return
        self._forward()

    # -- gradients out (Engine._pump / _sender / _pushed) -----------------------------

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
        start = self.sim.now
        nbytes = sum(item.nbytes for item in block)
        self.pushed_bytes += nbytes
        self.dispatch.release(block)  # serialized at the start, as in the engine
        self.sim.at(start + self._cost(nbytes), lambda: self.sim.start_flow(
            nbytes, self.push_links(ps),
            lambda: self._arrived_at_ps(block, start, ps)))

    def _arrived_at_ps(self, block, start: float, ps: int) -> None:
        at_ps = self.sim.now + self.latency
        self.servers.arrived(ps, block, at_ps)
        end = at_ps + self.latency  # the response

        def pushed():
            self.dispatch.on_sent(block, int(start * _NS), int(end * _NS))
            self._drain()
        self.sim.at(end, pushed)

    # -- parameters in (Engine._pull_version) ---------------------------------------

    def _next_pull(self, ps: int) -> None:
        """One stream per PS at a time, versions in the order asked (the puller thread)."""
        if not self.pulling[ps] and self.pull_queue[ps]:
            self.pulling[ps] = True
            self._pull(ps, self.pull_queue[ps].pop(0), list(self.owned[ps]))

    def _pull(self, ps: int, version: int, left: list) -> None:
        """The PS streams each partition of ``version`` once it is applied; of
        those applied, the most urgent first (``left`` is in priority order)."""
        if not left:
            self.pulling[ps] = False
            self._next_pull(ps)
            return
        times = [self.servers.available.get((p.key, p.partition, version)) for p in left]
        ready = [i for i, t in enumerate(times) if t is not None and t <= self.sim.now]
        if not ready:
            def resume(ps=ps, version=version, left=left):
                self._pull(ps, version, left)
            known = [t for t in times if t is not None]
            if known:
                self.sim.at(min(known), resume)
            else:
                self.servers.wait(ps, resume)
            return
        p = left.pop(ready[0])

        def delivered(p=p):
            self.sim.at(self.sim.now + self.latency, lambda: self._deliver(p, version))
            self._pull(ps, version, left)
        self.sim.at(self.sim.now + self._cost(p.nbytes), lambda: self.sim.start_flow(
            p.nbytes, self.pull_links(ps), delivered))

    def _cost(self, nbytes: int) -> float:
        """A message's time at the ends, besides the link: per message and per byte."""
        return self.overhead + nbytes * self.per_byte

    def _deliver(self, p, version: int) -> None:
        self.arrived[p.key, version] = self.arrived.get((p.key, version), 0) + 1
        if (self.blocked and version == self.iteration and p.key == self.var
                and self._param_in(p.key, version)):
            self.blocked = False
            self._forward()


class _Network:
    """The links each message crosses, by layout (see the module doc).

    dedicated: PS hosts of their own; one worker is simulated and PS p's link
    carries the W workers' identical flows, so it gets 1/W of it.
    colocated: PS p lives on worker host ``p % W``; every worker is simulated
    (the placement need not be symmetric), and each host has one link each
    way. A message between two hosts crosses the sender's uplink and the
    receiver's downlink; one within a host crosses none.
    """

    def __init__(self, layout: str, workers: int, num_ps: int, bytes_per_s: float):
        self.layout, self.workers = layout, workers
        #: Workers simulated: all of them when colocated, else one by symmetry.
        self.simulated = workers if layout == "colocated" else 1
        self.capacity = {}
        for w in range(self.simulated):
            self.capacity["w", w, "up"] = self.capacity["w", w, "down"] = bytes_per_s
        if layout == "dedicated":
            for ps in range(num_ps):
                self.capacity["ps", ps, "up"] = bytes_per_s / workers
                self.capacity["ps", ps, "down"] = bytes_per_s / workers

    def push_links(self, worker: int, ps: int) -> tuple:
        if self.layout == "dedicated":
            return (("w", worker, "up"), ("ps", ps, "down"))
        host = ps % self.workers
        return () if host == worker else (("w", worker, "up"), ("w", host, "down"))

    def pull_links(self, worker: int, ps: int) -> tuple:
        if self.layout == "dedicated":
            return (("ps", ps, "up"), ("w", worker, "down"))
        host = ps % self.workers
        return () if host == worker else (("w", host, "up"), ("w", worker, "down"))


LAYOUTS = ideal_lib.LAYOUTS


def message_rate_ratios(share_sigma: float, flows: int, *, message_bytes: int = 1 << 18,
                        messages: int = 2000, seed: int = 0) -> list:
    """Each message's rate over the fair share, when ``flows`` connections
    keep one link busy with back-to-back messages and flows share it with
    weights of that ``share_sigma``: what ``benchmarks/flow_share.py``
    measures on the emulated link, here in the fluid model, to fit one to
    the other. The first tenth is left out (all flows started together)."""
    if not isinstance(flows, int) or flows < 1:
        raise ValueError(f"flows must be an int >= 1. Received: {flows!r}")
    capacity = 1e6  # bytes/s; the ratios do not depend on it
    sim = _Sim({"link": capacity}, share_sigma, seed)
    spans: list = []

    def send() -> None:
        start = sim.now

        def done() -> None:
            spans.append(sim.now - start)
            send()
        sim.start_flow(message_bytes, ("link",), done)
    for _ in range(flows):
        sim.at(0.0, send)
    sim.run(until=lambda: len(spans) >= messages)
    fair = capacity / flows
    return [message_bytes / t / fair for t in spans[messages // 10:messages]]


def fit_share_sigma(median_ratio: float, flows: int, *, seed: int = 0) -> float:
    """The ``share_sigma`` whose simulated messages have the measured median
    rate over the fair share (bisection; the median grows with the sigma
    from 1, fair sharing, towards ``flows``, one message at a time)."""
    if not 1.0 <= median_ratio < flows:
        raise ValueError(f"median_ratio must be in [1, flows={flows}). "
                         f"Received: {median_ratio!r}")
    low, high = 0.0, 4.0
    for _ in range(20):
        mid = (low + high) / 2
        if statistics.median(message_rate_ratios(mid, flows, seed=seed)) < median_ratio:
            low = mid
        else:
            high = mid
    return (low + high) / 2


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
             seed: int = 0) -> dict:
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
        message's weight is log-normal with this sigma (see ``_Sim``), drawn
        from a generator seeded with ``seed``. In the dedicated layout one
        worker stands for all, so the workers cannot drift apart there.

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
    network = _Network(layout, workers, num_ps, rate)
    sim = _Sim(network.capacity, share_sigma, seed)
    servers = _Servers(sim, network.simulated)
    scale = 1.0 if compute_s is None else compute_s / profile["compute_s"]
    simulated = []
    for index in range(network.simulated):
        s = schedulers_lib.make_scheduler(scheduler, **(scheduler_options or {}))
        dispatch = Dispatch([spec.key for spec in specs], specs, num_ps, s)
        simulated.append(_Worker(sim, profile, dispatch, num_ps, iterations, scale,
                                 latency_ms / 1e3, rpc_overhead_s, network, servers, index,
                                 rpc_per_byte_s))
        sim.at(0.0, simulated[-1].start)
    worker = simulated[0]
    sim.run(until=lambda: all(len(w.starts) > iterations for w in simulated))
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
