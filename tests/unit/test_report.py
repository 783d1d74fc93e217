"""The docs' result tables are rendered from, and checked against, committed JSON.

Only tables are checked. A reading of results in prose is a dated record
(CONTRIBUTING.md, "Documentation"): no test here matches sentences.
"""
import json
import pathlib
import re

import pytest

from prophet_tf.bench import report

pytestmark = pytest.mark.timeout(60)

ROOT = pathlib.Path(__file__).resolve().parents[2]


#: Every Markdown file of the project's own (not a venv's or a build's).
MARKDOWN = sorted([*ROOT.glob("*.md"), *ROOT.glob("docs/**/*.md"), *ROOT.glob("examples/**/*.md")])


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_table_matches_its_json(path):
    text = path.read_text()
    # A start marker without its end would be skipped by the renderer, unchecked.
    starts = re.findall(r"^<!-- table: ", text, re.M)
    ends = re.findall(r"^<!-- end table -->", text, re.M)
    assert len(starts) == len(ends) == len(report._BLOCK.findall(text)), (
        f"{path.name}: a table marker without its end")
    assert report.render(text, str(path.parent)) == text, (
        f"a table differs from its JSON: run `prophet-tf report {path.relative_to(ROOT)}`")


def test_the_results_pages_have_their_tables():
    for name in ("README.md", "docs/benchmarks.md"):
        assert "<!-- table: bench " in (ROOT / name).read_text(), name


def test_a_bench_table_carries_the_json_numbers(tmp_path):
    result = {
        "config": {"model": "cnn", "workers": 2, "ps": 2, "layout": "colocated",
                   "bandwidth_mbit": 200.0, "steps": 30, "compute_s": 0.04,
                   "ideal": {"ideal_s": 0.2, "compute_s": 0.04, "busiest_link_s": 0.19,
                             "chain_s": 0.2}},
        "results": [
            {"scheduler": "fifo", "step_time_s": 0.4, "step_time_s_all": [0.39, 0.4, 0.45],
             "samples_per_s": 160.0, "ideal_step_time_s": 0.2},
            {"scheduler": "tf-mwms", "step_time_s": 0.25, "step_time_s_all": [0.25, 0.26, 0.3],
             "samples_per_s": 256.0, "ideal_step_time_s": 0.2}]}
    (tmp_path / "r.json").write_text(json.dumps(result))
    md = tmp_path / "doc.md"
    md.write_text("intro\n<!-- table: bench r.json -->\nstale\n<!-- end table -->\nafter\n")
    assert report.main([str(md), "--check"]) == 1
    assert report.main([str(md)]) == 0
    text = md.read_text()
    # CPU busy: "–" for a run that did not record it.
    assert "| fifo | 400.0 ms | 390.0–450.0 | 160.0 | 1.00 | 1.60 | 2.00 | – |" in text
    # The ideal bound is the PS layout's: not shown for the all-reduce.
    assert "| tf-mwms | 250.0 ms | 250.0–300.0 | 256.0 | 0.62 | 1.00 | – | – |" in text
    assert "2 PS (colocated)" in text and text.startswith("intro\n") and text.endswith("after\n")
    assert "200 Mbit/s, 3 runs of 30 steps" in text
    assert report.main([str(md), "--check"]) == 0
    for r in result["results"]:
        r["step_time_s_all"] = r["step_time_s_all"][:1]
    (tmp_path / "r.json").write_text(json.dumps(result))
    assert report.main([str(md)]) == 0
    assert "200 Mbit/s, 1 run of 30 steps" in md.read_text()
    # A scaled run says so, and each run's CPU busy is the sum over its processes.
    result["config"].update(time_scale=6.0, link_mbit=33.3)
    result["results"][0]["cpu_busy"] = {"ps0": 0.25, "worker0": 0.5}
    (tmp_path / "r.json").write_text(json.dumps(result))
    assert report.main([str(md)]) == 0
    text = md.read_text()
    assert "200 Mbit/s at time scale 6 (links 33.3 Mbit/s, compute ×6; step times as " \
        "measured), 1 run of 30 steps" in text
    assert "| 2.00 | 0.75 |" in text
    # With colocated PS tasks and emulated compute the bound holds for the
    # all-reduce too; with dedicated PS hosts it does not.
    result["config"]["compute"] = "emulated"
    (tmp_path / "r.json").write_text(json.dumps(result))
    assert report.main([str(md)]) == 0
    assert "| tf-mwms | 250.0 ms | 250.0–250.0 | 256.0 | 0.62 | 1.00 | 1.25 | – |" in md.read_text()
    result["config"]["layout"] = "dedicated"
    (tmp_path / "r.json").write_text(json.dumps(result))
    assert report.main([str(md)]) == 0
    assert "| tf-mwms | 250.0 ms | 250.0–250.0 | 256.0 | 0.62 | 1.00 | – | – |" in md.read_text()
    # A result that measured the links adds each run's uplinks' range and its
    # busiest link (a downlink here); a row without them shows "–".
    result["results"][0]["link_load"] = {"sent": [0.78, 0.81], "received": [0.7, 0.86]}
    (tmp_path / "r.json").write_text(json.dumps(result))
    assert report.main([str(md)]) == 0
    text = md.read_text()
    assert "| CPU busy | uplinks' load | busiest link |" in text
    assert "| 0.75 | 0.78–0.81 | 0.86 |" in text
    assert "| tf-mwms | 250.0 ms | 250.0–250.0 | 256.0 | 0.62 | 1.00 | – | – | – | – |" in text


