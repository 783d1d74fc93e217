"""Keras' answers under prophet_tf.Strategy: what fit, evaluate and predict report.

`answers_worker.py` trains on 2 workers (`prophet-tf launch`) with validation
data, EarlyStopping and ReduceLROnPlateau on val_loss, then evaluates and
predicts on 27 rows (a last batch of 3: 1 + 2 rows). Every worker must
report what single-process Keras reports on the global batch (run here, in
the test process): the same per-batch and per-epoch logs, the same stopping
epoch, learning rates and weights, the same evaluate results and every
predicted row, in order.
"""
from __future__ import annotations

import json
import pathlib
import time

import numpy as np
import pytest

from cluster import HERE, assert_close
from scripts import launch_script

WORKER = HERE / "answers_worker.py"
WORKERS = 2
TIMEOUT = 150.0


def launch(out: pathlib.Path, *worker_args: str) -> tuple[int | None, str]:
    """`prophet-tf launch --workers 2 --ps 1 -- python answers_worker.py --out OUT ARGS`."""
    return launch_script(WORKER, out.parent / f"{out.name}.log", ["--out", str(out), *worker_args],
                         workers=WORKERS, timeout=TIMEOUT)


def load(out: pathlib.Path, name: str) -> tuple[dict, dict]:
    info = json.loads((out / f"{name}.json").read_text())
    with np.load(out / f"{name}.npz") as f:
        return info, dict(f)


_RUNS: dict = {}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """run(steps_per_execution) -> (2-worker cluster's [(info, arrays)] per worker,
    single-process reference (info, arrays)); each made once per module."""
    def run(steps_per_execution: int = 1):
        if steps_per_execution not in _RUNS:
            import answers_worker

            flag = ["--steps-per-execution", str(steps_per_execution)]
            single = tmp_path_factory.mktemp(f"single{steps_per_execution}")
            answers_worker.main(["--single", "--out", str(single), *flag])
            out = tmp_path_factory.mktemp(f"answers{steps_per_execution}") / "run"
            start = time.monotonic()
            code, log = launch(out, *flag)
            assert code == 0, f"exit code {code} after {time.monotonic() - start:.0f} s:\n{log}"
            workers = [load(out, f"worker{i}") for i in range(WORKERS)]
            for index, (info, _) in enumerate(workers):
                assert "error" not in info, f"worker {index}: {info['error']['traceback']}"
            _RUNS[steps_per_execution] = workers, load(single, "single")
        return _RUNS[steps_per_execution]
    return run


def assert_logs_equal(actual: dict, expected: dict, what: str) -> None:
    assert sorted(actual) == sorted(expected), f"{what}: keys {sorted(actual)}"
    for key in expected:
        assert_close(actual[key], expected[key], f"{what}[{key!r}]")


def assert_fit_matches(workers, reference) -> None:
    expected, _ = reference
    for index, (info, _) in enumerate(workers):
        assert info["epochs_run"] == expected["epochs_run"], (index, info["history"])
        assert info["stopped_epoch"] == expected["stopped_epoch"], index
        assert_logs_equal(info["history"], expected["history"], f"worker {index}: history")
        assert len(info["batches"]) == len(expected["batches"])
        for step, (a, e) in enumerate(zip(info["batches"], expected["batches"])):
            assert_logs_equal(a, e, f"worker {index}: logs of batch {step}")
    # Identical on every worker, not merely close.
    assert workers[0][0]["history"] == workers[1][0]["history"]
    assert workers[0][0]["batches"] == workers[1][0]["batches"]


def assert_weights_match(workers, reference) -> None:
    _, expected = reference
    for index, (_, arrays) in enumerate(workers):
        for j in range(sum(k.startswith("t") for k in expected)):
            assert_close(arrays[f"t{j}"], expected[f"t{j}"], f"worker {index}: weight {j}")


def assert_evaluate_predict_match(workers, reference) -> None:
    expected_info, expected = reference
    assert expected["predict"].shape[0] == 27
    for index, (info, arrays) in enumerate(workers):
        assert_logs_equal(info["evaluate"], expected_info["evaluate"],
                          f"worker {index}: evaluate")
        np.testing.assert_allclose(arrays["predict"], expected["predict"], rtol=1e-5, atol=1e-6,
                                   err_msg=f"worker {index}: predict")
    assert workers[0][0]["evaluate"] == workers[1][0]["evaluate"]
    np.testing.assert_array_equal(workers[0][1]["predict"], workers[1][1]["predict"])


@pytest.mark.timeout(TIMEOUT + 120)
def test_fit_logs_are_whole_data_and_early_stopping_agrees(runs):
    workers, reference = runs()
    expected, _ = reference
    # The reference must exercise what is tested: a stop before the last epoch and a
    # learning rate reduced while training went on.
    assert expected["epochs_run"] < 12, expected["history"]
    assert len(set(expected["history"]["learning_rate"])) > 1, expected["history"]
    assert_fit_matches(workers, reference)


@pytest.mark.timeout(TIMEOUT + 120)
def test_reduce_lr_on_plateau_trains_like_single_process(runs):
    assert_weights_match(*runs())


@pytest.mark.timeout(TIMEOUT + 120)
def test_evaluate_and_predict_cover_every_row_in_order(runs):
    assert_evaluate_predict_match(*runs())


@pytest.mark.timeout(2 * TIMEOUT + 120)
def test_steps_per_execution_above_one_is_exact(runs):
    """3 steps per execution over 4 training batches: a full loop, then a partial one."""
    workers, reference = runs(3)
    assert len(reference[0]["batches"]) < len(runs(1)[1][0]["batches"])  # fewer callbacks
    assert_fit_matches(workers, reference)
    assert_weights_match(workers, reference)
    assert_weights_match(workers, runs(1)[1])  # the same training as one step at a time
    assert_evaluate_predict_match(workers, reference)
