"""`prophet-tf bench --suite`: its cells, its resumable JSON, its summary, plot and table."""
import dataclasses
import json

import pytest

from prophet_tf.bench import bench_cli, link_load, report, results, suite
from prophet_tf.tools import plot


def test_the_paper_suite_covers_its_models_bandwidths_and_worker_counts():
    paper = suite.SUITES["paper"]
    cells = suite.cells(paper)
    assert {(c["model"], c["workers"], c["bandwidth_mbit"]) for c in cells} == {
        (m, w, b) for m in ("resnet50", "inceptionv3", "vgg16") for w in (2, 4)
        for b in paper.bandwidths_mbit}
    assert len(paper.bandwidths_mbit) >= 2 and set(paper.schedulers.split(",")) == set(
        bench_cli.ALL_SCHEDULERS)
    for c in cells:
        # Each link runs at the rate the machine's transport carries for its
        # worker count, whatever the cluster's bandwidth.
        link = c["bandwidth_mbit"] / c["time_scale"]
        assert link == pytest.approx(paper.transport_mbit * 2 / c["workers"])
        args = bench_cli._parse(suite._argv(paper, c, None))  # every cell is a valid bench
        assert args.compute == "emulated" and args.ps == c["workers"]
        assert args.steps > results.WARMUP_STEPS and args.compute_reps == 0


def test_suite_options_cannot_be_overridden(capsys):
    with pytest.raises(SystemExit):
        bench_cli._parse(["--suite", "paper", "--workers", "3", "--steps", "20"])
    err = capsys.readouterr().err
    assert "Received: --steps, --workers" in err
    args = bench_cli._parse(["--suite", "smoke", "--json", "x.json", "--timeline-dir", "t"])
    assert args.suite == "smoke" and args.json == "x.json"


def _cell_result(cell, steps: dict, ideal_s=0.1, time_scale=2.0):
    return {"cell": cell, "config": {"time_scale": time_scale, "ideal": {"ideal_s": ideal_s}},
            "results": [{"scheduler": s, "step_time_s": t, "step_time_s_all": [t]}
                        for s, t in steps.items()]}


def _result(name="paper", complete=False, **steps):
    definition = suite.SUITES[name]
    cells = suite.cells(definition)
    return {"suite": dataclasses.asdict(definition), "complete": complete,
            "cells": [_cell_result(c, steps) for c in cells[:2]]}


def test_summary_ratios():
    result = _result(fifo=0.4, p3=0.25, bytescheduler=0.3, prophet=0.2, **{"tf-mwms": 0.32})
    rows = suite.summary(result)
    r = rows[0]
    assert r["cluster_step_s"]["fifo"] == pytest.approx(0.2)  # measured / time scale
    assert r["speedup_vs_fifo"]["prophet"] == pytest.approx(2.0)
    assert r["prophet_vs_tf_mwms"] == pytest.approx(0.2 / 0.32)
    assert r["prophet_vs_rival"] == pytest.approx(0.2 / 0.25)  # the better of P3 and BS
    assert r["prophet_vs_ideal"] == pytest.approx(2.0)
    assert r["tf_mwms_vs_ideal"] == pytest.approx(3.2)
    partial = suite.summary(_result(fifo=0.4, prophet=0.3))[0]
    assert partial["prophet_vs_rival"] is None and partial["prophet_vs_tf_mwms"] is None


def test_a_suite_json_resumes_only_the_same_suite(tmp_path):
    path = tmp_path / "suite.json"
    result = _result(fifo=0.4, prophet=0.3)
    path.write_text(json.dumps(result))
    # Made before the bench recorded its host queue: through one queue.
    kept = suite._previous(str(path), suite.SUITES["paper"], "fifo")
    assert [c["cell"] for c in kept] == [c["cell"] for c in result["cells"]]
    assert suite._previous(str(path), suite.SUITES["paper"], "fair") == []
    fair = dict(result, cells=[dict(c, config=dict(c.get("config", {}), host_queue="fair"))
                               for c in result["cells"]])
    path.write_text(json.dumps(fair))
    kept = suite._previous(str(path), suite.SUITES["paper"], "fair")
    assert [c["cell"] for c in kept] == [c["cell"] for c in result["cells"]]
    assert suite._previous(str(tmp_path / "absent.json"), suite.SUITES["paper"], "fair") == []
    with pytest.raises(ValueError, match="holds another result \\('paper', or a different "
                                         "definition of suite 'smoke'\\)"):
        suite._previous(str(path), suite.SUITES["smoke"], "fair")
    changed = dict(result, suite=dict(result["suite"], steps=99))
    path.write_text(json.dumps(changed))
    with pytest.raises(ValueError, match="different definition"):
        suite._previous(str(path), suite.SUITES["paper"], "fair")
    path.write_text("{half")
    with pytest.raises(ValueError, match="exists and is not JSON"):
        suite._previous(str(path), suite.SUITES["paper"], "fair")