def test_a_phases_table_averages_the_hosts_per_part_of_the_step(tmp_path):
    config = {"model": "cnn", "workers": 2, "ps": 2, "layout": "colocated",
              "bandwidth_mbit": 200.0, "steps": 30, "compute_s": 0.04,
              "ideal": {"ideal_s": 0.2, "compute_s": 0.04, "busiest_link_s": 0.19}}
    fifo = {"scheduler": "fifo", "step_time_s": 0.4, "step_time_s_all": [0.4]}
    (tmp_path / "r.json").write_text(json.dumps({"config": config, "results": [fifo]}))
    md = tmp_path / "doc.md"
    md.write_text("<!-- table: phases r.json -->\n<!-- end table -->\n")
    assert report.main([str(md)]) == 2  # no phases measured: said, nothing written
    assert md.read_text() == "<!-- table: phases r.json -->\n<!-- end table -->\n"
    fifo["link_phases"] = {"sent": [[0.0, 1.0], [0.5, 0.9]], "received": [None, [0.2, 0.4]]}
    (tmp_path / "r.json").write_text(json.dumps({"config": config, "results": [fifo]}))
    assert report.main([str(md)]) == 0
    text = md.read_text()
    assert "| scheduler | link | 0–50% | 50–100% |" in text
    assert "| fifo | up | 0.25 | 0.95 |" in text
    assert "| fifo | down | 0.20 | 0.40 |" in text  # a host not measured is left out
    assert "1 run of 30 steps" in text


def test_an_events_table_has_a_row_per_event_and_a_column_per_run(tmp_path):
    md = tmp_path / "doc.md"
    md.write_text("<!-- table: events e.json -->\n<!-- end table -->\n")
    (tmp_path / "e.json").write_text(json.dumps({"command": "x", "answer_tails": {}}))
    assert report.main([str(md)]) == 2  # no step events: said, nothing written
    assert md.read_text() == "<!-- table: events e.json -->\n<!-- end table -->\n"

    def run(at, load):
        return {"events": {"last answer in": at, "first gradient ready": at + 0.1},
                "events_range": {"last answer in": [at - 0.1, at + 0.05],
                                 "first gradient ready": [at, at + 0.2]},
                "link_load": {"sent": [load, None], "received": [load / 2, 1.0]}}
    (tmp_path / "e.json").write_text(json.dumps({"command": "python t.py", "step_events": {
        "cell/fifo-1": run(0.75, 0.9), "cell/prophet-2": run(0.8, 0.6)}}))
    assert report.main([str(md)]) == 0
    text = md.read_text()
    assert "| event | fifo-1 | prophet-2 |" in text
    assert "| last answer in | 0.75 (0.65–0.80) | 0.80 (0.70–0.85) |" in text
    assert "| first gradient ready | 0.85 (0.75–0.95) | 0.90 (0.80–1.00) |" in text
    assert "| link load up | 0.90 – | 0.60 – |" in text
    assert "| link load down | 0.45 1.00 | 0.30 1.00 |" in text
    assert "per 50% of the step" in text and "`python t.py`" in text
    # An event a hair before the step's start reads 0.00, not -0.00.
    early = run(0.0, 0.5)
    early["events_range"]["last answer in"] = [-0.001, 0.01]
    (tmp_path / "e.json").write_text(json.dumps({"command": "c", "step_events": {"r": early}}))
    assert report.main([str(md)]) == 0
    assert "| last answer in | 0.00 (0.00–0.01) |" in md.read_text()


