"""The simulator drives the engine's own dispatch and schedulers; its limits are the obvious ones."""
import json
import math
import pathlib
import statistics

import pytest

from simulate_helpers import TOY, toy_profile
from prophet_tf.bench import ideal, simulate, simulate_flow_share, simulate_network
from prophet_tf.ps import shaping
from prophet_tf.engine import dispatch, schedulers

NAMES = list(schedulers.SCHEDULERS)



@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", NAMES)
def test_infinite_bandwidth_gives_the_compute_time(name):
    r = simulate.simulate(TOY, name, workers=4, num_ps=2, bandwidth_mbit=None,
                          rpc_overhead_s=0.0)
    assert r["step_time_s"] == pytest.approx(TOY["compute_s"], rel=1e-6)
    assert r["ideal_step_time_s"] == pytest.approx(TOY["compute_s"], rel=1e-6)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", NAMES)
def test_zero_compute_gives_bytes_over_bandwidth(name):
    # One 4 MB variable, W=1, P=1: the push, then the pull of the same bytes.
    nbytes = 4_000_000
    r = simulate.simulate(toy_profile([nbytes], [0.0], [0.0]), name, workers=1, num_ps=1,
                          bandwidth_mbit=80, rpc_overhead_s=0.0, framing=1.0)
    one_way = nbytes * 8 / 80e6
    partition = min(nbytes, schedulers.make_scheduler(name).partition_bytes_for(nbytes, 1))
    # Pipelined by partitions: all bytes one way plus the last partition back.
    assert one_way + partition * 8 / 80e6 - 1e-9 <= r["step_time_s"] <= 2 * one_way + 1e-9
    # The only variable is the first layer: its push and pull, pipelined by
    # partitions as small as wanted, are the critical path.
    assert r["ideal_step_time_s"] == pytest.approx(one_way)


@pytest.mark.timeout(60)
def test_ps_link_is_shared_by_the_workers():
    p = toy_profile([4_000_000], [0.0], [0.0])
    one = simulate.simulate(p, "fifo", 1, 1, 80, rpc_overhead_s=0.0)["step_time_s"]
    four = simulate.simulate(p, "fifo", 4, 1, 80, rpc_overhead_s=0.0)["step_time_s"]
    assert four == pytest.approx(4 * one, rel=1e-6)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", NAMES)
