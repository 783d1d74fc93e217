"""`prophet-tf plot`: what it extracts from a timeline, the images it writes, its errors.

The timelines are made by the real recorder (prophet_tf.engine.timeline) from a
small worker played in virtual time, with plans from a real ProphetScheduler.
"""
import json
import os
import pathlib
import struct
import subprocess
import sys

import pytest

from prophet_tf.engine import timeline
from prophet_tf.tools import plot
from prophet_tf.engine import schedulers

ROOT = pathlib.Path(__file__).resolve().parents[2]
MS = 1_000_000
# Op-library keys (creation order) and names of the trained variables; the
# priority of a variable is its rank among them.
NATIVE_KEYS = [10, 11, 13, 14]
NAMES = ["dense/kernel", "dense/bias", "out/kernel", "out/bias"]
NBYTES = [40_000, 400, 20_000, 40]
STEPS = 12
STEP_NS = 20 * MS
# Backward: the last layer first; the first layer's gradient comes much later
# (two bursts, so the Prophet plan has a gap).
READY_OFFSET_NS = {3: 6 * MS, 2: int(6.05 * MS), 1: int(6.1 * MS), 0: 12 * MS}
BANDWIDTH = 40  # bytes per µs = 40 MB/s


def make_trace(worker=0, steps=STEPS):
    """Plays `steps` training steps of one worker; returns (trace dict, push block count)."""
    recorder = timeline.Recorder(worker, dict(zip(NATIVE_KEYS, NAMES)))
    sched = schedulers.make_scheduler("prophet")
    stamps, pushes, plan_version = [], 0, None
    link_free = 0
    for step in range(steps):
        base = (step + 1) * STEP_NS
        for p, key in enumerate(NATIVE_KEYS):  # Forward: every read waits from the step start.
            stamps.append({"key": key, "step": step, "t_ns": base, "kind": 1})
            stamps.append({"key": key, "step": step, "t_ns": base + (p + 1) * MS // 2, "kind": 2})
        for p in sorted(READY_OFFSET_NS, key=READY_OFFSET_NS.get):
            ready = base + READY_OFFSET_NS[p]
            if p == 3:  # First gradient of the step: the engine records the plan here.
                plan = sched.plan()
                if plan.get("version", 0) != plan_version:
                    plan_version = plan.get("version", 0)
                    recorder.plan(ready, plan)
            stamps.append({"key": NATIVE_KEYS[p], "step": step, "t_ns": ready, "kind": 0})
            sched.add(schedulers.ReadyItem(key=p, partition=0, ps_index=0, iteration=step, priority=p,
                                           nbytes=NBYTES[p], ready_ns=ready))
            now = ready
            if p == 0:
                sched.flush()
            while block := sched.next_block(now):
                start = max(now, link_free)
                end = start + sum(i.nbytes for i in block) * 1000 // BANDWIDTH
                link_free = end
                recorder.transfer(timeline.Transfer(
                    "push", 0, tuple(NATIVE_KEYS[i.key] for i in block),
                    sum(i.nbytes for i in block), step, start, end))
                sched.on_sent(block, start, end)
                pushes += 1
        t = link_free
        for p, key in enumerate(NATIVE_KEYS):  # Version step+1 comes back in priority order.
            end = t + NBYTES[p] * 1000 // BANDWIDTH + 100_000
            recorder.transfer(timeline.Transfer("pull", 0, (key,), NBYTES[p], step + 1, t, end))
            t = end
    return json.loads(json.dumps(recorder.trace(stamps))), pushes


@pytest.fixture(scope="module")
def traces():
    return {w: make_trace(w) for w in (0, 1)}


@pytest.fixture
def timeline_files(tmp_path, traces):
    paths = []
    for w, (trace, _) in traces.items():
        path = tmp_path / f"worker-{w}.json"
        path.write_text(json.dumps(trace))
        paths.append(path)
    return paths


def png_size(path):
    data = pathlib.Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert data.endswith(b"IEND\xaeB`\x82"), "truncated PNG"
    return width, height, len(data)


# -- extraction ------------------------------------------------------------------------------


def test_parse_timeline_counts_and_priorities(traces):
    trace, pushes = traces[0]
    t = plot.parse_timeline(trace, "w0")
    assert t.worker == 0 and t.scheduler == "prophet"
    assert t.names == NAMES  # by priority = rank of the op-library key
    assert len(t.reads) == len(NAMES) * STEPS
    assert len(t.ready) == len(NAMES) * STEPS
    assert t.steps == list(range(STEPS))
    assert sum(len(v) for v in t.pushes.values()) == pushes and list(t.pushes) == [0]
    assert len(t.pulls[0]) == len(NAMES) * STEPS
    # Each read knows its variable's priority; step 0's first layer waited 0.5 ms.
    first = [s for s in t.reads if s.step == 0 and s.priority == 0]
    assert len(first) == 1 and first[0].keys == ("dense/kernel",)
    assert first[0].end_us - first[0].start_us == pytest.approx(500.0)
    # Gradients: priority 3 (the last layer) is ready first in every step.
    for step in range(STEPS):
        order = [p for _, p, s in t.ready if s == step]
        assert order == [3, 2, 1, 0]
    # A push block's colour is its most urgent variable's priority.
    for span in t.pushes[0]:
        assert span.priority == min(NAMES.index(k) for k in span.keys)
    assert {s.step for s in t.pulls[0]} == set(range(1, STEPS + 1))


def test_plans_are_attributed_to_their_iterations(traces):
    t = plot.parse_timeline(traces[0][0])
    first = plot.plan_for_iteration(t, 0)
    assert first["scheduler"] == "prophet" and first["version"] == 0 and first["bursts"] == []
    # Prophet plans after 2 warm-up and 5 profiled iterations: the plan recorded
    # in iteration 7 is the first with steps, in force from then on.
    later = plot.plan_for_iteration(t, STEPS - 1)
    assert later["version"] >= 1 and len(later["bursts"]) == 2
    assert later["bursts"][0]["gap_ns"] > 0
    assert sorted(later["bursts"][0]["keys"]) == [1, 2, 3] and later["bursts"][1]["keys"] == [0]
    assert plot.plan_for_iteration(t, 6)["version"] == 0


def test_select_steps_default_and_range(traces):
    t = plot.parse_timeline(traces[0][0])
    chosen, t0, t1 = plot.select_steps(t, None)
    assert chosen == [STEPS - 4, STEPS - 3, STEPS - 2]  # the last three before the final one
    assert t0 == pytest.approx((STEPS - 4 + 1) * STEP_NS / 1e3)  # its first parameter read
    chosen, t0, t1 = plot.select_steps(t, plot.parse_steps("2:4"))
    assert chosen == [2, 3]
    assert t0 == pytest.approx(3 * STEP_NS / 1e3)
    pulls_of_4 = [s.end_us for s in t.pulls[0] if s.step == 4]
    assert t1 == pytest.approx(max(pulls_of_4))  # up to the version the last step made
    assert plot.select_steps(t, plot.parse_steps("5"))[0] == [5]
    assert plot.select_steps(t, plot.parse_steps("9:"))[0] == [9, 10, 11]
    assert plot.select_steps(t, plot.parse_steps(":2"))[0] == [0, 1]


@pytest.mark.parametrize("text", ["a:b", "1:2:3", "-1:3", "x"])
def test_parse_steps_rejects(text):
    with pytest.raises(plot.PlotError, match="--steps"):
        plot.parse_steps(text)


# -- images ----------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_plot_two_workers_png(timeline_files, tmp_path, capsys):
    out = tmp_path / "schedule.png"
    assert plot.main([*map(str, timeline_files), "-o", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    width, height, size = png_size(out)
    assert width == 1650 and 800 < height < 2000, (width, height)
    assert size > 30_000  # bars, text, colour bar: not an empty canvas


@pytest.mark.timeout(120)
def test_plot_directory_worker_and_steps(timeline_files, tmp_path):
    out = tmp_path / "one.png"
    code = plot.main([str(timeline_files[0].parent), "-o", str(out), "--worker", "1",
                      "--steps", "8:10"])
    assert code == 0
    width, height, _ = png_size(out)
    both = tmp_path / "both.png"
    assert plot.main([str(timeline_files[0].parent), "-o", str(both)]) == 0
    assert height < png_size(both)[1]  # one panel instead of two


@pytest.mark.timeout(120)
def test_plot_bench(tmp_path):
    bench = {"config": {"model": "mlp", "workers": 2},
             "results": [{"scheduler": name, "step_time_s": median,
                          "step_time_s_all": [median * 0.9, median, median * 1.2],
                          "samples_per_s": 64 / median, "ideal_step_time_s": 0.05}
                         for name, median in (("fifo", 0.09), ("prophet", 0.07))]}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench))
    rows = plot.parse_bench(bench)
    assert [r["scheduler"] for r in rows] == ["fifo", "prophet"]
    assert rows[0]["min"] == pytest.approx(0.081) and rows[0]["max"] == pytest.approx(0.108)
    assert rows[1]["ideal"] == 0.05 and rows[1]["n"] == 3
    out = tmp_path / "bench.png"
    assert plot.main([str(path), "-o", str(out)]) == 0
    width, height, size = png_size(out)
    assert width >= 500 and height >= 400 and size > 10_000


# -- errors ----------------------------------------------------------------------------------


def _error(capsys, argv):
    code = plot.main(argv)
    return code, capsys.readouterr().err


def test_not_json(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    code, err = _error(capsys, [str(bad), "-o", str(tmp_path / "x.png")])
    assert code == 2 and f"{bad} is not JSON" in err and "Received: a file of 9 bytes" in err
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("content, message", [
    ([1, 2], "Received: a JSON list"),
    ({"foo": 1}, "Received: top-level keys ['foo']"),
    ({"traceEvents": [{"ph": "M", "name": "process_name", "pid": 0}]},
     "has no training step to plot"),
    ({"traceEvents": [{"ph": "i", "cat": "backward", "name": "grad x", "pid": 0,
                       "ts": 1.0, "args": {}}]}, "is not a prophet_tf worker timeline"),
    ({"results": []}, "has no results to plot"),
    ({"results": [{"scheduler": "fifo"}]}, "needs \"scheduler\" and a numeric \"step_time_s\""),
])
def test_not_a_timeline_or_bench(tmp_path, capsys, content, message):
    path = tmp_path / "in.json"
    path.write_text(json.dumps(content))
    code, err = _error(capsys, [str(path), "-o", str(tmp_path / "x.png")])
    assert code == 2 and message in err, err
    assert "Traceback" not in err and not (tmp_path / "x.png").exists()


def test_unknown_worker(timeline_files, tmp_path, capsys):
    code, err = _error(capsys, [*map(str, timeline_files), "-o", str(tmp_path / "x.png"),
                                "--worker", "5"])
    assert code == 2
    assert "no timeline of worker 5" in err and "Received: --worker 5; workers [0, 1]" in err


def test_empty_step_range(timeline_files, tmp_path, capsys):
    code, err = _error(capsys, [str(timeline_files[0]), "-o", str(tmp_path / "x.png"),
                                "--steps", "30:40"])
    assert code == 2
    assert "--steps 30:40 selects no step of worker 0" in err and "steps 0 to 11" in err
    assert not (tmp_path / "x.png").exists()


def test_bad_steps_and_missing_output_dir(timeline_files, tmp_path, capsys):
    code, err = _error(capsys, [str(timeline_files[0]), "-o", str(tmp_path / "x.png"),
                                "--steps", "a:b"])
    assert code == 2 and "Received: --steps a:b" in err
    code, err = _error(capsys, [str(timeline_files[0]), "-o", str(tmp_path / "no" / "x.png")])
    assert code == 2 and "the directory of the output does not exist" in err


def test_mixed_kinds_and_missing_file(timeline_files, tmp_path, capsys):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"results": [{"scheduler": "fifo", "step_time_s": 1.0}]}))
    code, err = _error(capsys, [str(timeline_files[0]), str(bench), "-o",
                                str(tmp_path / "x.png")])
    assert code == 2 and "not both" in err and f"{bench} (bench)" in err
    code, err = _error(capsys, [str(tmp_path / "nope.json"), "-o", str(tmp_path / "x.png")])
    assert code == 2 and "cannot read" in err and "nope.json" in err