def test_suite_plot_and_table(tmp_path):
    result = _result(fifo=0.4, p3=0.25, bytescheduler=0.3, prophet=0.2, **{"tf-mwms": 0.32})
    path = tmp_path / "suite.json"
    path.write_text(json.dumps(result))
    out = tmp_path / "suite.png"
    assert plot.main([str(path), "-o", str(out)]) == 0
    assert out.stat().st_size > 10_000
    table = report.suite_table(result)
    first = suite.cells(suite.SUITES["paper"])[0]
    assert (f"| {first['model']} | {first['workers']} | {first['bandwidth_mbit'] / 1e3:g} | "
            f"200.0 ms | 1.60× | 1.33× | 2.00× | 1.25× | 0.62 | 0.80 | 2.00 | 3.20 | – |") in table
    assert "2 of 12 cells (incomplete)" in table
    assert "answers first –: run before the bench recorded the setting" in table
    # A cell that recorded the setting shows it; with every cell recorded, no footnote.
    for c, on in zip(result["cells"], (True, False)):
        c["config"]["answers_first"] = on
    table = report.suite_table(result)
    assert "| 3.20 | on |" in table and "| 3.20 | off |" in table and "–: run" not in table


def test_targets_mark_each_cell_and_count_them():
    # Cell 0: Prophet 0.7x tf-mwms (met, at the limit as printed), 1.2x the
    # bound (missed), 0.85x P3 (met both). Cell 1: 0.91x tf-mwms while the
    # bound is 0.91x of it (unreachable), 1.0x the bound, 1.003x BS (1.00
    # as printed: met), no P3.
    result = _result(fifo=0.2, p3=0.1412, bytescheduler=0.3, prophet=0.12,
                     **{"tf-mwms": 0.17143})
    first, second = result["cells"]
    second["results"] = [{"scheduler": s, "step_time_s": t} for s, t in
                         (("fifo", 0.12), ("bytescheduler", 0.0997), ("prophet", 0.1),
                          ("tf-mwms", 0.11))]
    t = suite.targets(result)
    a, b = t["rows"]
    assert (a["met_vs_tf_mwms"], a["met_vs_ideal"], a["met_vs_rival"],
            a["met_vs_rival_somewhere"]) == (True, False, True, True)
    assert (b["met_vs_tf_mwms"], b["met_vs_ideal"], b["met_vs_rival"],
            b["met_vs_rival_somewhere"]) == (False, True, True, False)
    assert b["floor_vs_tf_mwms"] == pytest.approx(0.1 / 0.11)
    assert t["met"] == {"vs_tf_mwms": 1, "vs_ideal": 1, "vs_rival": 2, "vs_rival_somewhere": 1}
    assert t["reachable_vs_tf_mwms"] == 1  # cell 0's bound is 0.58x tf-mwms
    assert t["models_not_run"] == ["inceptionv3", "vgg16"]
    table = report.targets_table(result)
    assert "| 0.70 ✓ | 0.58 | 1.20 ✗ | 0.85 ✓ |" in table
    assert "| 0.91 ✗ | 0.91 | 1.00 ✓ | 1.00 ✓ |" in table
    assert ("Of 2 cells, Prophet is at most 0.7x tf-mwms in 1 (the ideal bound allows it in "
            "1), at most 1.15x the bound in 1, at most 1.0x the better of P3 and "
            "ByteScheduler in 2 and at most 0.9x in 1; no cell of inceptionv3, vgg16 ran."
            ) in table
    # A cell without tf-mwms has no mark for it and no floor.
    second["results"] = second["results"][:3]
    b = suite.targets(result)["rows"][1]
    assert b["met_vs_tf_mwms"] is None and b["floor_vs_tf_mwms"] is None


def test_a_suite_without_fifo_is_refused(tmp_path, capsys):
    path = tmp_path / "suite.json"
    path.write_text(json.dumps(_result(prophet=0.2)))
    assert plot.main([str(path), "-o", str(tmp_path / "x.png")]) == 2
    assert "no cell has a FIFO run" in capsys.readouterr().err