def test_the_engines_scheduler_objects_are_driven(name, monkeypatch):
    made = []
    real = schedulers.make_scheduler

    def spy(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    assert simulate.schedulers_lib is schedulers  # the module the engine imports
    monkeypatch.setattr(schedulers, "make_scheduler", spy)
    r = simulate.simulate(TOY, name, workers=2, num_ps=1, bandwidth_mbit=100)
    assert len(made) == 1 and type(made[0]) is schedulers.SCHEDULERS[name]
    assert r["scheduler_class"] == f"prophet_tf.engine.schedulers.{name}.{type(made[0]).__name__}"
    # Every step's gradients went out (the last step's may still be queued).
    total = sum(v["nbytes"] for v in TOY["variables"])
    assert r["pushed_bytes_per_step"] >= total * (len(r["step_times_s"]) - 1) / len(r["step_times_s"])
    if name == "prophet":
        assert made[0].plan()["version"] >= 1  # it profiled and planned in virtual time


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", NAMES)
def test_the_engines_dispatch_is_driven_and_its_window_holds(name, monkeypatch):
    made, peak = [], {}
    real = dispatch.Dispatch

    class Spy(real):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

        def next_blocks(self, now_ns):
            blocks = super().next_blocks(now_ns)
            for link, window in self.windows.items():
                peak[link] = max(peak.get(link, 0), window.blocks)
            return blocks

    assert simulate.Dispatch is real  # the engine's class, not a copy
    monkeypatch.setattr(simulate, "Dispatch", Spy)
    simulate.simulate(TOY, name, workers=2, num_ps=2, bandwidth_mbit=100)
    assert len(made) == 1 and made[0].scheduler.name == name
    # The one window: two blocks in flight per link, and used to the full.
    assert peak and max(peak.values()) == 2, peak


@pytest.mark.timeout(60)
def test_limited_bandwidth_is_slower_and_never_beats_the_ideal():
    for name in NAMES:
        r = simulate.simulate(TOY, name, workers=8, num_ps=1, bandwidth_mbit=200)
        assert r["step_time_s"] >= r["ideal_step_time_s"] > TOY["compute_s"]


@pytest.mark.timeout(60)
def test_ideal_bound_terms():
    total = sum(v["nbytes"] for v in TOY["variables"])
    b = ideal.ideal_step_time(TOY, workers=2, num_ps=1, bandwidth_mbit=100, latency_ms=1.0,
                              framing=1.0)
    assert b["busiest_link_bytes"] == 2 * total  # one PS link carries both workers
    assert b["busiest_link_s"] == pytest.approx(2 * total * 8 / 100e6)
    # The longest chain is variable 2's: its forward and the next one's, the
    # earliest readiness among variables 0-2, their bytes over the busiest
    # link, a latency each way (variable 3's adds 40 kB but 13 ms less compute).
    assert b["chain_variable"] == 2
    assert b["chain_s"] == pytest.approx(
        0.006 + 0.01 + 2 * (total - 40_000) * 8 / 100e6 + 0.002)
    assert b["ideal_s"] == max(b["compute_s"], b["busiest_link_s"], b["chain_s"])
    # On a real network the headers take their share of the link.
    framed = ideal.ideal_step_time(TOY, workers=2, num_ps=1, bandwidth_mbit=100)
    assert framed["busiest_link_s"] == pytest.approx(b["busiest_link_s"] * 1514 / 1448)
    # Enough PS tasks: each worker's own link is the limit; colocated: each
    # host carries the remote share of its pushes plus its PS's answers.
    assert ideal.ideal_step_time(TOY, 2, 2, 100)["busiest_link_bytes"] == total
    colocated = ideal.ideal_step_time(TOY, 4, 4, 100, layout="colocated")
    assert colocated["busiest_link_bytes"] == pytest.approx(2 * 3 / 4 * total)
    assert ideal.ideal_step_time(TOY, 1, 1, 100, latency_ms=5,
                                 layout="colocated")["ideal_s"] == TOY["compute_s"]
    assert ideal.ideal_step_time(TOY, 2, 1, None)["ideal_s"] == TOY["compute_s"]
    with pytest.raises(ValueError, match="layout.*'ring'"):
        ideal.ideal_step_time(TOY, 2, 1, 100, layout="ring")


@pytest.mark.timeout(60)
def test_ideal_chain_shares_a_longer_forward_out_over_the_variables():
    # The profile's forward (the median total) is twice the per-variable
    # medians' sum: every variable's forward counts double, as in the
    # emulated model, so the forward before variable 2 is 0.08, not 0.04.
    longer = {**TOY, "forward_s": 2 * sum(v["forward_s"] for v in TOY["variables"])}
    total = sum(v["nbytes"] for v in TOY["variables"])
    b = ideal.ideal_step_time(longer, workers=2, num_ps=1, bandwidth_mbit=100,
                              latency_ms=1.0, framing=1.0)
    assert b["chain_variable"] == 2
    assert b["chain_s"] == pytest.approx(
        2 * 0.006 + 0.01 + 2 * (total - 40_000) * 8 / 100e6 + 0.002)


@pytest.mark.timeout(600)
def test_no_simulation_beats_the_ideal_bound():
    """Over models, layouts, worker counts and bandwidths, every scheduler's
    simulated step time is at or above the bound (a bound that is beaten is
    no bound)."""
    profiles = pathlib.Path(simulate.__file__).parent / "profiles"
    cnn = json.loads((profiles / "cnn.json").read_text())
    for profile, compute_s in [(TOY, None), (cnn, 0.04)]:
        for layout, workers, num_ps in [("dedicated", 2, 1), ("dedicated", 2, 2),
                                        ("dedicated", 4, 1), ("colocated", 2, 2),
                                        ("colocated", 3, 3), ("colocated", 2, 4)]:
            for bandwidth in (100, 1000, 10000):
                for name in NAMES:
                    r = simulate.simulate(profile, name, workers, num_ps, bandwidth,
                                          compute_s=compute_s, layout=layout, iterations=12)
                    assert r["step_time_s"] >= r["ideal_step_time_s"] * (1 - 1e-9), (
                        name, layout, workers, num_ps, bandwidth, r["step_time_s"],
                        r["ideal"])


@pytest.mark.timeout(60)
def test_colocated_layout_halves_the_dedicated_ps_links_load():
    # Two workers, one big variable, no compute: a dedicated PS link carries
    # both workers' bytes, a colocated host only the remote half of its pushes
    # plus its PS's answers to the other worker: one worker's link's bytes in
    # an all-reduce.
    p = toy_profile([4_000_000], [0.0], [0.0])
    dedicated = simulate.simulate(p, "p3", 2, 1, 80, rpc_overhead_s=0.0)
    colocated = simulate.simulate(p, "p3", 2, 2, 80, rpc_overhead_s=0.0, layout="colocated")
    assert colocated["step_time_s"] < 0.6 * dedicated["step_time_s"]
    assert colocated["step_time_s"] >= colocated["ideal_step_time_s"] * (1 - 1e-9)
    with pytest.raises(ValueError, match="num_ps=3, workers=2"):
        simulate.simulate(p, "p3", 2, 3, 80, layout="colocated")


@pytest.mark.timeout(60)
def test_pulls_take_each_partition_as_it_is_applied():
    # The first layer's gradient is ready last. With pulls in strict priority
    # order every other parameter would wait behind it; as-applied pulls let
    # the late layer's values come back while backprop still runs.
    p = toy_profile([40_000, 4_000_000], [0.001, 0.001], [0.2, 0.001])
    r = simulate.simulate(p, "p3", 1, 1, 80, rpc_overhead_s=0.0, framing=1.0)
    pull_after_backprop = 0.002 + 0.2 + (40_000 + 4_000_000) * 8 / 80e6
    assert r["step_time_s"] < pull_after_backprop - 0.05
    assert r["step_time_s"] >= r["ideal_step_time_s"] * (1 - 1e-9)


@pytest.mark.timeout(60)
def test_small_partitions_ready_together_ride_in_one_pull_message(monkeypatch):
    # A 400 KB variable then ten of 1 KB, all ready at once: as in the PS,
    # a pull message takes the most urgent ready partition and the next ready
    # ones while they add at most PULL_PACK_BYTES, each message one cost.
    profile = toy_profile([400_000] + [1_000] * 10, [0.001] * 11, [0.0] * 11)
    limit = simulate.PULL_PACK_BYTES
    messages = []
    pull_flow = simulate._Worker._pull_flow

    def record(self, ps, version, left, message, nbytes):
        messages.append((version, [(q.key, q.nbytes) for q in message]))
        return pull_flow(self, ps, version, left, message, nbytes)
    monkeypatch.setattr(simulate._Worker, "_pull_flow", record)

    def per_version(pack_bytes):
        messages.clear()
        monkeypatch.setattr(simulate, "PULL_PACK_BYTES", pack_bytes)
        simulate.simulate(profile, "fifo", 1, 1, 1000, iterations=4, warmup=1)
        out = {}
        for version, parts in messages:
            out.setdefault(version, []).append(parts)
        return out
    for version, sent in per_version(0).items():
        assert sorted(q for parts in sent for q in parts) == [(k, 400_000 if k == 0 else 1_000)
                                                             for k in range(11)]
        assert all(len(parts) == 1 for parts in sent)
    packed = per_version(limit)
    assert all(len(sent) < 11 for sent in packed.values())
    for sent in packed.values():
        assert sorted(k for parts in sent for k, _ in parts) == list(range(11))  # each once
        for parts in sent:  # what rides after a message's first adds at most the limit
            assert sum(n for _, n in parts[1:]) <= limit
            assert [k for k, _ in parts] == sorted(k for k, _ in parts)  # in priority order


@pytest.mark.timeout(60)
@pytest.mark.parametrize("layout, workers, num_ps", [("dedicated", 1, 1), ("colocated", 2, 2)])
def test_pushes_to_one_ps_flow_in_order_on_their_connection(monkeypatch, layout, workers, num_ps):
    # A 2 MB gradient ready first, then small ones: with two blocks in flight
    # per link, small pushes are sent while the large one is on the wire. One
    # connection carries a worker's pushes to a PS, so they arrive after it,
    # in the order sent, never beside it (the bench's timelines show as much).
    profile = toy_profile([1_000] * 4 + [2_000_000], [0.001] * 5,
                          [0.004, 0.003, 0.002, 0.001, 0.0])
    sent, flows = {}, {}
    send, push_bytes, arrived = (simulate._Worker._push_flow, simulate._Worker._push_bytes,
                                 simulate._Worker._arrived_at_ps)

    def record_send(self, block, start, ps, nbytes):
        sent.setdefault((self.index, ps), []).append((id(block), self.sim.now))
        return send(self, block, start, ps, nbytes)

    def record_start(self, block, start, ps, nbytes):
        flows.setdefault((self.index, ps), []).append([id(block), self.sim.now, None])
        return push_bytes(self, block, start, ps, nbytes)

    def record_end(self, block, start, ps):
        (flow,) = [f for f in flows[self.index, ps] if f[0] == id(block) and f[2] is None]
        flow[2] = self.sim.now
        return arrived(self, block, start, ps)
    monkeypatch.setattr(simulate._Worker, "_push_flow", record_send)
    monkeypatch.setattr(simulate._Worker, "_push_bytes", record_start)
    monkeypatch.setattr(simulate._Worker, "_arrived_at_ps", record_end)
    simulate.simulate(profile, "fifo", workers, num_ps, 100, iterations=3, warmup=1,
                      layout=layout, rpc_overhead_s=0.0)
    overtaken = 0
    for connection, started in flows.items():
        order = [b for b, _, _ in started]
        assert order == [b for b, _ in sent[connection]][:len(order)]  # in order sent
        for (_, _, end), (_, start, _) in zip(started, started[1:]):
            assert end is not None and start >= end  # one at a time
        ready = dict(sent[connection])
        overtaken += sum(ready[b] < start for b, start, _ in started)  # waited for the wire
    assert overtaken > 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kwargs, match", [
    (dict(scheduler="nope"), "Unknown scheduler"),
    (dict(workers=0), "workers"),
    (dict(bandwidth_mbit=0), "bandwidth_mbit"),
    (dict(iterations=3), "iterations"),
])
def test_bad_arguments(kwargs, match):
    args = dict(profile=TOY, scheduler="fifo", workers=2, num_ps=1, bandwidth_mbit=100)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        simulate.simulate(**args)