def test_bad_markers_name_what_was_received(tmp_path):
    md = tmp_path / "doc.md"
    md.write_text("<!-- table: pie r.json -->\n<!-- end table -->\n")
    with pytest.raises(ValueError, match="'pie'"):
        report.render(md.read_text(), str(tmp_path))
    assert report.main([str(md)]) == 2
    md.write_text("<!-- table: bench missing.json -->\n<!-- end table -->\n")
    assert report.main([str(md), "--check"]) == 2
    md.write_text("<!-- table: environment os.environ -->\n<!-- end table -->\n")
    with pytest.raises(ValueError, match="'os.environ'"):
        report.render(md.read_text(), str(tmp_path))


def test_a_runs_table_has_a_row_per_run_and_scheduler_of_one_configuration(tmp_path):
    config = {"model": "resnet50", "workers": 4, "ps": 4, "layout": "colocated",
              "bandwidth_mbit": 3000.0, "steps": 12, "compute_s": 2.16, "time_scale": 24.0,
              "link_mbit": 125.0, "ideal": {"ideal_s": 10.0, "compute_s": 2.16,
                                            "busiest_link_s": 9.9}}
    for name, step, first in [("ab-off-1", 13.5, None), ("ab-on-1", 12.1, True)]:
        result = {"config": dict(config, **({} if first is None else {"answers_first": first})),
                  "results": [{"scheduler": "prophet", "step_time_s": step,
                               "step_time_s_all": [step], "ideal_step_time_s": 10.0,
                               "cpu_busy": {"ps0": 0.25, "worker0": 0.75}}]}
        (tmp_path / f"{name}.json").write_text(json.dumps(result))
    md = tmp_path / "doc.md"
    md.write_text("<!-- table: runs ab-*.json -->\n<!-- end table -->\n")
    assert report.main([str(md)]) == 0
    text = md.read_text()
    assert "| ab-off-1 | prophet | 13500.0 ms | 1.35 | 1.00 |\n" \
        "| ab-on-1 | prophet | 12100.0 ms | 1.21 | 1.00 |" in text
    assert "2 runs of 1 rep each of 12 steps" in text
    # Runs of another configuration cannot share the table; the message names the field.
    other = json.loads((tmp_path / "ab-on-1.json").read_text())
    other["config"]["workers"] = 2
    (tmp_path / "ab-on-1.json").write_text(json.dumps(other))
    with pytest.raises(ValueError,
                       match=r"ab-on-1.json differs from ab-off-1.json in \['workers'\]"):
        report.render(md.read_text(), str(tmp_path))
    md.write_text("<!-- table: runs none-*.json -->\n<!-- end table -->\n")
    assert report.main([str(md), "--check"]) == 2


def test_runs_that_measured_their_own_compute_share_a_runs_table_each_against_its_ideal():
    def run(compute, ideal, step):
        config = {"model": "cnn", "workers": 2, "ps": 2, "bandwidth_mbit": 200.0, "steps": 30,
                  "reps": 3, "compute_s": compute, "compute_s_all": [compute],
                  "ideal": {"ideal_s": ideal, "compute_s": compute, "busiest_link_s": ideal}}
        return {"config": config, "results": [{"scheduler": "p3", "step_time_s": step,
                                               "ideal_step_time_s": ideal}]}
    text = report.runs_table([("before-1.json", run(0.05, 0.2, 0.22)),
                              ("after-1.json", run(0.04, 0.25, 0.25))])
    assert "| before-1 | p3 | 220.0 ms | 1.10 | – |\n| after-1 | p3 | 250.0 ms | 1.00 | – |" \
        in text
    assert "2 runs of 3 reps each of 30 steps; compute 50.0 ms" in text


