"""`prophet-tf bench` end to end: a short run of two schedulers on a shaped network.

How busy the links were and how long a step took are measurements, which
the bench reports (its table and JSON; benchmarks/link_rate.py for a link
alone); they move with the machine's load, so this test does not bound
them. It checks what they are made of instead: the bytes each link had to
carry, the time the shaper needs for them at least, and that the loads
through the step add up to the bytes the interface counted.
"""
import json
import statistics

import pytest

from cluster import child_env, run_prophet
from prophet_tf.bench import breakdown, ideal, link_load, netns, phases, runner

BANDWIDTH_MBIT = 100.0
WARMUP = 2  # of the smoke run's 9 steps: the analyses measure steps 2 to 7


def check_breakdown(directory, record, result):
    """The timeline analyses (prophet_tf/bench/breakdown.py) on a real run."""
    directory = str(directory)
    config = result["config"]
    times = breakdown.breakdown(directory, warmup=WARMUP)
    assert 0 <= times["push_busy_in_backward"] <= 1
    assert 0 < times["first_pull_ms"] <= times["last_pull_ms"], times
    (median, low, high), = phases.phase_offsets(directory, warmup=WARMUP).values()
    assert low <= median <= high
    modes = phases.phase_modes(directory, warmup=WARMUP)
    assert modes["together"]["steps"] + modes["apart"]["steps"] == 8 - WARMUP, modes
    tails = breakdown.answer_tails(directory, warmup=WARMUP)
    assert [r["step"] for r in tails] == list(range(WARMUP, 8))
    assert all(r["spread_ms"] >= 0 and r["laggard_ps"] in (0, 1) and len(r["last_in_ms"]) == 2
               for r in tails)
    # Host h's uplink carries its worker's pushes to the other PS task and its
    # PS task's answers to the other worker: both are one PS task's share.
    rows = breakdown.uplinks(directory, warmup=WARMUP)
    assert [r["step"] for r in rows] == list(range(WARMUP, 8))
    for r in rows:
        a, b = r["hosts"]
        assert a["push_mb"] == pytest.approx(b["answer_mb"])
        assert b["push_mb"] == pytest.approx(a["answer_mb"])
        assert a["push_mb"] + b["push_mb"] == pytest.approx(config["model_bytes"] / 1e6)
        assert r["push_end_spread_s"] == pytest.approx(abs(a["push_end_s"] - b["push_end_s"]))
    # Each answer the PS trace has of a measured version is matched to its pull,
    # in stream order and by variable, for the worker on its host and the other.
    leads = breakdown.answer_leads(directory, warmup=WARMUP)
    assert leads["unmatched"] == 0
    assert leads["same_host"]["count"] > 0 and leads["other_host"]["count"] > 0, leads
    events = breakdown.step_events(directory, warmup=WARMUP)
    if not record["payload_bytes_per_s"]:
        assert events is None  # no shaped link: no link load to place events beside
        return
    check_the_shaper_held_the_exchange(rows)
    at = events["events"]
    assert set(at) == set(breakdown.STEP_EVENTS)
    for name, (low, high) in events["events_range"].items():
        assert low <= at[name] <= high, name
    # What causality orders (one monotonic clock on this machine): a sum is
    # complete before the push's reply arrives, applied before it is answered,
    # handed to gRPC before it arrives; a step's gradients end it.
    slack = 0.02
    assert at["first layer's sum complete (PS)"] <= at["first layer's pushes all in"] + slack
    assert at["first layer's sum complete (PS)"] <= at["first layer's parameter in"] + slack
    assert at["last sum complete (PS)"] <= at["every worker's last push"] + slack
    assert at["last answer handed to gRPC (PS)"] <= at["last answer in"] + slack
    assert at["first gradient ready"] <= at["last gradient ready"] <= 1 + slack
    # The load per tenth of the step, averaged over the hosts: the tenths
    # share out each step's counted bytes, none lost or counted twice.
    for side, load in events["link_load"].items():
        assert len(load) == 10 and all(x >= 0 for x in load), events["link_load"]
        per_host = [mean_step_load(record, h, side, WARMUP) for h in sorted(record["host_worker"])]
        assert statistics.fmean(load) == pytest.approx(statistics.fmean(per_host)), side


