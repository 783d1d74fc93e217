"""Schedulers driven by a tiny discrete-event simulator (virtual time, no TF).

The simulator plays synchronous data-parallel training on one worker: in
each iteration every gradient becomes ready at its trace time (all its
partitions at once); the scheduler is asked for blocks after every gradient
and after every finished transfer; each link sends its blocks one after the
other, a block taking latency + bytes / bandwidth; the next iteration starts
a forward pass after the last byte of the previous one is sent.
"""

import collections
import dataclasses
import heapq
import json
import logging
import random
import subprocess
import sys
from pathlib import Path

import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prophet_tf.engine import schedulers
from prophet_tf.engine.schedulers import ReadyItem, urgency

MS = 1_000_000
ROOT = Path(__file__).resolve().parents[2]


# -- the simulator ------------------------------------------------------------------------

@dataclasses.dataclass
class Grad:
    key: int
    priority: int
    parts: list  # [(ps_index, nbytes)], in partition order


class Sim:
    """Drives one scheduler over iterations of {key: ready time relative to backprop start}.

    Args:
      bandwidth: (link, sim) -> bytes per ns of a transfer starting at sim.now.
      on_block: called as on_block(sim, block) when next_block returns a block,
        before the simulator books it (so ``ready_unsent`` and ``inflight`` are
        as the scheduler saw them).
    """

    def __init__(self, sched, grads, bandwidth, latency_ns=0, forward_ns=MS, on_block=None):
        self.sched, self.grads = sched, {g.key: g for g in grads}
        self.bandwidth, self.latency_ns, self.forward_ns = bandwidth, latency_ns, forward_ns
        self.on_block = on_block or (lambda sim, block: None)
        self.now = 0
        self.events = []  # (t, seq, kind, payload)
        self.seq = 0
        self.ready_unsent = collections.defaultdict(set)  # link -> items
        self.inflight = collections.defaultdict(int)  # link -> bytes returned, not yet on_sent
        self.queues = collections.defaultdict(collections.deque)  # link -> waiting blocks
        self.busy = set()
        self.sent = []  # every item of every block, in order
        self.blocks = []  # (now, block)
        self.iteration_end = []

    def push(self, t, kind, payload):
        heapq.heappush(self.events, (t, self.seq, kind, payload))
        self.seq += 1

    def run(self, traces):
        self.traces = traces
        self.unsent_of_iteration = collections.Counter()
        self.start_iteration(0, 0)
        while self.events:
            self.now, _, kind, payload = heapq.heappop(self.events)
            if kind == "ready":
                step, grad = payload
                for p, (link, nbytes) in enumerate(grad.parts):
                    item = ReadyItem(grad.key, p, link, step, grad.priority, nbytes, self.now)
                    self.ready_unsent[link].add(item)
                    self.sched.add(item)
            else:
                self.finish(payload)
            self.drain()
        return self

    def start_iteration(self, step, t0):
        for key, rel in self.traces[step].items():
            grad = self.grads[key]
            self.unsent_of_iteration[step] += len(grad.parts)
            self.push(t0 + rel, "ready", (step, grad))

    def drain(self):
        for _ in range(100_000):
            block = self.sched.next_block(self.now)
            if not block:
                # Work-conserving: no link idles while a ready item waits for it.
                idle = [l for l, items in self.ready_unsent.items()
                        if items and not self.inflight[l]]
                assert not idle, f"link(s) {idle} idle at {self.now} ns while items wait"
                return
            self.on_block(self, block)
            link = block[0].ps_index
            assert all(item.ps_index == link for item in block)
            for item in block:
                self.ready_unsent[link].remove(item)  # KeyError: not ready or sent twice
            self.inflight[link] += sum(item.nbytes for item in block)
            self.blocks.append((self.now, block))
            self.sent.extend(block)
            self.queues[link].append(block)
            if link not in self.busy:
                self.start(link)
        raise AssertionError("next_block never returned []")

    def start(self, link):
        block = self.queues[link].popleft()
        self.busy.add(link)
        nbytes = sum(item.nbytes for item in block)
        end = self.now + self.latency_ns + max(1, round(nbytes / self.bandwidth(link, self)))
        self.push(end, "sent", (link, block, self.now))

    def finish(self, payload):
        link, block, start = payload
        self.busy.discard(link)
        self.inflight[link] -= sum(item.nbytes for item in block)
        self.sched.on_sent(block, start, self.now)
        if self.queues[link]:
            self.start(link)
        step = block[0].iteration
        self.unsent_of_iteration[step] -= len(block)
        if self.unsent_of_iteration[step] == 0:
            self.iteration_end.append(self.now)
            if step + 1 < len(self.traces):
                self.start_iteration(step + 1, self.now + self.forward_ns)