def test_a_validate_table_shows_the_seeds_range_only_for_uneven_sharing():
    row = {"scheduler": "p3", "measured_s": 2.0, "predicted_s": 1.9,
           "predicted_range_s": [1.8, 2.1], "error": -0.05, "predicted_phase_spread_s": 0.25}
    even = report.validate_table({"validation": [{**row, "share_sigma": 0.0}]})
    assert even.splitlines()[2] == "| p3 | 2000.0 ms | 1900.0 ms | -5.0% |"
    uneven = report.validate_table({"validation": [{**row, "share_sigma": 1.2}]})
    assert uneven.splitlines()[0].endswith("| range over seeds | workers apart |")
    assert uneven.splitlines()[2] == (
        "| p3 | 2000.0 ms | 1900.0 ms | -5.0% | 1800.0–2100.0 ms | 0.25 s |")
    # A result from before seeds existed renders as before.
    old = {k: v for k, v in row.items()
           if k not in ("predicted_range_s", "predicted_phase_spread_s")}
    assert report.validate_table({"validation": [old]}) == even


def test_a_flowshare_table_has_a_row_per_number_of_connections():
    result = {"command": "python benchmarks/flow_share.py", "link_mbit": 125.0,
              "message_bytes": 262144, "payload_bytes_per_s": 262144 / 0.02, "measured_s": 20.0,
              "reps": 2, "by_connections": {
                  "6": {"messages": 9, "median_ratio": 2.0, "median_ratio_by_run": [1.5, 2.5],
                        "duration_deciles_ms": [10.0 * i for i in range(1, 10)],
                        "share_sigma": 1.25},
                  "2": {"messages": 8, "median_ratio": 1.0, "median_ratio_by_run": [1.0, 1.0],
                        "duration_deciles_ms": [40.0] * 9, "share_sigma": 0.0}}}
    lines = report.flow_share_table(result).splitlines()
    assert lines[2] == "| 2 | 8 | 1.00 | 1.00, 1.00 | 40.0 / 40.0 / 40.0 ms | 40.0 ms | 0.00 |"
    assert lines[3] == "| 6 | 9 | 2.00 | 1.50, 2.50 | 10.0 / 50.0 / 90.0 ms | 120.0 ms | 1.25 |"
    assert "2 runs of 20 s" in lines[-1]
    # A result with each connection's share: each run's slowest, and the losses.
    for case, shares in (("6", [[0.07, 0.1, 1.2, 1.2, 1.3, 2.13], [0.5, 1, 1, 1, 1, 1.5]]),
                         ("2", [[1.0, 1.0], [0.9, 1.1]])):
        result["by_connections"][case].update(connection_shares_by_run=shares,
                                              dropped_packets=0, retransmitted_segments=3)
    result.update(host_queue="fifo", congestion="bbr")
    lines = report.flow_share_table(result).splitlines()
    assert lines[2].endswith("| 0.00 | 1.00, 0.90 | 0 / 3 |")
    assert lines[3].endswith("| 1.25 | 0.07, 0.50 | 0 / 3 |")
    assert "125 Mbit/s, fifo sender queue, TCP bbr," in lines[-1]