def test_empty_directory(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    code, err = _error(capsys, [str(empty), "-o", str(tmp_path / "x.png")])
    assert code == 2 and "without worker-<i>.json timelines" in err


def _run(code, *args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", code, *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(150)
def test_missing_matplotlib_names_the_extra(timeline_files, tmp_path):
    # A None entry in sys.modules makes `import matplotlib` fail as if it were not installed.
    result = _run("import sys; sys.modules['matplotlib'] = None\n"
                  "from prophet_tf import cli; sys.exit(cli.main(['plot', *sys.argv[1:]]))",
                  str(timeline_files[0]), "-o", str(tmp_path / "x.png"))
    assert result.returncode == 1, result.stderr
    assert 'pip install "prophet_tf[plot]"' in result.stderr and "Traceback" not in result.stderr


@pytest.mark.timeout(150)
def test_cli_dispatch_and_lazy_matplotlib(timeline_files, tmp_path):
    result = _run("import sys, prophet_tf.tools.plot, prophet_tf.cli, prophet_tf.tools.launch\n"
                  "print('matplotlib' in sys.modules)")
    assert result.returncode == 0 and result.stdout.strip() == "False", result.stderr
    out = tmp_path / "cli.png"
    result = subprocess.run([sys.executable, "-m", "prophet_tf", "plot", str(timeline_files[1]),
                             "-o", str(out), "--steps", "10:12"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert result.returncode == 0, result.stderr
    assert png_size(out)[0] == 1650