def expected_items(grads, traces):
    return sorted((step, g.key, p) for step, trace in enumerate(traces) for g in grads
                  if g.key in trace for p in range(len(g.parts)))


def fixed(bps, factor=1.0, after=None):
    """bps bytes/ns; times ``factor`` once ``after`` iterations have finished."""
    return lambda link, sim: bps * (factor if after is not None and len(sim.iteration_end) >= after
                                    else 1.0)


# -- synthetic models and traces ----------------------------------------------------------

def bursty_model(num_keys=12, per_burst=3, nbytes=2_000_000, links=1):
    """Keys 0..n-1 (priority = key), backprop from the last; bursts of ``per_burst``."""
    grads = [Grad(k, k, [(k % links, nbytes)]) for k in range(num_keys)]
    backward = list(reversed(range(num_keys)))
    bursts = [backward[i:i + per_burst] for i in range(0, num_keys, per_burst)]
    return grads, bursts


def bursty_traces(bursts, n, gap_ns=10 * MS, jitter_ns=50_000, seed=0, scale=lambda i: 1.0):
    rng = random.Random(seed)
    traces = []
    for i in range(n):
        trace = {}
        for j, keys in enumerate(bursts):
            for q, k in enumerate(keys):
                trace[k] = int(j * gap_ns * scale(i)) + q * 20_000 + rng.randint(0, jitter_ns)
        traces.append(trace)
    return traces