def test_link_phases_show_where_in_the_step_a_link_is_busy():
    # Steps of 1 s from t=0; host 0 (worker 0) sends 1000 bytes/s in the second
    # half of every step only, host 1 (worker 1) 500 bytes/s all the time.
    def sent0(t):
        whole, part = divmod(t, 1.0)
        return 1000 * (0.5 * whole + max(0.0, part - 0.5))

    samples = [(t / 10, {0: (0, sent0(t / 10)), 1: (0, 500 * t / 10)}) for t in range(61)]
    reports = [{"train_window": [0.0, 6.0], "step_times_s": [1.0] * 6}] * 2
    phases = link_load.link_phases(samples, reports, {0: 0, 1: 1}, warmup=2,
                                 payload_bytes_per_s=1000.0, bins=4)
    assert phases["sent"] == [pytest.approx([0.0, 0.0, 1.0, 1.0], abs=1e-9),
                              pytest.approx([0.5] * 4)]
    assert phases["received"] == [pytest.approx([0.0] * 4)] * 2
    # A host sampled over no measured step is not measured; runs combine by median.
    samples = [(t, {0: c[0], 1: None if t > 1 else c[1]}) for t, c in samples]
    late = link_load.link_phases(samples, reports, {0: 0, 1: 1}, 2, 1000.0, bins=4)
    assert late["sent"][1] is None
    assert link_load.median_loads([None, phases, late])["sent"] == [
        pytest.approx([0.0, 0.0, 1.0, 1.0], abs=1e-9), pytest.approx([0.5] * 4)]


def test_link_loads_over_the_measured_window():
    # Two hosts sampled every 0.5 s: host 0 sends 1000 bytes/s, host 1 500.
    samples = [(t, {0: (0, int(1000 * t)), 1: (int(250 * t), int(500 * t))})
               for t in (0.0, 0.5, 1.0, 1.5, 2.0)]
    reports = [{"train_window": [0.0, 2.0], "step_times_s": [0.25, 0.25, 0.5, 1.0]},
               {"train_window": [0.1, 1.8], "step_times_s": [0.2, 0.2, 0.7, 0.7]}]
    # After 2 warm-up steps: from 0.5 (the later worker) to 1.8 (the first to finish).
    window = results.measured_window(reports, 2)
    assert window == pytest.approx((0.5, 1.8))
    loads = link_load.link_loads(samples, window, payload_bytes_per_s=1000.0)
    assert loads["sent"] == pytest.approx([1.0, 0.5])
    assert loads["received"] == pytest.approx([0.0, 0.25])
    assert link_load.busiest_load(loads) == pytest.approx(1.0)
    # A host whose counters stop (its process ended) is not measured past them.
    samples[-1][1][1] = None
    assert link_load.link_loads(samples, (0.5, 1.9), 1000.0)["sent"] == [
        pytest.approx(1.0), None]
    assert link_load.link_loads(samples, (1.0, 1.0), 1000.0) is None
    assert link_load.median_loads([None, loads, {"sent": [0.8, None], "received": [0.0, 0.5]}]) \
        == {"sent": [pytest.approx(0.9), pytest.approx(0.5)],
            "received": [pytest.approx(0.0), pytest.approx(0.375)]}


def test_a_host_counter_interpolates_inside_its_samples_only():
    # Host 0 sampled at 0, 1 and 3 s; its process is gone at 2 s (None).
    samples = [(0.0, {0: (0, 0)}), (1.0, {0: (10, 100)}), (2.0, {0: None}),
               (3.0, {0: (30, 500)})]
    sent = link_load.Counter(samples, 0, 1)
    assert sent.at(0.0) == 0 and sent.at(1.0) == 100 and sent.at(3.0) == 500
    assert sent.at(0.25) == pytest.approx(25.0)
    assert sent.at(2.0) == pytest.approx(300.0)  # across the gap, between 1 s and 3 s
    assert sent.at(-0.1) is None and sent.at(3.1) is None
    assert link_load.Counter(samples, 0, 0).at(0.5) == pytest.approx(5.0)
    assert link_load.Counter([], 0, 1).at(0.0) is None


def test_the_emulated_compute_is_stated_and_a_step_of_minutes_is_a_warning():
    from prophet_tf.bench import emulated, saved_profiles

    profiled_s = saved_profiles.load_profile("resnet50")["compute_s"]
    # ResNet-50's shipped profile is a CPU's: as profiled, at time scale 24, a step
    # computes for minutes; the bench says so before its first run.
    note = emulated.compute_note("resnet50", profiled_s, None, 24)
    assert f"{profiled_s * 1e3:.1f} ms per step (resnet50's profile as measured" in note
    assert f"{profiled_s * 24 / 60:.1f} min" in note and "WARNING" in note
    note = emulated.compute_note("resnet50", profiled_s, 130, 24)
    assert note == ("emulated compute 130.0 ms per step (--compute-ms 130), 3120.0 ms as run "
                    "at time scale 24")
    assert "WARNING" in emulated.compute_note("cnn", 0.04, None, 1501)
    assert "WARNING" not in emulated.compute_note("cnn", 0.04, None, 1000)
