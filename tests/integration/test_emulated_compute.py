"""Emulated compute: the emulated model's gradients become ready as its profile says,
it computes without using the CPU, and the bench runs it under every framework."""
import json
import os
import subprocess
import sys

import pytest

from prophet_tf.bench import emulated, models, saved_profiles, tuning

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("name, compute_s", [("cnn", 0.3), ("resnet50", 0.6)])
def test_emulated_readiness_matches_the_scaled_profile(name, compute_s):
    import keras

    profile = saved_profiles.load_profile(name)
    scale = compute_s / profile["compute_s"]
    want = saved_profiles.scaled_profile(profile, scale)
    model = emulated.build_emulated_model(profile, keras, scale)
    assert [tuple(v.shape) for v in model.trainable_variables] == \
        [tuple(v["shape"]) for v in profile["variables"]]  # real shapes, forward order
    x, y = emulated.emulated_data(8)
    got = models.profile_model(name, 8, iterations=3, warmup=1, model=model, data=(x, y),
                               loss_fn=keras.losses.MeanSquaredError())
    # Every variable of a layer is ready when the layer's backward gap has passed
    # after the next layer's: its own readiness in the profile, or, where the real
    # backprop was not in reverse layer order, its layer's latest (emulated.py).
    expected, ready = [], 0.0
    for layer in reversed(emulated.emulated_layers(profile, scale)):
        ready += layer["backward_s"]
        expected = [ready] * len(layer["variables"]) + expected
    for v, e in zip(want["variables"], expected):
        assert e >= v["backward_ready_s"] - 1e-9  # never earlier than measured
    assert len(got["variables"]) == len(expected)
    # Never sooner than the emulated times, in every iteration: the first
    # layer's forward counts from the input, each later delay from the one
    # before it, and the backward chain from the forward's end, so the
    # forward takes at least its layers' forward times and the last gradient
    # (the first layer's) is ready at least their backward times later.
    # How close to them it comes is a measurement that moves with the
    # machine's load: benchmarks/bench_emulated_delay.py --models reports it.
    # (Less 1 us: the op rounds its seconds to float32.)
    forward_s = sum(layer["forward_s"] for layer in emulated.emulated_layers(profile, scale))
    assert forward_s == pytest.approx(want["forward_s"])
    assert all(f >= forward_s - 1e-6 for f in got["forward_s_all"]), (got["forward_s_all"],
                                                                      forward_s)
    assert all(f + b >= forward_s + expected[0] - 1e-6
               for f, b in zip(got["forward_s_all"], got["backward_s_all"])), (
        got["forward_s_all"], got["backward_s_all"], forward_s, expected[0])


def test_emulated_layers_keep_every_variable_and_the_total_times():
    profile = saved_profiles.load_profile("inceptionv3")
    layers = emulated.emulated_layers(profile, 2.0)
    shapes = [v["shape"] for layer in layers for v in layer["variables"]]
    assert shapes == [tuple(v["shape"]) for v in profile["variables"]]
    forward = sum(layer["forward_s"] for layer in layers)
    assert forward == pytest.approx(2.0 * profile["forward_s"])
    backward = sum(layer["backward_s"] for layer in layers)
    assert backward == pytest.approx(2.0 * max(v["backward_ready_s"]
                                               for v in profile["variables"]))
    assert all(layer["backward_s"] >= 0 for layer in layers)
    with pytest.raises(ValueError, match="Received: scale=0"):
        emulated.emulated_layers(profile, 0)