def check_the_shaper_held_the_exchange(rows):
    """The network is really shaped: every byte a host receives leaves the
    token bucket at its link's bridge end, which passes at most its rate
    times a span plus its burst in any span. In each measured step a host
    receives the other host's pushes to its PS task and the other PS task's
    answers to its worker; they began after the step's first gradient and
    had arrived when they ended (the timelines), so their bytes bound from
    below the span they crossed in. Unshaped, the span is about a third of
    that bound. No load of the machine can break the bound: load only makes
    the exchange slower."""
    wire_bytes_per_s = BANDWIDTH_MBIT * 1e6 / 8
    burst, _ = netns._tbf_sizes(BANDWIDTH_MBIT * 1e6)
    begin = min(r["start_s"] for r in rows)
    end = max(r["start_s"] + max(max(x["push_end_s"], x["answer_end_s"]) for x in r["hosts"])
              for r in rows)
    for h in (0, 1):
        # Two hosts: what host h receives is what the other host's uplink carried.
        received = sum(r["hosts"][1 - h]["push_mb"] + r["hosts"][1 - h]["answer_mb"]
                       for r in rows) * 1e6
        assert (end - begin) * wire_bytes_per_s + burst >= received, (h, end - begin, received)


def mean_step_load(record, host, side, warmup):
    """From run.json's raw counters, independently of link_load.link_phases:
    over the host's worker's steps after ``warmup``, the bytes its interface
    counted in ``side`` ("sent" or "received") in each step over what the
    link's payload rate carries in that step, averaged over the steps."""
    counter = link_load.Counter(record["link_bytes"], host, dict(link_load.SIDES)[side])
    ends = link_load.step_ends(record["workers"][record["host_worker"].get(host, 0)])
    loads = []
    for begin, end in zip(ends[warmup:], ends[warmup + 1:]):
        a, b = counter.at(begin), counter.at(end)
        if a is not None and b is not None:
            loads.append((b - a) / ((end - begin) * record["payload_bytes_per_s"]))
    return statistics.fmean(loads)


