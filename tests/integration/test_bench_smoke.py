"""`prophet-tf bench` end to end: a short run of two schedulers on a shaped network."""
import json

import pytest

from cluster import child_env, run_prophet
from prophet_tf.bench import breakdown, ideal, link_load, netns, runner

BANDWIDTH_MBIT = 100.0
WARMUP = 2  # of the smoke run's 9 steps: the analyses measure steps 2 to 7


def check_breakdown(directory, record, result):
    """The timeline analyses (prophet_tf/bench/breakdown.py) on a real run."""
    directory = str(directory)
    config = result["config"]
    times = breakdown.breakdown(directory, warmup=WARMUP)
    assert 0 <= times["push_busy_in_backward"] <= 1
    assert 0 < times["first_pull_ms"] <= times["last_pull_ms"], times
    (median, low, high), = breakdown.phase_offsets(directory, warmup=WARMUP).values()
    assert low <= median <= high
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
    events = breakdown.step_events(directory, warmup=WARMUP)
    if not record["payload_bytes_per_s"]:
        assert events is None  # no shaped link: no link load to place events beside
        return
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
    assert all(len(load) == 10 and all(x is None or 0 <= x < ideal.TCP_FRAMING * 1.05
                                       for x in load)
               for load in events["link_load"].values()), events["link_load"]


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
    # declared (balanced: the 4 MiB dense kernel is cut over both).
    settings = config["scheduler_settings"]
    assert sorted(settings) == ["fifo", "prophet"]
    assert settings["prophet"]["window_blocks"] == 2
    assert settings["fifo"]["partition_bytes"] < config["model_bytes"] / 2
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
        # Unshaped, this model's step takes about a third of this on loopback.
        assert r["step_time_s"] >= floor * 0.95, (r, floor)
        assert r["step_time_s"] >= r["ideal_step_time_s"] * 0.9
        if config["shaping"] == "netns":
            # Each host's link, each way, over the measured steps: no more than
            # the shaper lets through (headers included), and this
            # link-bound run keeps its busiest link mostly busy.
            loads = r["link_load"]
            assert sorted(loads) == ["received", "sent"]
            assert all(0 < v < ideal.TCP_FRAMING * 1.05 for side in loads.values()
                       for v in side), loads
            assert link_load.busiest_load(loads) > 0.3, loads
            # Through the step: a load per tenth, per host and direction. The
            # shaper is a token bucket: after an idle moment it lets its burst
            # through at once, so one tenth of a step may carry up to the
            # burst more than the rate (a tenth read 1.108 with no bug); a
            # whole step, the mean of its tenths, barely more than the rate.
            phases = r["link_phases"]
            burst, _ = netns._tbf_sizes(BANDWIDTH_MBIT * 1e6)
            rate = ideal.payload_bytes_per_s(BANDWIDTH_MBIT)
            tenth = r["step_time_s"] / link_load.PHASE_BINS * rate
            for side in phases.values():
                for h in side:
                    assert len(h) == link_load.PHASE_BINS, phases
                    assert all(0 <= v < ideal.TCP_FRAMING * 1.05 + burst / tenth
                               for v in h), (h, burst / tenth)
                    assert sum(h) / len(h) < ideal.TCP_FRAMING * 1.05 + burst / (
                        tenth * link_load.PHASE_BINS), h
    # Beside each run's timelines, what places its events in its steps.
    records = sorted((tmp_path / "timelines").glob("*/run.json"))
    assert [p.parent.name.split("-")[0] for p in records] == ["fifo", "prophet"]
    for path in records:
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
        check_breakdown(path.parent, record, result)
    assert "fifo" in proc.stdout and "prophet" in proc.stdout  # the table
    if netns.available()[0]:
        assert set(netns.list_ours()) == before  # torn down