def test_a_cuts_table_has_the_spread_per_ps_count_and_each_scheduler_over_the_bound():
    from prophet_tf.bench import cut_table

    run = dict(workers=8, ps=2, bandwidth_mbit=1000, ideal_step_time_s=2.0)
    result = {"model": "m", "compute_s": 0.25, "layout": "dedicated", "command": "c",
              "spread": [{"ps": 2, "cut": "rows", "busiest_over_mean": 1.5, "partitions": 7},
                         {"ps": 2, "cut": "elements", "busiest_over_mean": 1.0,
                          "partitions": 9}],
              "runs": [{**run, "cut": cut, "scheduler": name, "step_time_s": step}
                       for cut, name, step in [("rows", "fifo", 4.0), ("rows", "prophet", 3.0),
                                               ("elements", "fifo", 3.0),
                                               ("elements", "prophet", 2.2)]]}
    lines = cut_table.cuts_table(result).splitlines()
    assert lines[2] == "| 2 | 1.50 (7) | 1.00 (9) |"
    assert lines[6] == "| 8 / 2 | 1 | rows | 2.00 | 1.50 | 2.00 |"
    assert lines[7] == "| 8 / 2 | 1 | elements | 1.50 | 1.10 | 2.00 |"
    assert lines[-1].endswith("From `c`.")