@pytest.mark.timeout(60)
def test_token_bucket_paces_and_rejects_bad_settings(monkeypatch):
    bucket = shaping.TokenBucket(1_000_000, burst_bytes=1)
    delays = [bucket.delay(100_000) for _ in range(5)]  # reserved back to back
    assert delays[-1] == pytest.approx(0.5, abs=0.02)
    monkeypatch.setenv(shaping.SHAPE_ENV, "fast")
    with pytest.raises(ValueError, match="fast"):
        shaping.from_env()
    monkeypatch.setenv(shaping.SHAPE_ENV, "8")
    push, pull = shaping.from_env()
    assert push.rate == pull.rate == 1e6 and push is not pull
    monkeypatch.delenv(shaping.SHAPE_ENV)
    assert shaping.from_env() is None
    assert math.isfinite(bucket.rate)


@pytest.mark.timeout(120)
def test_bytescheduler_tuning_searches_the_grid_and_keeps_the_best():
    from prophet_tf.bench import tuning

    chosen, rows = tuning.tune_bytescheduler(TOY, 4, 1, 200)
    assert len(rows) == len(tuning.PARTITION_BYTES) * len(tuning.CREDIT_PARTITIONS)
    assert {(r["partition_bytes"], r["credit_bytes"] // r["partition_bytes"]) for r in rows} == {
        (p, c) for p in tuning.PARTITION_BYTES for c in tuning.CREDIT_PARTITIONS}
    fastest = min(r["predicted_step_time_s"] for r in rows)
    row = next(r for r in rows if (r["partition_bytes"], r["credit_bytes"]) ==
               (chosen["partition_bytes"], chosen["credit_bytes"]))
    assert row["predicted_step_time_s"] <= fastest * (1 + tuning.TOLERANCE)
    # The choice is what it claims: simulated again, the same step time.
    again = simulate.simulate(TOY, "bytescheduler", 4, 1, 200, scheduler_options=chosen)
    assert again["step_time_s"] == pytest.approx(row["predicted_step_time_s"])
    # On this model ByteScheduler's defaults (4 MB, 16 MB credit) send in
    # readiness order: the tuned setting is faster.
    default = simulate.simulate(TOY, "bytescheduler", 4, 1, 200)["step_time_s"]
    assert row["predicted_step_time_s"] < default


@pytest.mark.timeout(60)
def test_per_message_and_per_byte_costs_are_paid_by_every_message():
    # One variable, one partition, unlimited links: a push and a pull, each
    # paying overhead + bytes x per_byte, in series after the compute.
    nbytes = 400_000
    profile = toy_profile([nbytes], [0.0], [0.0])
    r = simulate.simulate(profile, "fifo", workers=1, num_ps=1, bandwidth_mbit=None,
                          rpc_overhead_s=0.002, rpc_per_byte_s=1e-8)
    assert r["step_time_s"] == pytest.approx(2 * (0.002 + nbytes * 1e-8))
    free = simulate.simulate(profile, "fifo", workers=1, num_ps=1, bandwidth_mbit=None,
                             rpc_overhead_s=0.002)
    assert free["step_time_s"] == pytest.approx(2 * 0.002)


def test_scheduler_specs_split_as_the_bench_reads_them():
    assert schedulers.split_specs("fifo, prophet:partition_bytes=100000,blocks_in_flight=4,p3") == [
        "fifo", "prophet:partition_bytes=100000,blocks_in_flight=4", "p3"]
    assert schedulers.split_specs("") == []


@pytest.mark.timeout(120)
def test_simulate_cli_takes_scheduler_options(tmp_path, capsys):
    """`prophet-tf simulate` runs a scheduler with the options the bench takes,
    names the row by its spec, and refuses a bad option before simulating."""
    from prophet_tf.bench import simulate_cli
    out = tmp_path / "sim.json"
    specs = "p3,p3:slice_bytes=4000000"
    assert simulate_cli.main(["--model", "cnn", "--workers", "2", "--ps", "1",
                              "--layout", "dedicated", "--bandwidth-mbit", "200",
                              "--schedulers", specs, "--json", str(out)]) == 0
    rows = {r["scheduler"]: r for r in json.loads(out.read_text())["results"]}
    assert list(rows) == ["p3", "p3:slice_bytes=4000000"]
    # One PS: the 4 MiB dense kernel goes whole, and its pull cannot start
    # before all of its push has arrived (0.73 s against 0.42 s).
    assert rows["p3:slice_bytes=4000000"]["step_time_s"] > 1.3 * rows["p3"]["step_time_s"]
    assert simulate_cli.main(["--model", "cnn", "--schedulers", "p3:bogus=1"]) == 2
    assert "Unknown option for scheduler 'p3'" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_validate_simulates_each_run_with_the_options_it_ran():
    """`simulate --validate` predicts every PS scheduler of a bench JSON, also
    those run with options (p3:slices_in_flight=20), with those options."""
    from prophet_tf.bench import simulate_cli
    root = pathlib.Path(__file__).resolve().parents[2]
    bench = json.loads((root / "benchmarks" / "window-cnn-emulated.json").read_text())
    rows = {r["scheduler"]: r for r in simulate_cli.validate(bench, None)}
    assert list(rows) == [r["scheduler"] for r in bench["results"]] == [
        "p3", "p3:slices_in_flight=20", "prophet", "prophet:blocks_in_flight=8"]
    # Its window of 20 slices, not p3's default 2, was simulated.
    assert rows["p3:slices_in_flight=20"]["predicted_s"] != rows["p3"]["predicted_s"]
    assert rows["prophet:blocks_in_flight=8"]["predicted_s"] != rows["prophet"]["predicted_s"]


@pytest.mark.timeout(120)
def test_validate_keeps_recorded_costs_where_the_timeline_dir_has_no_runs(tmp_path):
    """A suite resumed with another --timeline-dir: the cells whose timelines
    are not there are simulated with the message costs their JSON recorded,
    not with the default overhead."""
    from prophet_tf.bench import simulate_cli
    root = pathlib.Path(__file__).resolve().parents[2]
    bench = json.loads((root / "benchmarks" / "window-cnn-emulated.json").read_text())
    recorded = simulate_cli.validate(bench, None)
    empty = simulate_cli.validate(bench, None, timeline_dir=str(tmp_path))
    assert [r["message_costs"] for r in empty] == [r["message_costs"] for r in recorded]
    assert [r["predicted_s"] for r in empty] == [r["predicted_s"] for r in recorded]
    assert all(r["message_costs"]["messages"] > 0 for r in recorded)


@pytest.mark.timeout(60)
def test_uneven_sharing_keeps_the_links_full_and_shares_them_by_weight():
    """With weights a link is still filled (each flow at its weight's part of
    it); with share_sigma 0 every message runs at the fair share, and the
    larger the sigma, the more messages run faster than it while others wait."""
    sim = simulate_network.FluidSim({"a": 100.0, "b": 30.0}, share_sigma=1.0, seed=3)
    done = []
    for links in [("a",), ("a",), ("a", "b")]:
        sim.start_flow(1e6, links, lambda: done.append(1))
    rates = [f.rate for f in sim.flows]
    weights = [f.weight for f in sim.flows]
    assert len(set(weights)) == 3  # drawn, not all 1
    assert sum(rates) == pytest.approx(100.0)  # link a full
    assert rates[2] <= 30.0 + 1e-9  # link b caps the third flow
    assert rates[0] / rates[1] == pytest.approx(weights[0] / weights[1])
    even = simulate_flow_share.message_rate_ratios(0.0, 3, messages=300)
    assert even == pytest.approx([1.0] * len(even))
    medians = [statistics.median(simulate_flow_share.message_rate_ratios(s, 3, messages=600))
               for s in (0.5, 1.0, 2.0)]
    assert 1.0 < medians[0] < medians[1] < medians[2] < 3.0


@pytest.mark.timeout(120)
def test_share_sigma_is_fitted_to_a_median_and_seeds_repeat():
    sigma = simulate_flow_share.fit_share_sigma(1.5, 3)
    assert 0.5 < sigma < 2.0
    fitted = simulate_flow_share.message_rate_ratios(sigma, 3)
    assert statistics.median(fitted) == pytest.approx(1.5, rel=0.03)
    with pytest.raises(ValueError, match="Received: 3.5"):
        simulate_flow_share.fit_share_sigma(3.5, 3)
    with pytest.raises(ValueError, match="share_sigma=-1"):
        simulate.simulate(TOY, "fifo", 2, 2, 100, layout="colocated", share_sigma=-1)
    runs = [simulate.simulate(TOY, "p3", 2, 2, 100, layout="colocated", share_sigma=1.0,
                              seed=seed)["step_times_s"] for seed in (0, 0, 1)]
    assert runs[0] == runs[1] and runs[0] != runs[2]
    even = simulate.simulate(TOY, "p3", 2, 2, 100, layout="colocated")
    assert even == simulate.simulate(TOY, "p3", 2, 2, 100, layout="colocated", share_sigma=0.0,
                                     seed=5)
    # Even sharing keeps the two hosts in step (within the PS tasks' imbalance);
    # uneven sharing puts them apart.
    uneven = simulate.simulate(TOY, "p3", 2, 2, 100, layout="colocated", share_sigma=1.0)
    assert len(even["phase_spread_s"]) == len(even["step_times_s"]) + 1
    assert max(uneven["phase_spread_s"]) > 10 * max(even["phase_spread_s"])


@pytest.mark.timeout(300)
def test_validate_with_flow_shares_uses_the_sigma_of_the_nearest_rate_and_connections():
    from prophet_tf.bench import simulate_cli
    slow = {"link_mbit": 125, "by_connections": {"2": {"share_sigma": 0.4},
                                                  "6": {"share_sigma": 1.5}}}
    fast = {"link_mbit": 250, "by_connections": {"2": {"share_sigma": 0.1}}}
    assert simulate_cli.uplink_connections(4, 4, "colocated") == 6
    assert simulate_cli.uplink_connections(2, 2, "colocated") == 2
    assert simulate_cli.uplink_connections(16, 4, "dedicated") == 16
    assert simulate_cli.share_sigma_for([slow, fast], 125, 6) == 1.5
    assert simulate_cli.share_sigma_for([slow, fast], 100, 3) == 0.4  # nearer 2 than 6
    assert simulate_cli.share_sigma_for([slow, fast], 300, 6) == 0.1  # the 250 Mbit/s one
    assert simulate_cli.share_sigma_for(None, 125, 6) == 0.0
    root = pathlib.Path(__file__).resolve().parents[2]
    bench = json.loads((root / "benchmarks" / "window-cnn-emulated.json").read_text())
    even = simulate_cli.validate(bench, None)
    uneven = simulate_cli.validate(bench, None, flow_shares=[slow], seeds=3)
    sigma = simulate_cli.share_sigma_for([slow], None, simulate_cli.uplink_connections(
        bench["config"]["workers"], bench["config"]["ps"], bench["config"]["layout"]))
    for e, u in zip(even, uneven):
        assert e["share_sigma"] == 0.0 and e["predicted_range_s"][0] == e["predicted_s"]
        assert u["share_sigma"] == sigma > 0
        low, high = u["predicted_range_s"]
        assert low <= u["predicted_s"] <= high and low < high
    with pytest.raises(ValueError, match="seeds must be"):
        simulate_cli.validate(bench, None, flow_shares=[slow], seeds=0)


@pytest.mark.timeout(120)
def test_held_out_validation_charges_the_costs_fitted_on_other_runs(tmp_path, capsys):
    """`--validate RUNS --costs-from OTHERS`: every message costs what the other runs
    measured (their median), never what the predicted run measured; a run cannot be in
    both, and a fit of another cluster shape is refused with both shapes named."""
    from prophet_tf.bench import simulate_cli
    bench_dir = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
    fit_path, run_path = bench_dir / "ordered-sums-1-before.json", bench_dir / "ordered-sums-2-after.json"
    fit, run = json.loads(fit_path.read_text()), json.loads(run_path.read_text())
    fitted = simulate_cli.fit_costs([fit])
    held_out = {r["scheduler"]: r for r in simulate_cli.validate(run, None, fitted=fitted)}
    in_sample = {r["scheduler"]: r for r in simulate_cli.validate(run, None)}
    measured = {r["scheduler"]: r["message_costs"] for r in run["results"]}
    # tf-mwms sends no PS messages: the ring model, whose one fitted number is
    # of other runs (simulate_ring.FITTED_ON).
    ring = held_out.pop("tf-mwms")
    assert ring["costs"] == "ring" and ring["message_costs"] is None
    for name, row in held_out.items():
        assert row["costs"] == "held-out" and in_sample[name]["costs"] == "in-sample"
        assert row["message_costs"] == fitted.by_scheduler[name] != measured[name]
        assert in_sample[name]["message_costs"] == measured[name]
    assert set(held_out) == {"fifo", "p3", "bytescheduler", "prophet"}

    out = tmp_path / "v.json"
    assert simulate_cli.main(["--validate", f"{run_path},{bench_dir / 'ordered-sums-3-after.json'}",
                              "--costs-from", str(fit_path), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["costs_from"] == ["ordered-sums-1-before.json"]
    assert [r["run"] for r in result["validation"]] == \
        ["ordered-sums-2-after.json"] * 5 + ["ordered-sums-3-after.json"] * 5
    assert "profile" not in result["bench_config"]
    capsys.readouterr()

    assert simulate_cli.main(["--validate", str(run_path), "--costs-from", str(run_path)]) == 2
    assert "cannot be predicted with costs fitted on itself" in capsys.readouterr().err
    other_shape = bench_dir / "bench-colocated-w3.json"
    assert simulate_cli.main(["--validate", str(run_path), "--costs-from", str(other_shape)]) == 2
    err = capsys.readouterr().err
    assert "'workers': 3" in err and "'workers': 2" in err, err
    assert simulate_cli.main(["--costs-from", str(fit_path)]) == 2
    assert "--costs-from is for --validate" in capsys.readouterr().err


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", NAMES)
def test_flow_classes_and_lazy_rates_give_the_straightforward_paths_results(name, monkeypatch):
    """The network's shortcuts (flows of one path share a class; rates are
    recomputed once per instant, not at every flow's start and end) do the
    same float operations in the same order as recomputing every flow's rate
    at every change: the results are identical to the last bit, also with
    uneven sharing, where every flow is a class of its own. (Without a rate
    lag: the straightforward path follows every change at once.)"""
    cases = [dict(workers=3, num_ps=3, bandwidth_mbit=100, layout="colocated"),
             dict(workers=4, num_ps=8, bandwidth_mbit=300, layout="colocated", latency_ms=0.5),
             dict(workers=4, num_ps=2, bandwidth_mbit=100, layout="dedicated"),
             dict(workers=3, num_ps=3, bandwidth_mbit=100, layout="colocated", share_sigma=1.0)]
    cases = [dict(case, rate_lag_s=0.0) for case in cases]
    fast = [simulate.simulate(TOY, name, **case) for case in cases]
    grouped = []
    real = simulate_network.FluidSim

    class Straightforward(real):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, classes=False, **kwargs)
            grouped.append(self)

    monkeypatch.setattr(simulate_network, "FluidSim", Straightforward)
    slow = [simulate.simulate(TOY, name, **case) for case in cases]
    assert len(grouped) == len(cases)
    for a, b in zip(fast, slow):
        assert a["step_times_s"] == b["step_times_s"] and a["step_time_s"] > TOY["compute_s"]
        assert a["phase_spread_s"] == b["phase_spread_s"]
        assert a["pushed_bytes_per_step"] == b["pushed_bytes_per_step"]


@pytest.mark.timeout(60)
def test_a_class_of_flows_gets_the_rates_of_its_flows_one_by_one():
    """Flows of one path form one class; their rates, and which flows end
    when, are those of the flows computed one by one."""
    capacity = {("w", h, d): 1000.0 for h in range(3) for d in ("up", "down")}
    capacity["slow"] = 150.0
    paths = [(("w", 0, "up"), ("w", 1, "down")), (("w", 0, "up"), ("w", 1, "down")),
             (("w", 0, "up"), ("w", 2, "down")), (("w", 1, "up"), ("w", 2, "down")),
             (("w", 2, "up"), "slow"), (("w", 0, "up"), ("w", 1, "down"))]
    runs = []
    for classes in (True, False):
        sim = simulate_network.FluidSim(capacity, classes=classes)
        ended, rates = [], []

        def start(i, path):
            sim.start_flow(100.0 * (i + 1), path, lambda: ended.append((i, sim.now)))
            rates.append([f.rate for f in sim.flows])
        for i, path in enumerate(paths):
            sim.at(0.001 * i, lambda i=i, path=path: start(i, path))
        sim.run(until=lambda: len(ended) == len(paths))
        runs.append((rates, ended))
    assert runs[0] == runs[1]
    rates = runs[0][0][-1]  # once every flow started
    # Flows 0, 1 and 5 share a path: one rate.
    assert len(rates) == len(paths) and rates[0] == rates[1] == rates[5]
    assert sorted(i for i, _ in runs[0][1]) == list(range(len(paths)))


@pytest.mark.timeout(60)
def test_answers_first_holds_pushes_to_another_host_while_the_local_ps_owes(monkeypatch):
    """The engine's answers first, colocated: a block of step s goes to another host's PS
    only once this host's PS owes the other workers nothing of version s or older.
    Without it the default bench's workers (the shipped CNN profile, 2 hosts, 200
    Mbit/s, FIFO) settle more than a quarter of a step apart, which the bench does not show."""
    from prophet_tf.bench import saved_profiles
    profile = saved_profiles.load_profile("cnn")
    run = dict(scheduler="fifo", workers=2, num_ps=2, bandwidth_mbit=200.0,
               layout="colocated", rpc_overhead_s=0.0018, rpc_per_byte_s=1.7e-9)
    off = simulate.simulate(profile, answers_first=False, **run)
    sends, held = [], []
    send = simulate._Worker._send

    def recording_send(worker, block):
        ps, step = block[0].ps_index, min(item.iteration for item in block)
        remote = ps not in worker.local_ps
        first = remote and step > worker.cleared
        owed = worker.servers.owed(worker.local_ps, step, worker.other_workers)
        pushed = worker.pushed_bytes
        send(worker, block)
        if worker.pushed_bytes > pushed:
            sends.append((remote, first, owed))
        elif first:
            held.append(owed)

    monkeypatch.setattr(simulate._Worker, "_send", recording_send)
    on = simulate.simulate(profile, **run)
    assert held and all(owed > 0 for owed in held)  # it held pushes, while owing
    assert all(owed == 0 for remote, first, owed in sends if first)  # and only then
    assert sum(remote for remote, _, _ in sends) > 0
    spread_on, spread_off = (max(r["phase_spread_s"][simulate.WARMUP_ITERATIONS:])
                             for r in (on, off))
    assert spread_off > off["step_time_s"] / 4 and spread_on < spread_off
    assert on["step_time_s"] < off["step_time_s"]
    # Dedicated PS hosts share no host with a worker: nothing to hold.
    dedicated = dict(run, layout="dedicated", num_ps=1)
    assert simulate.simulate(profile, **dedicated) == simulate.simulate(
        profile, answers_first=False, **dedicated)


@pytest.mark.timeout(60)
def test_rate_lag_recomputes_the_shares_late_and_never_overfills_a_link():
    """With a rate lag, a change recomputes the max-min rates at once if they
    are at least that old, else that long after they were computed; until
    then the other flows keep their rates and a new flow takes what its links
    have spare, so no link ever carries more than its capacity."""
    sim = simulate_network.FluidSim({"a": 100.0, "b": 100.0}, rate_lag_s=0.5)
    ended, loads = {}, []

    def record():
        load = {}
        for f in sim.flows:
            for link in f.links:
                load[link] = load.get(link, 0.0) + f.rate
        loads.append(load)

    def start(name, nbytes, links):
        sim.start_flow(nbytes, links, lambda: (ended.setdefault(name, sim.now), record()))
        record()
    # x alone on a gets all of it at once (no rates computed yet).
    sim.at(0.0, lambda: start("x", 100.0, ("a",)))
    # y joins at 0.1: a has nothing spare, so y waits for the rates of 0.5
    # (x 50 and y 50), x having sent 50 by then: x ends at 1.5. Then the rates
    # are 0.5 old: y gets all of a at once and ends at 2.0.
    sim.at(0.1, lambda: start("y", 100.0, ("a",)))
    # b is idle: z takes all of it at once.
    sim.at(0.2, lambda: start("z", 10.0, ("b",)))
    # p and q share a from 3.0; p ends at 3.2 and its half of a is spare until
    # the rates of 3.5: r takes it at 3.3 (and keeps it then), so r ends at
    # 3.7; q sends at 50 until the rates of 4.0, then at 100.
    sim.at(3.0, lambda: (start("p", 10.0, ("a",)), start("q", 100.0, ("a",))))
    sim.at(3.3, lambda: start("r", 20.0, ("a",)))
    sim.run(until=lambda: len(ended) == 6)
    assert ended == pytest.approx({"x": 1.5, "y": 2.0, "z": 0.3, "p": 3.2, "r": 3.7, "q": 4.5})
    assert all(rate <= 100.0 + 1e-9 for load in loads for rate in load.values())
    assert any(load.get("a") == 50.0 for load in loads)  # a idled at half, as lagged
    with pytest.raises(ValueError, match="rate_lag_s=-1"):
        simulate_network.FluidSim({"a": 1.0}, rate_lag_s=-1)
    with pytest.raises(ValueError, match="straightforward"):
        simulate_network.FluidSim({"a": 1.0}, classes=False, rate_lag_s=0.1)


@pytest.mark.timeout(120)
def test_the_default_rate_lag_predicts_as_following_every_change():
    """The default rate lag moves a prediction by well under 1% on a shared
    network, never below the bound, and the collector is on again after."""
    import gc
    for case in [dict(workers=3, num_ps=3, bandwidth_mbit=100, layout="colocated"),
                 dict(workers=4, num_ps=8, bandwidth_mbit=300, layout="colocated",
                      latency_ms=0.5)]:
        for name in NAMES:
            lagged = simulate.simulate(TOY, name, **case)
            exact = simulate.simulate(TOY, name, rate_lag_s=0.0, **case)
            assert lagged["step_time_s"] == pytest.approx(exact["step_time_s"], rel=0.01)
            assert lagged["step_time_s"] >= lagged["ideal_step_time_s"] * (1 - 1e-9)
            assert gc.isenabled()


@pytest.mark.timeout(60)
def test_link_levels_give_the_max_min_rates_of_the_class_by_class_filling():
    """With a rate lag the rates are filled link by link (a round per level);
    they are those of the class-by-class filling, to float rounding, also with
    weights, one-link paths and links that limit nothing."""
    import random as random_lib
    rng = random_lib.Random(4)
    for weighted in (False, True):
        hosts = 6
        capacity = {("w", h, d): rng.choice([100.0, 250.0]) for h in range(hosts)
                    for d in ("up", "down")}
        capacity["free"] = math.inf
        paths = [(("w", s, "up"), ("w", r, "down")) for s in range(hosts) for r in range(hosts)
                 if s != r and rng.random() < 0.7]
        paths += [(("w", 0, "up"),), (("w", 1, "down"), "free")]
        runs = []
        for lag in (0.0, 1.0):
            sim = simulate_network.FluidSim(capacity, share_sigma=0.5 if weighted else 0.0,
                                            seed=1, rate_lag_s=lag)
            for i, path in enumerate(paths * 2):
                sim.start_flow(1e6, path, lambda: None)
            if lag:
                sim._refill()  # the rates of all of them, as of now
            runs.append([(f.links, f.rate) for f in sim.flows])
        exact, lagged = runs
        assert [links for links, _ in exact] == [links for links, _ in lagged]
        assert [r for _, r in lagged] == pytest.approx([r for _, r in exact], rel=1e-9)
    with pytest.raises(ValueError, match="at most two links"):
        simulate_network.FluidSim({"a": 1.0, "b": 1.0, "c": 1.0}, rate_lag_s=0.1).start_flow(
            1.0, ("a", "b", "c"), lambda: None)