def _bench(tmp_path, *options, timeout=280):
    out = tmp_path / "bench.json"
    subprocess.run([sys.executable, "-m", "prophet_tf", "bench", "--compute", "emulated",
                    "--steps", "10", "--reps", "1", *options, "--json", str(out)],
                   check=True, timeout=timeout, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    return json.loads(out.read_text())


def _check(result, compute_s, time_scale):
    c = result["config"]
    assert c["compute"] == "emulated" and c["time_scale"] == time_scale
    assert c["compute_s"] == pytest.approx(compute_s)
    for r in result["results"]:
        assert r["step_time_s"] >= c["compute_s"]  # no run is faster than its compute
        assert r["cluster_step_time_s"] == pytest.approx(r["step_time_s"] / time_scale)
        # Measured for every process of the run (2 workers, and 2 PS tasks for prophet_tf).
        assert len(r["cpu_busy"]) == (2 if r["scheduler"] == "tf-mwms" else 4)
        assert all(0 <= b < 2.5 for b in r["cpu_busy"].values())


@pytest.mark.slow
@pytest.mark.timeout(1000)
def test_bench_runs_an_emulated_paper_model(tmp_path):
    # One prophet_tf run and one counted tf-mwms run, after tf-mwms's four pack-size
    # runs (the only test that measures them): six clusters, 273 s on the 2-core
    # development machine alone, 411 s in make test-long beside the other long tests,
    # and over 540 s there in a slow hour (2026-12-07, when make test took 10:51 instead
    # of 9:28 on the same commit). The limit only stops a hang, so it leaves room for that.
    result = _bench(tmp_path, "--model", "resnet50", "--compute-ms", "150", "--time-scale",
                    "4", "--bandwidth-mbit", "4000", "--schedulers", "prophet,tf-mwms",
                    timeout=900)
    assert result["config"]["link_mbit"] == 1000
    _check(result, 0.6, 4)
    # tf-mwms ran with the fastest pack size of those measured, each measured once.
    search = result["config"]["tf_mwms_search"]
    assert [r["bytes_per_pack"] for r in search] == list(tuning.TF_MWMS_PACK_BYTES)
    assert result["config"]["tf_mwms"] == {"bytes_per_pack": tuning.choose_pack(search)}


# Three bench runs (about 90 s): a long variant, as `make test` must stay under 10 minutes;
# test_bench_smoke.py runs a real-compute bench there.
@pytest.mark.slow
def test_the_smoke_suite_runs_fifo_prophet_and_tf_mwms_emulated_resumes_and_plots(tmp_path):
    """The emulated CNN under FIFO, Prophet and tf-mwms (one suite cell: `prophet-tf bench
    --compute emulated`), kept when the suite runs again, and plotted."""
    out = tmp_path / "suite.json"

    def run_suite():
        return subprocess.run([sys.executable, "-m", "prophet_tf", "bench", "--suite", "smoke",
                               "--json", str(out)], check=True, timeout=280, text=True,
                              capture_output=True,
                              env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")).stdout
    run_suite()
    result = json.loads(out.read_text())
    assert result["complete"] and result["suite"]["name"] == "smoke"
    [cell] = result["cells"]
    assert cell["cell"]["model"] == "cnn" and cell["config"]["compute"] == "emulated"
    # 40 ms at time scale 2: 400 Mbit/s links run at 200 on this machine.
    assert cell["cell"]["time_scale"] == 2 and cell["config"]["link_mbit"] == 200
    _check(cell, 0.08, 2)
    # The shipped profile is named, not copied, and names what ran.
    profile = cell["config"]["profile"]
    assert saved_profiles.is_reference(profile) and profile["name"] == "cnn"
    assert saved_profiles.resolve(profile)["compute_s"] == cell["config"]["compute_s"]
    assert [r["scheduler"] for r in cell["results"]] == ["fifo", "prophet", "tf-mwms"]
    # The cell's wall time covers every run's start-up and timed steps.
    assert cell["wall_s"] > sum(r["startup_s"] + r["step_time_s"] * cell["config"]["steps"]
                                for r in cell["results"]) > 0
    # Run again: the cell is kept, nothing runs, the JSON is unchanged.
    assert "1 cell(s) kept" in run_suite() and json.loads(out.read_text())["cells"] == [cell]
    png = tmp_path / "suite.png"
    subprocess.run([sys.executable, "-m", "prophet_tf", "plot", str(out), "-o", str(png)],
                   check=True, timeout=120)
    assert png.stat().st_size > 10_000
