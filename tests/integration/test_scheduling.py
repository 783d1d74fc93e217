"""Scheduling changes when bytes move, never what is computed; and the timeline shows it."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from prophet_tf.engine.schedulers import SCHEDULERS
from prophet_tf.tools.launch import launch

WORKER = os.path.join(os.path.dirname(__file__), "mlp_worker.py")
STEPS = 12  # Prophet plans after 2 warm-up and 5 profiled iterations.
# make test trains FIFO (the reference) and Prophet; P3 and ByteScheduler are long
# variants (make test's budget: each run is three processes that import TensorFlow).
# Their plans have unit tests (test_schedulers.py), and test_distributed_input.py's
# long variant checks their bits with several PS tasks and every input idiom.
FAST_SCHEDULERS = ("fifo", "prophet")
SCHEDULER_PARAMS = [s if s in FAST_SCHEDULERS else pytest.param(s, marks=pytest.mark.slow)
                    for s in SCHEDULERS]


def _run(tmp_path, scheduler, monkeypatch):
    prefix = str(tmp_path / scheduler)
    monkeypatch.setenv("PROPHET_TF_TIMELINE", str(tmp_path / f"timeline-{scheduler}"))
    # One PS task (make test's budget: each task imports TensorFlow): every
    # scheduler still cuts the kernels into its own partitions and blocks. The
    # same check with several PS tasks and every input idiom is the long variant
    # test_distributed_input.py::test_sums_do_not_depend_on_the_scheduler.
    assert launch([sys.executable, WORKER, prefix, str(STEPS)], num_workers=2, num_ps=1,
                  scheduler=scheduler) == 0
    runs = [np.load(f"{prefix}.{i}.npz") for i in range(2)]
    assert all(str(r["scheduler"]) == scheduler for r in runs)
    weights = [[r[f"arr_{k}"] for k in range(sum(f.startswith("arr_") for f in r.files))]
               for r in runs]
    return weights, tmp_path / f"timeline-{scheduler}"


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """Plain single-process Keras on the same model, data and global batch."""
    prefix = str(tmp_path_factory.mktemp("single") / "mlp")
    subprocess.run([sys.executable, WORKER, prefix, str(STEPS), "--single"], check=True,
                   timeout=300)
    r = np.load(f"{prefix}.single.npz")
    return [r[f"arr_{k}"] for k in range(len(r.files))]


@pytest.fixture(scope="module")
def run_of(tmp_path_factory):
    """run_of(scheduler): one launch per scheduler, shared by the module's tests."""
    done = {}

    def run(scheduler):
        if scheduler not in done:
            with pytest.MonkeyPatch.context() as monkeypatch:
                done[scheduler] = _run(tmp_path_factory.mktemp(scheduler), scheduler,
                                       monkeypatch)
        return done[scheduler]
    return run


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scheduler", SCHEDULER_PARAMS)
def test_every_scheduler_trains_to_the_same_weights(run_of, single, scheduler):
    reference, _ = run_of("fifo")
    weights, _ = run_of(scheduler)
    for worker in weights:
        assert len(worker) == len(reference[0]) == len(single)
        for got, want, alone in zip(worker, reference[0], single):
            # Two workers' sums commute exactly, so the weights are equal to the bit,
            np.testing.assert_array_equal(got, want, err_msg=scheduler)
            # and equal single-process Keras up to float summation order.
            np.testing.assert_allclose(got, alone, rtol=0, atol=1e-5, err_msg=scheduler)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scheduler", SCHEDULER_PARAMS)
def test_timeline_is_valid_and_complete(run_of, scheduler):
    weights, directory = run_of(scheduler)
    num_vars = len(weights[0])
    for worker in range(2):
        with open(directory / f"worker-{worker}.json") as f:
            trace = json.load(f)  # Valid JSON, as Perfetto / chrome://tracing read it.
        events = trace["traceEvents"]
        for e in events:
            assert e["ph"] in ("M", "X", "i") and "pid" in e and "name" in e
            if e["ph"] != "M":
                assert isinstance(e["ts"], float) and e["ts"] > 0
            if e["ph"] == "X":
                assert e["dur"] >= 0
        by_cat = {}
        for e in events:
            by_cat.setdefault(e.get("cat"), []).append(e)
        ready = {(e["args"]["key"], e["args"]["step"]) for e in by_cat["backward"]}
        assert len(ready) == num_vars * STEPS
        forward = {(e["args"]["key"], e["args"]["step"]) for e in by_cat["forward"]}
        assert {(k, s) for k, _ in ready for s in range(STEPS)} <= forward
        pushed = {}
        for e in by_cat["push"]:
            for name in e["args"]["keys"]:
                pushed.setdefault(e["args"]["step"], set()).add(name)
            assert e["args"]["bytes"] > 0
        assert sorted(pushed) == list(range(STEPS))
        assert all(len(names) == num_vars for names in pushed.values())
        pulled_versions = {e["args"]["version"] for e in by_cat["pull"]}
        assert set(range(STEPS + 1)) <= pulled_versions
        assert by_cat["plan"] and by_cat["plan"][0]["args"]["scheduler"] == scheduler
        if scheduler == "prophet":
            plans = [e["args"] for e in by_cat["plan"]]
            assert any(p.get("bursts") for p in plans), plans  # It profiled and planned.
