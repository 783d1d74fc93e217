"""tf-mwms in the simulator: the ring all-reduce as TensorFlow runs it, its one fitted
number, and its predictions of the bench's recorded tf-mwms runs."""
import json
import pathlib
import subprocess
import sys
import time

import pytest

from process_helpers import children, kill_leftovers, wait_gone
from simulate_helpers import toy_profile
from prophet_tf.bench import (ideal, saved_profiles, simulate_cli, simulate_network, simulate_ring,
                              simulate_sweep)
from prophet_tf.bench import simulate as simulate_lib

pytestmark = pytest.mark.timeout(60)

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


# Late layers big, early ones small; the first gradient (of the last variable) is
# ready long before the last (of the first variable).
TOY = toy_profile([48_000, 480_000, 4_800_000, 48_000], [0.02, 0.02, 0.005, 0.001],
               [0.08, 0.05, 0.01, 0.002])
MODEL_BYTES = sum(v["nbytes"] for v in TOY["variables"])


@pytest.mark.parametrize("workers", [2, 3, 4, 8])
def test_every_link_carries_2_w_minus_1_over_w_of_the_model_each_way(workers):
    r = simulate_ring.simulate_ring(TOY, workers, workers, 100, layout="colocated")
    for direction in ("sent", "received"):
        counted = r["link_bytes_per_step"][direction]
        assert len(counted) == workers
        assert counted == pytest.approx([2 * (workers - 1) / workers * MODEL_BYTES] * workers,
                                        abs=4 * workers)
    assert [p["steps"] for p in r["packs"]] == [2 * (workers - 1)]
    # Each step, every host sends one chunk per subdivision and receives one.
    for transfers in simulate_ring.ring_steps(MODEL_BYTES, workers):
        assert sorted(t[0] for t in transfers) == sorted(t[1] for t in transfers) == \
            sorted(list(range(workers)) * (len(transfers) // workers))
    # A ring of one sends nothing: the step is the compute.
    alone = simulate_ring.simulate_ring(TOY, 1, 1, 100)
    assert alone["step_time_s"] == pytest.approx(TOY["compute_s"])
    assert alone["link_bytes_per_step"] == {"sent": [0], "received": [0]}


def test_step_time_grows_with_the_bytes_at_a_fixed_bandwidth():
    def ring_s(profile, mbit=100):
        r = simulate_ring.simulate_ring(profile, 4, 4, mbit, layout="colocated",
                                        link_efficiency=1.0, framing=1.0)
        return r["step_time_s"] - profile["compute_s"]

    scaled = [toy_profile([b * k for b in (48_000, 480_000, 4_800_000, 48_000)],
                       [0.02, 0.02, 0.005, 0.001], [0.08, 0.05, 0.01, 0.002]) for k in (1, 2, 4)]
    times = [ring_s(p) for p in scaled]
    assert times[0] < times[1] < times[2]
    assert times == pytest.approx([times[0], 2 * times[0], 4 * times[0]], rel=1e-6)
    # The ring's bytes over the link rate: 2(W-1)/W of the model per link.
    assert times[0] == pytest.approx(1.5 * MODEL_BYTES * 8 / 100e6, rel=1e-6)
    assert ring_s(TOY, 50) == pytest.approx(2 * times[0], rel=1e-6)
    # What the ring's transfers get of the rate stretches only the link time.
    slow = simulate_ring.simulate_ring(TOY, 4, 4, 100, link_efficiency=0.5, framing=1.0)
    assert slow["step_time_s"] - TOY["compute_s"] == pytest.approx(2 * times[0], rel=1e-6)


@pytest.mark.parametrize("bytes_per_pack", [0, 100_000])
def test_a_pack_starts_once_its_gradients_are_ready_and_packs_go_one_by_one(bytes_per_pack):
    r = simulate_ring.simulate_ring(TOY, 3, 3, 100, latency_ms=1.0, bytes_per_pack=bytes_per_pack)
    forward = TOY["forward_s"]
    ready = [forward + v["backward_ready_s"] for v in TOY["variables"]]
    assert r["gradients_ready_s"] == pytest.approx(max(ready))
    steps = r["timeline"]
    packs = simulate_ring.packs(TOY, bytes_per_pack)
    assert [p["start_s"] for p in r["packs"]] == [
        s["start_s"] for s in steps if s is next(t for t in steps if t["pack"] == s["pack"])]
    end = 0.0
    for pack, made in zip(packs, r["packs"]):
        # Its last gradient, or the pack before it, whichever is later.
        assert made["start_s"] == pytest.approx(max(end, max(ready[i] for i in pack)))
        end = [s for s in steps if s["pack"] == packs.index(pack)][-1]["end_s"]
    if bytes_per_pack:  # the first pack (the last variables) leaves during backprop
        assert len(packs) == 3 and r["packs"][0]["start_s"] < max(ready)
    else:
        assert steps[0]["start_s"] == pytest.approx(max(ready))  # not at the first gradient
    within = [(a, b) for a, b in zip(steps, steps[1:]) if a["pack"] == b["pack"]]
    assert all(b["start_s"] == a["end_s"] for a, b in within)
    assert [s["pack"] for s in steps] == sorted(s["pack"] for s in steps)
    assert r["step_time_s"] == steps[-1]["end_s"]  # the apply takes no time
    assert len(steps) == len(r["packs"]) * 2 * (3 - 1)


def test_the_pack_sizes_the_bench_measured_are_predicted_within_10_percent():
    """The 2026-12-05 run measured tf-mwms with four pack sizes (one run each):
    smaller packs were faster, as their all-reduces overlap backprop."""
    config = json.loads((BENCHMARKS / "bench-colocated-2026-12-05.json").read_text())["config"]
    measured = {s["bytes_per_pack"]: s["step_time_s"] for s in config["tf_mwms_search"]}
    predicted = {n: simulate_ring.validate_row(
        config, {"scheduler": f"tf-mwms:bytes_per_pack={n}", "step_time_s": t})["predicted_s"]
        for n, t in measured.items()}
    for n in measured:
        assert abs(predicted[n] / measured[n] - 1) < 0.10, (n, predicted[n], measured[n])
    assert predicted[1 << 20] < predicted[0] == predicted[16 << 20]  # 16 MiB: one pack


def test_packs_and_subdivisions_follow_tensorflow():
    # Last variable first; a new pack once the current one holds more than bytes_per_pack.
    assert simulate_ring.packs(TOY) == [[3, 2, 1, 0]]
    assert simulate_ring.packs(TOY, 100_000) == [[3, 2], [1], [0]]
    assert simulate_ring.packs(TOY, 10_000_000) == [[3, 2, 1, 0]]
    # Chunks over 4 MiB are cut in two subdivisions, never more.
    assert simulate_ring.subdivisions(4_467_880, 2) == 1
    assert simulate_ring.subdivisions(9 * 2**20, 2) == 2
    assert simulate_ring.subdivisions(102_334_368, 2) == 2
    assert len(simulate_ring.ring_steps(102_334_368, 2)[0]) == 2 * 2


def test_a_ring_step_takes_what_the_fluid_model_gives():
    """Every link carries the same flows, so they end together: the step is the
    busiest link's bytes over its rate, as FluidSim shares them."""
    workers, rate = 3, 1e6
    transfers = simulate_ring.ring_steps(MODEL_BYTES, workers)[0]
    capacity = {("w", h, d): rate for h in range(workers) for d in ("up", "down")}
    sim = simulate_network.FluidSim(capacity)
    ends = []
    for sender, receiver, nbytes in transfers:
        sim.start_flow(nbytes, (("w", sender, "up"), ("w", receiver, "down")),
                       lambda: ends.append(sim.now))
    sim.run(until=lambda: len(ends) == len(transfers))
    r = simulate_ring.simulate_ring(TOY, workers, workers, rate * 8 / 1e6, framing=1.0,
                                    link_efficiency=1.0)
    first = r["timeline"][0]
    assert max(ends) == pytest.approx(first["end_s"] - first["start_s"], rel=1e-6)


def test_specs_and_bad_arguments_name_what_was_received():
    assert simulate_ring.parse_spec("tf-mwms") == {}
    assert simulate_ring.parse_spec("tf-mwms:bytes_per_pack=4_194_304") == {
        "bytes_per_pack": 4194304}
    assert simulate_ring.parse_spec("prophet:blocks_in_flight=4") is None
    for bad in ("tf-mwms:bytes_per_pack=-1", "tf-mwms:pack=1", "tf-mwms:bytes_per_pack"):
        with pytest.raises(ValueError, match="Received"):
            simulate_ring.parse_spec(bad)
    with pytest.raises(ValueError, match="link_efficiency=0"):
        simulate_ring.simulate_ring(TOY, 2, 2, 100, link_efficiency=0)
    with pytest.raises(ValueError, match="workers=0"):
        simulate_ring.simulate_ring(TOY, 0, 1, 100)


@pytest.mark.parametrize("layout", ["colocated", "dedicated"])
def test_simulate_runs_tf_mwms_beside_the_ps_schedulers(layout, tmp_path, capsys):
    out = tmp_path / "sim.json"
    ps = "2" if layout == "colocated" else "1"
    assert simulate_cli.main(["--model", "cnn", "--workers", "2", "--ps", ps, "--layout", layout,
                              "--bandwidth-mbit", "200", "--schedulers", "fifo,tf-mwms",
                              "--json", str(out)]) == 0
    rows = {r["scheduler"]: r for r in json.loads(out.read_text())["results"]}
    assert list(rows) == ["fifo", "tf-mwms"]
    ring = rows["tf-mwms"]
    # The ring runs over the worker hosts whatever the PS layout; the bound is the layout's.
    expected = simulate_ring.simulate_ring(saved_profiles.load_profile("cnn"), 2, int(ps), 200.0,
                                           layout=layout)
    assert ring["step_time_s"] == pytest.approx(expected["step_time_s"])
    assert ring["ideal_step_time_s"] == rows["fifo"]["ideal_step_time_s"]
    assert ring["ideal"]["layout"] == layout
    assert "tf-mwms" in capsys.readouterr().out
    assert simulate_cli.main(["--model", "cnn", "--schedulers", "tf-mwms:bogus=1"]) == 2
    assert "tf-mwms takes bytes_per_pack" in capsys.readouterr().err


def test_a_sweep_has_a_tf_mwms_row_per_cell():
    rows = simulate_sweep.sweep(TOY, ["fifo", "tf-mwms:bytes_per_pack=100000"], [2, 4], [100],
                                num_ps=1)
    ring = [r for r in rows if r["scheduler"].startswith("tf-mwms")]
    assert [r["workers"] for r in ring] == [2, 4]
    for r in ring:
        alone = simulate_ring.simulate_ring(TOY, r["workers"], 1, 100, bytes_per_pack=100_000)
        assert r["step_time_s"] == alone["step_time_s"]


@pytest.mark.parametrize("run", ["bench-colocated.json", "bench-colocated-w3.json",
                                 "bench-colocated-2026-12-05.json"])
def test_validate_predicts_the_recorded_tf_mwms_runs_within_10_percent(run):
    """Two and three workers, neither of them among the runs the link efficiency
    was fitted on."""
    assert run not in simulate_ring.FITTED_ON
    bench = json.loads((BENCHMARKS / run).read_text())
    rows = simulate_cli.validate(bench, None, schedulers=["tf-mwms"])
    assert [r["scheduler"] for r in rows] == ["tf-mwms"]
    assert abs(rows[0]["error"]) < 0.10, rows[0]
    assert rows[0]["link_efficiency"] == simulate_ring.LINK_EFFICIENCY
    assert rows[0]["measured_s"] == next(r["step_time_s"] for r in bench["results"]
                                         if r["scheduler"] == "tf-mwms")


def test_the_link_efficiency_is_the_fit_on_the_runs_it_names():
    runs = simulate_ring.load_runs(BENCHMARKS / name for name in simulate_ring.FITTED_ON)
    assert len(runs) == 25  # every cell of the three suites
    fitted = simulate_ring.fit_link_efficiency(runs)
    assert fitted == pytest.approx(simulate_ring.LINK_EFFICIENCY, abs=0.005)
    # The fit is the least squares of the relative errors: nudging it worsens them.
    def squares(efficiency):
        return sum((simulate_ring.validate_row(c, r, link_efficiency=efficiency)["error"]) ** 2
                   for c, r in runs)
    assert squares(fitted) < min(squares(fitted - 0.02), squares(fitted + 0.02))
    with pytest.raises(ValueError, match="Received none"):
        simulate_ring.fit_link_efficiency([])


def test_the_ring_never_beats_the_colocated_ideal_bound():
    """With PS tasks on the worker hosts the bound holds for the ring too."""
    for workers in (2, 3, 8):
        for mbit in (None, 10, 1000):
            r = simulate_ring.simulate_ring(TOY, workers, workers, mbit, layout="colocated",
                                            link_efficiency=1.0, framing=ideal.TCP_FRAMING)
            assert r["step_time_s"] >= r["ideal_step_time_s"] * (1 - 1e-9)


def test_a_colocated_sweep_puts_a_ps_task_on_every_worker_host(tmp_path, capsys):
    """--sweep --layout colocated: W PS tasks at W workers, the layout's ideal bound (a PS
    task's link carries its own worker's share too), recorded in the JSON."""
    out = tmp_path / "sweep.json"
    assert simulate_cli.main(["--model", "cnn", "--sweep", "--layout", "colocated",
                              "--sweep-workers", "2,3", "--schedulers", "fifo,tf-mwms",
                              "--iterations", "10", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["layout"] == "colocated"
    assert sorted({(r["workers"], r["ps"]) for r in result["sweep"]}) == [(2, 2), (3, 3)]
    cnn = saved_profiles.load_profile("cnn")
    for r in result["sweep"]:
        if r["scheduler"] == "fifo":
            alone = simulate_lib.simulate(cnn, "fifo", r["workers"], r["workers"],
                                          r["bandwidth_mbit"], layout="colocated", iterations=10)
            assert r["ideal_step_time_s"] == alone["ideal_step_time_s"]
    with pytest.raises(SystemExit):
        simulate_cli.main(["--sweep", "--sweep-workers", "2,0"])
    assert "Received: '2,0'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        simulate_cli.main(["--jobs", "0"])
    assert "--jobs takes a positive count. Received: 0" in capsys.readouterr().err


def test_a_sweep_without_fifo_has_no_speedup_and_refuses_the_fifo_plot(tmp_path, capsys):
    out = tmp_path / "sweep.json"
    assert simulate_cli.main(["--model", "cnn", "--sweep", "--sweep-workers", "2",
                              "--schedulers", "p3", "--iterations", "10",
                              "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["sweep"]
    assert [(r["scheduler"], r["bandwidth_mbit"]) for r in rows] == [
        ("p3", mbit) for mbit in (1000, 2500, 5000, 10000, 25000)]  # the sweep's cells
    assert all(r["speedup_vs_fifo"] is None for r in rows)
    code = simulate_cli.main(["--model", "cnn", "--sweep", "--sweep-workers", "2",
                              "--schedulers", "p3", "--plot", str(tmp_path / "s.png")])
    assert code != 0
    assert "must name fifo. Received: --schedulers p3" in capsys.readouterr().err
    assert not (tmp_path / "s.png").exists()


def test_a_sweep_in_two_processes_gives_the_rows_of_one():
    """The cells run in child processes, the costliest first; the rows
    come back in the grid's order with the values of a single process."""
    args = (TOY, ["fifo", "prophet", "tf-mwms"], [3, 2], [100, 400])
    alone = simulate_sweep.sweep(*args, layout="colocated")
    assert simulate_sweep.sweep(*args, layout="colocated", processes=2) == alone
    assert [(r["workers"], r["bandwidth_mbit"]) for r in alone[:6:3]] == [(3, 100), (3, 400)]
    with pytest.raises(ValueError, match="processes must be at least 1. Received: 0"):
        simulate_sweep.simulate_specs([{}, {}], 0)


def test_the_costliest_simulations_start_first():
    """Ordered by the messages the simulated workers send: every worker colocated,
    one dedicated; more partitions cost more; the ring model next to nothing."""
    profile = saved_profiles.load_profile("resnet50")

    def cost(name, workers, num_ps, layout):
        return simulate_sweep.estimated_cost(dict(profile=profile, name=name, options={},
                                                  workers=workers, num_ps=num_ps,
                                                  layout=layout))
    # 64 dedicated workers are one simulated worker: cheaper than 8 colocated ones
    # (1.0-1.3 CPU-s against 4.4-7.6 measured), which the cluster's size ranked first.
    assert cost("fifo", 64, 16, "dedicated") < cost("fifo", 8, 8, "colocated")
    # Prophet cuts ResNet-50 finer than FIFO over 64 PS tasks (725 partitions against 469).
    assert cost("prophet", 64, 64, "colocated") == 64 * 725
    assert cost("fifo", 64, 64, "colocated") == 64 * 469
    assert cost("tf-mwms", 128, 128, "colocated") == 0


def test_the_simulation_processes_end_with_the_command(tmp_path):
    """A `prophet-tf simulate` killed mid-run leaves no simulation running."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "prophet_tf.bench.simulate_cli", "--model", "resnet50",
         "--workers", "32", "--jobs", "2", "--schedulers", "fifo,p3"],  # 20 s or more each
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pool = set()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the pool's two processes
            pool = {c for c in children(proc.pid)
                    if b"multiprocessing" in open(f"/proc/{c}/cmdline", "rb").read()
                    and b"resource_tracker" not in open(f"/proc/{c}/cmdline", "rb").read()}
            if len(pool) == 2:
                break
            time.sleep(0.1)
        assert len(pool) == 2, pool
        proc.kill()
        proc.wait(timeout=30)
        assert wait_gone(pool, timeout=10) == []  # not their simulations' end
    finally:
        proc.kill()
        proc.wait(timeout=30)
        kill_leftovers(pool)