def test_a_sweep_table_has_each_scheduler_over_the_bound_per_cell():
    from prophet_tf.bench import sweep_table

    rows = [dict(workers=w, ps=max(1, w // 4), bandwidth_mbit=mbit, scheduler=name,
                 step_time_s=step, ideal_step_time_s=2.0)
            for w, mbit, name, step in [(4, 1000, "fifo", 4.0), (4, 1000, "tf-mwms", 3.0),
                                        (8, 2500, "fifo", 2.5), (8, 2500, "tf-mwms", 2.2)]]
    result = {"model": "m", "compute_s": 0.25, "layout": "dedicated", "command": "c",
              "sweep": rows}
    lines = sweep_table.sweep_table(result).splitlines()
    assert lines[0] == "| workers / PS | Gbit/s | fifo | tf-mwms | ideal s |"
    assert lines[2] == "| 4 / 1 | 1 | 2.00 | 1.50 | 2.000 |"
    assert lines[3] == "| 8 / 2 | 2.5 | 1.25 | 1.10 | 2.000 |"
    assert lines[-1].endswith("dedicated layout (one PS per 4 workers). From `c`.")


def test_a_transport_table_has_rates_and_cpu_per_gb_of_each_side_per_ps_count():
    from prophet_tf.bench import transport_table

    def run(ps, client, server):  # a 1 GB model: a step moves 2 GB on the wire
        return {"ps": ps,
                "prophet": {"partitions": 4 * ps, "step_s": [2.0, 1.0, 4.0],
                            "client_cpu_s": client, "ps_cpu_s": server},
                "bare": {"step_s": [0.5], "client_cpu_s": 1.0, "server_cpu_s": 0.5}}
    result = {"config": {"model_bytes": 10**9, "variables": 4, "inflight": 4, "reps": 3,
                         "cores": 2},
              "memcpy_s": [0.1, 0.2], "runs": [run(1, 2.0, 3.0), run(2, 1.0, 4.0)]}
    lines = transport_table.transport_table(result).splitlines()
    assert lines[2] == ("| 1 | 4 | 0.50 (0.25–1.00) | 1.00 | 1.50 | 2.50 | 2.00 (2.00–2.00) | "
                        "0.50 | 0.25 | 0.75 |")
    assert lines[3].startswith("| 2 | 8 | 0.50 (0.25–1.00) | 0.50 | 2.00 | 2.50 |")
    assert "A 1000 MB float32 model in 4 variables" in lines[-1]
    assert "memcpy of the model 7.50 (5.00–10.00) GB/s" in lines[-1]
    assert "took turns" not in lines[-1]

    # With a baseline: its row first, both beside the same run's bare gRPC.
    result["runs"][0]["baseline"] = run(1, 4.0, 6.0)["prophet"]
    result["config"].update(commit="bbb", baseline_commit="aaa")
    lines = transport_table.transport_table(result).splitlines()
    assert lines[2] == ("| 1, aaa | 4 | 0.50 (0.25–1.00) | 2.00 | 3.00 | 5.00 | 2.00 (2.00–2.00) | "
                        "0.50 | 0.25 | 0.75 |")
    assert lines[3].startswith("| 1, bbb | 4 | 0.50 (0.25–1.00) | 1.00 | 1.50 | 2.50 | 2.00")
    assert lines[4].startswith("| 2 | 8 |")
    assert lines[-1].endswith("The PS processes of commits aaa and bbb took turns step by step.")


def test_a_grpc_floor_table_splits_cpu_by_side_except_where_both_ends_are_one_figure():
    from prophet_tf.bench import transport_table

    def pair(client, server, client_cpu, server_cpu):  # a 1 GB model: 2 GB on the wire
        return {"client": client, "server": server, "step_s": [1.0, 2.0, 4.0],
                "client_cpu_s": client_cpu, "server_cpu_s": server_cpu}
    result = {"config": {"model_bytes": 10**9, "inflight": 4, "reps": 3, "cores": 2,
                         "grpc_cpp": "1.51.1", "grpcio": "1.60.0", "commit": "abc"}}
    one = {"c++/c++": pair("c++", "c++", 0.6, 0.8), "tcp/tcp": pair("tcp", "tcp", 0.9, 0.0),
           "tf-ring/tf-ring": pair("tf-ring", "tf-ring", 7.0, 0.0)}
    result["runs"] = [{"ps": 1, "pairs": one},
                      {"ps": 2, "pairs": {"grpcio/c++": pair("grpcio", "c++", 1.0, 0.4)}}]
    lines = transport_table.grpc_floor_table(result).splitlines()
    assert lines[0] == ("| servers | client / server | GB/s | CPU-s/GB client | CPU-s/GB servers | "
                        "CPU-s/GB both |")
    assert lines[2] == "| 1 | c++ / c++ | 0.50 (0.25–1.00) | 0.30 | 0.40 | 0.70 |"
    assert lines[3] == "| 1 | TCP sockets, no gRPC | 0.50 (0.25–1.00) | – | – | 0.45 |"
    assert lines[4] == ("| 1 | TensorFlow's ring (2 workers) | 0.50 (0.25–1.00) | – | – | "
                        "3.50 |")
    assert lines[5] == "| 2 | grpcio / c++ | 0.50 (0.25–1.00) | 0.50 | 0.20 | 0.70 |"
    assert lines[-1].endswith("gRPC C++ 1.51.1, grpcio 1.60.0; commit abc.")


def test_a_grpc_messages_table_has_each_pairs_cpu_and_wall_per_message():
    from prophet_tf.bench import transport_table

    # 500 pushes and 500 pulled messages a step: 1000 messages.
    pairs = {"c++/grpcio": {"client": "c++", "server": "grpcio", "step_s": [0.3, 0.1, 0.2],
                            "client_cpu_s": 0.05, "server_cpu_s": 0.15}}
    result = {"config": {"inflight": 4, "reps": 3, "grpc_cpp": "1.51.1", "grpcio": "1.60.0",
                         "commit": "abc"},
              "messages": {"count": 500, "bytes": 1000, "pairs": pairs}}
    lines = transport_table.grpc_messages_table(result).splitlines()
    assert lines[2] == "| c++ / grpcio | 50 | 150 | 200 | 200 (100–300) |"
    assert lines[-1].startswith("Per message, in steps of 500 pushes of 1000 bytes to one server")
    assert "over the 1000 messages" in lines[-1]


def test_a_speed_table_has_each_checkouts_wall_cpu_and_step_times():
    from prophet_tf.bench import speed_table

    def run(wall, cpu, fifo):
        return {"wall_s": wall, "cpu_s": cpu, "step_time_s": {"fifo": fifo, "prophet": 0.25}}
    result = {"config": {"command": "prophet-tf simulate --workers 64", "reps": 3, "cores": 2,
                         "commits": {"baseline": "aaa", "this": "bbb+"}},
              "runs": {"baseline": [run(80.0, 150.0, 0.3), run(60.0, 110.0, 0.3),
                                    run(70.0, 120.0, 0.3)],
                       "this": [run(50.0, 95.0, 0.25), run(52.0, 97.0, 0.2649),
                                run(49.0, 93.0, 0.2648)]}}
    lines = speed_table.speed_table(result).splitlines()
    assert lines[0] == "| code | commit | wall s | CPU s | fifo step | prophet step |"
    assert lines[2] == ("| baseline | aaa | 70.0 (60.0–80.0) | 120.0 (110.0–150.0) | "
                        "300.00 ms | 250.00 ms |")
    assert lines[3] == "| this | bbb+ | 50.0 (49.0–52.0) | 95.0 (93.0–97.0) | 264.80 ms | 250.00 ms |"
    assert lines[-1].startswith("`prophet-tf simulate --workers 64`, 3 runs per checkout in turns")
    assert "callgrind" not in lines[-1]
    # Counted under callgrind: the instructions' median, in billions, beside the times.
    result["config"]["instructions"] = True
    for reps, counts in zip(result["runs"].values(), ([9.8e9, 9.9e9, 9.7e9], [9.5e9] * 3)):
        for r, n in zip(reps, counts):
            r["instructions"] = n
    lines = speed_table.speed_table(result).splitlines()
    assert lines[0].startswith("| code | commit | wall s | CPU s | G instructions | fifo step |")
    assert lines[1] == "|---|---|---|---|---|---|---|"
    assert lines[2].split(" | ")[4] == "9.800"
    assert lines[3].split(" | ")[4] == "9.500"
    assert "under callgrind" in lines[-1]


def test_a_leads_table_has_each_run_s_offset_and_answer_leads():
    from prophet_tf.bench import leads_table

    lead = {"count": 9, "median_ms": 50.04, "p10_ms": 9.5, "p90_ms": 66.0}
    result = {"command": "c", "answer_leads": {
        "tl/fifo-1": {"unmatched": 0, "same_host": dict(lead, median_ms=0.1), "other_host": lead},
        "tl/p3-2": {"unmatched": 0, "same_host": None, "other_host": lead}},
        "phase_offsets": {"tl/fifo-1": {"1": {"median_ms": 33.5, "min_ms": -7.1,
                                              "max_ms": 63.6}}}}
    lines = leads_table.leads_table(result).splitlines()
    assert lines[2] == "| fifo-1 | +33.5 (-7.1 to +63.6) | 0.1 (9.5–66.0) | 50.0 (9.5–66.0) |"
    assert lines[3] == "| p3-2 | – | – | 50.0 (9.5–66.0) |"
    assert lines[-1].endswith("From `c`.")
    with pytest.raises(ValueError, match="answer_leads"):
        leads_table.leads_table({"command": "c"})


def test_a_modes_table_has_each_run_s_steps_together_and_apart():
    from prophet_tf.bench import leads_table

    result = {"command": "c", "phase_modes": {
        "tl/fifo-1": {"apart_ms": 40.0, "together": {"steps": 2, "step_ms": 221.04,
                                                     "spread_ms": 12.0},
                      "apart": {"steps": 19, "step_ms": 273.0, "spread_ms": 68.4}},
        "tl/prophet-2": {"apart_ms": 40.0, "together": {"steps": 21, "step_ms": 214.0,
                                                        "spread_ms": 10.0},
                         "apart": {"steps": 0, "step_ms": None, "spread_ms": None}}}}
    lines = leads_table.modes_table(result).splitlines()
    assert lines[2] == "| fifo-1 | 2 | 221.0 | 19 | 273.0 | 68 |"
    assert lines[3] == "| prophet-2 | 21 | 214.0 | 0 | – | – |"
    assert "at most 40 ms apart" in lines[-1] and lines[-1].endswith("From `c`.")
    result["push_order"] = {"tl/fifo-1": {"behind": 116, "overtook": 7}}
    lines = leads_table.modes_table(result).splitlines()
    assert lines[0].endswith("| pushes sent behind another | ended first |")
    assert lines[2] == "| fifo-1 | 2 | 221.0 | 19 | 273.0 | 68 | 116 | 7 |"
    assert lines[3] == "| prophet-2 | 21 | 214.0 | 0 | – | – | – | – |"
    with pytest.raises(ValueError, match="phase_modes"):
        leads_table.modes_table({"command": "c", "answer_leads": {}})