@pytest.mark.timeout(420)
def test_short_bench_writes_complete_json_and_the_network_is_really_shaped(tmp_path):
    before = set(netns.list_ours()) if netns.available()[0] else set()
    out = tmp_path / "bench.json"
    proc = run_prophet(
        "bench", "--model", "cnn", "--workers", "2",
        "--bandwidth-mbit", str(BANDWIDTH_MBIT), "--steps", "9", "--reps", "1",
        "--compute-reps", "0", "--schedulers", "fifo,prophet", "--json", str(out),
        "--timeline-dir", str(tmp_path / "timelines"), env=child_env(), cwd=tmp_path,
        timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    config = result["config"]
    for key in ("model", "workers", "ps", "layout", "bandwidth_mbit", "latency_ms", "steps",
                "reps", "warmup_steps", "global_batch", "shaping", "compute_s", "ideal",
                "scheduler_settings"):
        assert key in config, key
    # The default layout: a PS task on each worker host.
    assert config["layout"] == "colocated" and config["ideal"]["layout"] == "colocated"
    assert config["workers"] == 2 and config["ps"] == 2 and config["warmup_steps"] == 8
    # What each scheduler ran with: the partition size both PS tasks were
    # declared, and the partitions cut (the 4 MiB dense kernel over both).
    settings = config["scheduler_settings"]
    assert sorted(settings) == ["fifo", "prophet"]
    assert settings["prophet"]["window_blocks"] == 2
    assert settings["fifo"]["partition_bytes"] == 4 * 1024 * 1024
    assert settings["fifo"]["largest_partition_bytes"] < config["model_bytes"] / 2
    assert [r["scheduler"] for r in result["results"]] == ["fifo", "prophet"]
    # Bytes each step must cross the busiest shaped link, one direction.
    if config["shaping"] == "netns":
        nbytes = config["ideal"]["busiest_link_bytes"]
    else:  # the transport's token bucket limits each worker's own connection
        nbytes = config["model_bytes"]
    floor = nbytes * 8 / (BANDWIDTH_MBIT * 1e6)
    for r in result["results"]:
        assert r["step_time_s"] > 0 and len(r["step_time_s_all"]) == 1
        assert r["samples_per_s"] == pytest.approx(config["global_batch"] / r["step_time_s"])
        assert r["ideal_step_time_s"] >= floor * 0.999
        if config["shaping"] == "netns":
            # Each host's link, each way, over the measured steps, and per
            # tenth of the step: loads, which add up to the counted bytes
            # (checked beside the run's record below). Their values are
            # measurements: over a tenth of a step, shorter than the
            # counters' sampling period, the shaper's burst alone can lift
            # one above the rate (a tenth read 1.108 with nothing wrong).
            loads = r["link_load"]
            assert sorted(loads) == ["received", "sent"]
            assert all(len(side) == 2 and all(v >= 0 for v in side)
                       for side in loads.values()), loads
            assert link_load.busiest_load(loads) > 0, loads
            phases = r["link_phases"]
            assert sorted(phases) == ["received", "sent"]
            assert all(len(h) == link_load.PHASE_BINS and all(v >= 0 for v in h)
                       for side in phases.values() for h in side), phases
    # Beside each run's timelines, what places its events in its steps.
    records = sorted((tmp_path / "timelines").glob("*/run.json"))
    assert [p.parent.name.split("-")[0] for p in records] == ["fifo", "prophet"]
    for path, r in zip(records, result["results"]):
        record = json.loads(path.read_text())
        assert [len(w["step_times_s"]) for w in record["workers"]] == [9, 9]
        assert len(list(path.parent.glob("worker-*.json"))) == 2
        # The PS tasks' traces, written as they exited: every partition's sum
        # of every step complete, by one of the two workers.
        for trace in sorted(path.parent.glob("ps-*.json")):
            complete = [e for e in json.loads(trace.read_text())["traceEvents"]
                        if e.get("cat") == "complete"]
            assert {e["args"]["step"] for e in complete} == set(range(9)), trace
            assert {e["args"]["worker"] for e in complete} <= {0, 1}
        assert len(list(path.parent.glob("ps-*.json"))) == config["ps"]
        if config["shaping"] == "netns":
            assert record["payload_bytes_per_s"] == pytest.approx(
                ideal.payload_bytes_per_s(BANDWIDTH_MBIT))
            assert sorted(record["host_worker"].values()) == [0, 1]
            assert len(record["link_bytes"]) > 10
            # One run: its tenths are this record's. Their mean is each
            # measured step's counted bytes over what the link carries in it.
            for side, hosts in r["link_phases"].items():
                for h, tenths in zip(sorted(record["host_worker"]), hosts):
                    assert statistics.fmean(tenths) == pytest.approx(
                        mean_step_load(record, h, side, config["warmup_steps"])), (side, h)
        check_breakdown(path.parent, record, result)
    assert "fifo" in proc.stdout and "prophet" in proc.stdout  # the table
    if netns.available()[0]:
        assert set(netns.list_ours()) == before  # torn down


# A compute run (the default bench starts with two) trains no steps: with
# --timeline-dir it once failed on its missing train window. About 40 s: a long
# variant, as make test must stay under 10 minutes.
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_compute_run_keeps_no_timelines_beside_the_training_runs(tmp_path):
    out, timelines = tmp_path / "bench.json", tmp_path / "timelines"
    proc = run_prophet(
        "bench", "--model", "cnn", "--workers", "2", "--bandwidth-mbit", str(BANDWIDTH_MBIT),
        "--steps", "9", "--reps", "1", "--compute-reps", "1", "--schedulers", "fifo",
        "--json", str(out), "--timeline-dir", str(timelines), env=child_env(), cwd=tmp_path,
        timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    config = json.loads(out.read_text())["config"]
    # The compute run profiled the model: its measured profile (not a shipped
    # one's reference) is the config's, and the bound's compute is that profile's.
    assert "variables" in config["profile"]
    assert config["compute_s"] == config["profile"]["compute_s"]
    [run] = timelines.iterdir()
    assert run.name.startswith("fifo-") and (run / "run.json").exists()
