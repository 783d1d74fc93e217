"""`prophet-tf bench` end to end: a short run of two schedulers on a shaped network."""
import json

import pytest

from cluster import child_env, run_prophet
from prophet_tf.bench import ideal, link_load, netns, runner

BANDWIDTH_MBIT = 100.0


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
            # Through the step: a load per tenth, per host and direction.
            phases = r["link_phases"]
            assert all(len(h) == link_load.PHASE_BINS and
                       all(0 <= v < ideal.TCP_FRAMING * 1.05 for v in h)
                       for side in phases.values() for h in side), phases
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
    assert "fifo" in proc.stdout and "prophet" in proc.stdout  # the table
    if netns.available()[0]:
        assert set(netns.list_ours()) == before  # torn down