@st.composite
def workloads(draw):
    """A random model (keys, partitions, links), 14 iterations of traces, and a
    link bandwidth that may change after iteration 9."""
    links = draw(st.integers(1, 3))
    n = draw(st.integers(1, 10))
    grads = []
    for k in range(n):
        parts = draw(st.lists(st.tuples(st.integers(0, links - 1), st.integers(1, 3_000_000)),
                              min_size=1, max_size=3))
        grads.append(Grad(k, k, parts))
    mode = draw(st.sampled_from(["bursts", "random", "same"]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = random.Random(seed)
    base = {}
    if mode == "bursts":
        t = 0
        for k in reversed(range(n)):
            t += rng.choice([0, 10_000, 50_000, 5 * MS, 20 * MS])
            base[k] = t
    elif mode == "random":
        base = {k: rng.randint(0, 30 * MS) for k in range(n)}
    else:
        base = {k: 0 for k in range(n)}
    traces = [{k: t + rng.randint(0, 200_000) for k, t in base.items()} for _ in range(14)]
    bw = fixed(draw(st.sampled_from([0.05, 0.3, 1.0, 3.0])),
               draw(st.sampled_from([1.0, 0.4, 2.5])), after=9)
    latency = draw(st.sampled_from([0, 100_000]))
    return grads, traces, bw, latency


ALL = ["fifo", "p3", "bytescheduler", "prophet"]


# -- every byte exactly once --------------------------------------------------------------

@pytest.mark.parametrize("name", ALL)
@settings(max_examples=40, deadline=None)
@given(workload=workloads())
def test_every_partition_sent_exactly_once(name, workload):
    grads, traces, bw, latency = workload
    sched = schedulers.make_scheduler(name)
    sim = Sim(sched, grads, bw, latency_ns=latency).run(traces)
    assert sorted((i.iteration, i.key, i.partition) for i in sim.sent) == expected_items(grads, traces)
    assert len(sim.iteration_end) == len(traces)  # never stalled
    assert sched.pending == 0 and all(v == 0 for v in sim.inflight.values())


# -- the priority rule --------------------------------------------------------------------

def assert_prefix_of_ready(sim, block):
    ready = sorted(sim.ready_unsent[block[0].ps_index], key=urgency)
    assert block == ready[:len(block)], "a less urgent item went before a more urgent ready one"


@pytest.mark.parametrize("name", ["p3", "bytescheduler", "prophet"])
@settings(max_examples=40, deadline=None)
@given(workload=workloads())
def test_every_block_is_the_most_urgent_ready_prefix(name, workload):
    grads, traces, bw, latency = workload
    Sim(schedulers.make_scheduler(name), grads, bw, latency_ns=latency,
        on_block=assert_prefix_of_ready).run(traces)


def test_fifo_sends_each_gradient_per_link_in_readiness_order():
    grads = [Grad(0, 0, [(0, 10), (1, 20), (0, 30)]), Grad(1, 1, [(1, 5)]), Grad(2, 2, [(0, 7)])]
    traces = [{2: 0, 1: MS, 0: 2 * MS}] * 2
    sim = Sim(schedulers.make_scheduler("fifo"), grads, fixed(1e-4)).run(traces)
    got = [(b[0].iteration, b[0].key, b[0].ps_index, [i.partition for i in b]) for _, b in sim.blocks]
    per_iteration = [(2, 0, [0]), (1, 1, [0]), (0, 0, [0, 2]), (0, 1, [1])]
    assert got == [(s, *g) for s in range(2) for g in per_iteration]


def test_fifo_splits_a_gradient_larger_than_the_block_limit():
    sched = schedulers.make_scheduler("fifo")
    limit = schedulers.MAX_BLOCK_BYTES
    for p in range(5):
        sched.add(ReadyItem(0, p, 0, 0, 0, limit // 2, 0))
    blocks = []
    while block := sched.next_block(0):
        blocks.append(block)
    assert [len(b) for b in blocks] == [2, 2]  # the window: two blocks in flight
    sched.on_sent(blocks[0], 0, 1)
    assert [len(b) for b in [sched.next_block(1)]] == [1] and sched.pending == 0


# -- budgets ------------------------------------------------------------------------------

def test_p3_blocks_are_single_slices_two_in_flight():
    sched = schedulers.make_scheduler("p3")
    assert sched.partition_bytes == 200_000
    rng = random.Random(3)
    grads = [Grad(k, k, [(k % 2, rng.randint(1, 200_000)) for _ in range(rng.randint(1, 6))])
             for k in range(20)]
    traces = [{k: (19 - k) * 300_000 for k in range(20)}] * 3

    def check(sim, block):
        assert len(block) == 1 and block[0].nbytes <= 200_000
        assert sum(1 for b in sim.queues[block[0].ps_index]) + (block[0].ps_index in sim.busy) < 2

    sim = Sim(sched, grads, fixed(0.1), on_block=check).run(traces)
    assert len(sim.sent) == sum(len(g.parts) for g in grads) * 3


@pytest.mark.parametrize("credit", [None, 5_000_000, 1])
def test_bytescheduler_respects_its_credit(credit):
    sched = schedulers.make_scheduler("bytescheduler", credit_bytes=credit)
    assert sched.partition_bytes == 4_096_000
    window = credit or 4 * 4_096_000
    rng = random.Random(4)
    grads = [Grad(k, k, [(k % 2, rng.randint(1, 4_096_000)) for _ in range(rng.randint(1, 4))])
             for k in range(25)]
    traces = [{k: (24 - k) * 200_000 for k in range(25)}] * 3
    peak = collections.Counter()

    def check(sim, block):
        link = block[0].ps_index
        assert len(block) == 1
        assert sim.inflight[link] == 0 or sim.inflight[link] + block[0].nbytes <= window
        peak[link] = max(peak[link], sim.inflight[link] + block[0].nbytes)

    Sim(sched, grads, fixed(0.1), on_block=check).run(traces)
    if credit is None:
        assert max(peak.values()) > 4_096_000  # the window is actually used


def current_plan(sched):
    """Prophet's plan in force as the timeline records it (None while first profiling)."""
    plan = sched.plan()
    return plan if plan["version"] else None


def gap_budget(sched, link, now, inflight):
    """Bytes a gap block on ``link`` may carry at ``now`` with ``inflight`` bytes in
    flight, from the published plan; None when no burst of the current iteration
    has arrived, or the last one has."""
    plan = current_plan(sched)
    if plan is None or plan["current"]["final"] or plan["current"]["burst"] < 0:
        return None
    bandwidth = plan["bandwidth_bytes_per_s"].get(str(link))
    if bandwidth is None:
        return None
    return bandwidth / 1e9 * (plan["current"]["deadline_ns"] - now) - inflight


def prophet_budget_checker(records):
    """Checks every Prophet block against the budget it was decided under."""

    def check(sim, block):
        sched, link = sim.sched, block[0].ps_index
        nbytes = sum(i.nbytes for i in block)
        # The window holds this block already; at most two blocks per link.
        assert sched.windows[link].blocks <= 2
        budget = gap_budget(sched, link, sim.now, sim.inflight[link])  # what next_block saw
        if budget is not None:  # a gap block
            plan = current_plan(sched)
            burst = plan["bursts"][plan["current"]["burst"]]
            assert len(block) == 1 or nbytes <= budget
            assert len(block) == 1 or nbytes <= burst["budget_bytes"][str(link)]
            records.append(("gap", len(block), nbytes, budget))
        else:  # by urgency: a partition's worth, two in flight
            assert len(block) == 1 or nbytes <= schedulers.DEFAULT_PARTITION_BYTES
            assert (sim.inflight[link] == 0
                    or sim.inflight[link] + nbytes <= 2 * schedulers.DEFAULT_PARTITION_BYTES)
            records.append(("urgent", len(block), nbytes, None))

    return check


@settings(max_examples=40, deadline=None)
@given(workload=workloads())
def test_prophet_blocks_fit_their_budget(workload):
    grads, traces, bw, latency = workload
    Sim(schedulers.make_scheduler("prophet"), grads, bw, latency_ns=latency,
        on_block=prophet_budget_checker([])).run(traces)


class _ProphetScanningEveryLink(schedulers.SCHEDULERS["prophet"]):
    """Prophet looking at every link at every call: what putting links to sleep
    (until something that can change their answer happens) must not change."""

    def _select(self, now_ns):
        self._active.wake_all()
        return super()._select(now_ns)


@settings(max_examples=60, deadline=None)
@given(workload=workloads())
def test_prophet_skips_only_links_that_cannot_send(workload):
    grads, traces, bw, latency = workload
    runs = [Sim(sched, grads, bw, latency_ns=latency).run(traces).blocks
            for sched in (schedulers.make_scheduler("prophet"), _ProphetScanningEveryLink())]
    assert runs[0] == runs[1]


def test_prophet_plans_the_bursts_and_fills_the_gaps():
    grads, bursts = bursty_model(num_keys=12, per_burst=3, nbytes=200_000)
    traces = bursty_traces(bursts, 12, gap_ns=10 * MS)
    sched = schedulers.make_scheduler("prophet")
    records = []
    sim = Sim(sched, grads, fixed(0.05), on_block=prophet_budget_checker(records)).run(traces)
    plan = current_plan(sched)
    assert [s["keys"] for s in plan["bursts"]] == [sorted(b) for b in bursts]
    assert all(abs(s["gap_ns"] - 10 * MS) < 200_000 for s in plan["bursts"][:-1])
    assert plan["bandwidth_bytes_per_s"]["0"] == pytest.approx(0.05e9)
    # 0.05 bytes/ns x 10 ms = 500 kB per gap: gap blocks fit what is left of it
    # (checked at every block), and no block exceeds BLOCK_BYTES.
    gap_blocks = [r for r in records if r[0] == "gap"]
    assert gap_blocks and all(r[2] <= 500_000 for r in gap_blocks)
    assert max(r[2] for r in records) <= schedulers.ProphetScheduler.BLOCK_BYTES
    assert len(sim.iteration_end) == 12
    json.dumps(sched.plan())
    assert sched.plan()["bursts"][0]["budget_bytes"]["0"] == pytest.approx(500_000, rel=0.03)


def test_prophet_sends_a_single_huge_gradient_alone():
    grads = [Grad(0, 0, [(0, 10**9)])]
    sched = schedulers.make_scheduler("prophet")
    sim = Sim(sched, grads, fixed(1.0)).run([{0: 0}] * 10)
    assert [len(b) for _, b in sim.blocks] == [1] * 10
    assert len(current_plan(sched)["bursts"]) == 1


# -- re-planning --------------------------------------------------------------------------

LOGGER = "prophet_tf.engine.schedulers.prophet"


def test_prophet_replans_when_bandwidth_halves(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    grads, bursts = bursty_model(num_keys=16, per_burst=4, nbytes=1_000_000, links=2)
    traces = bursty_traces(bursts, 30, gap_ns=8 * MS)
    sched = schedulers.make_scheduler("prophet")
    budgets = {}

    def on_block(sim, block):
        if len(sim.iteration_end) < 14 and current_plan(sched):
            budgets["before"] = sched.plan()["bursts"][0]["budget_bytes"]

    Sim(sched, grads, fixed(1.0, 0.5, after=14), on_block=on_block).run(traces)
    plan = current_plan(sched)
    assert plan["reason"].startswith("bandwidth drift")
    for link in (0, 1):
        bandwidth = plan["bandwidth_bytes_per_s"][str(link)] / 1e9
        assert 0.4 < bandwidth < 0.8
        after = plan["bursts"][0]["budget_bytes"][str(link)]
        assert after == pytest.approx(budgets["before"][str(link)] * bandwidth, rel=0.05)
    messages = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert messages[0].startswith("prophet plan 1 (initial profile)")
    assert any("bandwidth drift" in m for m in messages[1:])


def test_prophet_reprofiles_when_compute_time_drifts(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    grads, bursts = bursty_model(num_keys=12, per_burst=3, nbytes=500_000)
    traces = bursty_traces(bursts, 30, gap_ns=10 * MS, scale=lambda i: 1.0 if i < 12 else 1.5)
    sched = schedulers.make_scheduler("prophet")
    Sim(sched, grads, fixed(1.0)).run(traces)
    plan = current_plan(sched)
    assert plan["reason"].startswith("compute drift")
    assert all(abs(s["gap_ns"] - 15 * MS) < 300_000 for s in plan["bursts"][:-1])
    messages = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert [m.split(" (")[0] for m in messages] == ["prophet plan 1", "prophet plan 2"]


def test_prophet_stable_run_keeps_its_first_plan(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    grads, bursts = bursty_model()
    sched = schedulers.make_scheduler("prophet")
    Sim(sched, grads, fixed(0.5), latency_ns=50_000).run(bursty_traces(bursts, 25))
    assert current_plan(sched)["version"] == 1
    assert len([r for r in caplog.records if r.name == LOGGER]) == 1


def test_prophet_flush_releases_held_gradients():
    sched = schedulers.make_scheduler("prophet")
    grads, bursts = bursty_model(num_keys=6, per_burst=2, nbytes=1000)
    Sim(sched, grads, fixed(1.0)).run(bursty_traces(bursts, 8))
    assert current_plan(sched) is not None
    # Iteration 8 starts but only its first burst arrives: while the link is
    # busy, Prophet holds what does not fit the gap (nothing does at a ~0 ms
    # budget after the first); an idle link would take the most urgent.
    now = 10**12
    items = [ReadyItem(k, 0, 0, 8, k, 10**7, now) for k in (5, 4, 3)]
    for item in items:
        sched.add(item)
    sent = []
    while block := sched.next_block(now + 20 * MS):
        sent += block
    assert len(sent) < 3 and sched.pending == 3 - len(sent)
    sched.on_sent(sent, now + 20 * MS, now + 30 * MS)
    sched.flush()
    while block := sched.next_block(now + 30 * MS):
        sent += block
        sched.on_sent(block, now + 30 * MS, now + 40 * MS)
    assert sorted(sent, key=urgency) == sorted(items, key=urgency) and sched.pending == 0


# -- interface, options, validation -------------------------------------------------------

def test_registry_and_partition_sizes():
    from prophet_tf.ps import sharding

    assert list(schedulers.SCHEDULERS) == ALL
    assert schedulers.DEFAULT_PARTITION_BYTES == sharding.DEFAULT_MAX_PARTITION_BYTES
    sizes = {n: schedulers.make_scheduler(n).partition_bytes for n in ALL}
    assert sizes == {"fifo": None, "p3": 200_000, "bytescheduler": 4_096_000, "prophet": None}
    assert schedulers.make_scheduler("p3", slice_bytes=1000).partition_bytes == 1000
    bs = schedulers.make_scheduler("bytescheduler", partition_bytes=1000)
    assert (bs.partition_bytes, bs.credit_bytes) == (1000, 4000)
    prophet = schedulers.make_scheduler("prophet", partition_bytes=65536)
    assert prophet.partition_bytes == 65536
    assert prophet.partition_bytes_for(10**9, 1) == 65536  # the option, whatever the model
    for n in ALL:
        json.dumps(schedulers.make_scheduler(n).plan())


def test_prophet_cuts_a_fortieth_of_each_ps_tasks_share_from_p3s_slice_to_4_mib():
    prophet = schedulers.make_scheduler("prophet")
    mib = 1024 * 1024
    # ResNet-50's 102 MB: 2.56 MB partitions with one PS task, 640 KB with four,
    assert prophet.partition_bytes_for(102_400_000, 1) == 2_560_000
    assert prophet.partition_bytes_for(102_400_000, 4) == 640_000
    # and P3's 200 KB slices from 13 tasks up, as for every small model.
    assert prophet.partition_bytes_for(102_400_000, 13) == 200_000
    assert prophet.partition_bytes_for(6_000_000, 1) == 200_000
    # VGG16's 528 MB over 2 tasks: the default partition size, not 6.6 MB.
    assert prophet.partition_bytes_for(528_000_000, 2) == 4 * mib
    # The others keep their one size whatever the model.
    for name in ("fifo", "p3", "bytescheduler"):
        scheduler = schedulers.make_scheduler(name)
        assert (scheduler.partition_bytes_for(10**9, 1) == scheduler.partition_bytes_for(10, 8)
                == (scheduler.partition_bytes or schedulers.DEFAULT_PARTITION_BYTES))


@pytest.mark.parametrize("options, workers, ps_on_host, blocks", [
    ({}, 2, False, 2), ({}, 15, False, 2), ({}, 16, False, 1), ({}, 128, False, 1),
    ({}, 128, True, 2),  # a PS task on the worker's host: two blocks at any size
    ({"blocks_in_flight": 2}, 128, False, 2),  # the option as given
    ({"blocks_in_flight": 3}, 2, True, 3),
])
def test_prophets_window_is_one_block_from_16_workers_on_hosts_without_a_ps_task(
        options, workers, ps_on_host, blocks):
    """The dispatch sizes the window by the cluster before making it: as many
    blocks start on an idle link as the window holds."""
    from prophet_tf.engine.dispatch import Dispatch
    specs = [types.SimpleNamespace(key=k, shape=[25_000], dtype="float32", priority=k)
             for k in range(20)]
    d = Dispatch(list(range(20)), specs, 1, schedulers.make_scheduler("prophet", **options),
                 num_workers=workers, ps_on_host=ps_on_host)
    assert (d.scheduler.window_blocks, d.scheduler.window_bytes) == (blocks, blocks * 512 * 1024)
    assert d.scheduler.blocks_in_flight == blocks  # what the bench records
    for k in range(20):
        d.add(k, 0, 0)
    assert len(d.next_blocks(0)) == blocks
    assert d.windows[0].blocks == blocks and not d.windows[0].open
    # The other schedulers' windows do not depend on the workers.
    for name in ("fifo", "p3", "bytescheduler"):
        alone, many = schedulers.make_scheduler(name), schedulers.make_scheduler(name)
        many.size_window(workers, ps_on_host)
        assert (alone.window_blocks, alone.window_bytes) == (many.window_blocks,
                                                             many.window_bytes)


@pytest.mark.parametrize("name, options, match", [
    ("nope", {}, r"schedulers: fifo, p3, bytescheduler, prophet\. Received: scheduler='nope'"),
    (None, {}, r"Received: scheduler=None"),
    ("fifo", {"slice_bytes": 1}, r"valid options: none\. Received: slice_bytes=1"),
    ("p3", {"credit_bytes": 1},
     r"valid options: slice_bytes, slices_in_flight\. Received: credit_bytes=1"),
    ("prophet", {"slice_bytes": 1},
     r"valid options: partition_bytes, blocks_in_flight\. Received: slice_bytes=1"),
    ("prophet", {"blocks_in_flight": 0}, r"must be positive\. Received: blocks_in_flight=0"),
    ("p3", {"slices_in_flight": 2.0}, r"must be an int\. Received: slices_in_flight=2\.0"),
    ("prophet", {"partition_bytes": 0}, r"must be positive\. Received: partition_bytes=0"),
    ("p3", {"slice_bytes": 0}, r"must be positive\. Received: slice_bytes=0"),
    ("bytescheduler", {"credit_bytes": -5}, r"must be positive\. Received: credit_bytes=-5"),
    ("bytescheduler", {"partition_bytes": 4.5}, r"must be an int\. Received: partition_bytes=4\.5"),
    ("bytescheduler", {"partition_bytes": "4096"},
     r"must be an int\. Received: partition_bytes='4096'"),
    ("p3", {"slice_bytes": True}, r"must be an int\. Received: slice_bytes=True"),
])
def test_validation_errors(name, options, match):
    with pytest.raises(ValueError, match=match):
        schedulers.validate_scheduler(name, **options)
    with pytest.raises(ValueError, match=match):
        schedulers.make_scheduler(name, **options)


@pytest.mark.parametrize("name, options, blocks, nbytes", [
    ("p3", {}, 2, None),
    ("p3", {"slices_in_flight": 5}, 5, None),
    ("prophet", {}, 2, 2 * 512 * 1024),
    ("prophet", {"blocks_in_flight": 3}, 3, 3 * 512 * 1024),
])
def test_the_window_options_set_what_a_link_has_in_flight(name, options, blocks, nbytes):
    # Items of 100 KB on one link: as many blocks start as the window holds
    # (Prophet before its first plan sends by priority, blocks of <= 512 KiB).
    s = schedulers.make_scheduler(name, **options)
    assert (s.window_blocks, s.window_bytes) == (blocks, nbytes)
    for k in range(40):
        s.add(schedulers.ReadyItem(key=k, partition=0, ps_index=0, iteration=0, priority=k,
                                   nbytes=100_000, ready_ns=0))
    started = []
    while block := s.next_block(0):
        started.append(block)
    assert len(started) == blocks
    assert s.windows[0].blocks == blocks and not s.windows[0].open
    assert s.next_block(0) == []
    if name == "p3":  # the timeline's plan records the window in force
        assert s.plan()["slices_in_flight"] == blocks
    s.on_sent(started[0], 0, 1)  # one finishes: exactly one more may start
    assert len(s.next_block(0)) >= 1 and s.next_block(0) == []


def test_parse_scheduler():
    assert schedulers.parse_scheduler("prophet") == ("prophet", {})
    spec = "bytescheduler:credit_bytes=8_000_000, partition_bytes=0x100"
    assert schedulers.parse_scheduler(spec) == (
        "bytescheduler", {"credit_bytes": 8_000_000, "partition_bytes": 256})
    with pytest.raises(ValueError, match="option=int"):
        schedulers.parse_scheduler("p3:slice_bytes")
    with pytest.raises(ValueError, match="Received: scheduler='p4'"):
        schedulers.parse_scheduler("p4")


def test_scheduler_modules_import_without_tensorflow():
    # Load the two modules without prophet_tf/engine/__init__.py (which loads the engine).
    code = (
        "import sys, types, importlib\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "import prophet_tf\n"
        "pkg = types.ModuleType('prophet_tf.engine')\n"
        f"pkg.__path__ = [{str(ROOT / 'prophet_tf' / 'engine')!r}]\n"
        "sys.modules['prophet_tf.engine'] = pkg\n"
        "importlib.import_module('prophet_tf.engine.schedulers')\n"
        "bad = [m for m in ('tensorflow', 'grpc', 'numpy') if m in sys.modules]\n"
        "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
