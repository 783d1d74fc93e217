"""Saved models under prophet_tf.Strategy hold the PS's optimizer state and resume exactly.

`resume_worker.py` trains one epoch (4 steps of Adam) on 2 workers with
ModelCheckpoint and BackupAndRestore and saves the model; then

- the files hold the optimizer state of single-process Keras after 4 steps
  (moments and iteration count), not the workers' untrained copy;
- `keras.models.load_model` + one more epoch, single-process (here) or on a new
  cluster, and BackupAndRestore on a new cluster, end with the weights of
  single-process Keras trained 8 steps without a break.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from cluster import HERE, assert_close
from scripts import launch_script

WORKER = HERE / "resume_worker.py"
TIMEOUT = 150.0


def weights(path) -> list[np.ndarray]:
    with np.load(path) as f:
        return [f[f"t{j}"] for j in range(len(f.files))]


@pytest.fixture(scope="module")
def reference():
    """Single-process Keras: optimizer variables after 1 epoch, weights after 2."""
    import resume_worker as rw
    import keras_worker as kw

    kw.limit_threads()
    kw.select_keras("keras3")
    model = rw.build()
    rw.fit(model, 1)
    after_one = [np.array(v.numpy()) for v in model.optimizer.variables]
    rw.fit(model, 1)
    return after_one, [v.numpy() for v in model.trainable_variables]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The three phases, in order, on fresh clusters; returns the output directory."""
    out = tmp_path_factory.mktemp("saved")
    for phase in ("first", "load", "backup"):
        code, log = launch_script(WORKER, out / f"{phase}.log",
                                  ["--phase", phase, "--out", str(out)], timeout=TIMEOUT)
        assert code == 0, f"{phase}: exit code {code}:\n{log}"
        for index in range(2):
            error = out / f"{phase}-worker{index}.error"
            assert not error.exists(), f"{phase}, worker {index}:\n{error.read_text()}"
    return out


def assert_optimizer_state(optimizer, expected, what: str) -> None:
    actual = [np.array(v.numpy()) for v in optimizer.variables]
    assert len(actual) == len(expected), what
    assert int(optimizer.iterations.numpy()) == 4, what
    for j, (a, e) in enumerate(zip(actual, expected)):
        assert_close(a, e, f"{what}: optimizer variable {j} ({optimizer.variables[j].path})")


@pytest.mark.timeout(3 * TIMEOUT + 120)
def test_saved_files_hold_the_ps_optimizer_state(runs, reference):
    import keras
    import resume_worker as rw

    expected, _ = reference
    for index in range(2):
        mine = runs / f"w{index}"
        for name in ("saved.keras", "checkpoint.keras"):
            if name == "saved.keras" and not (mine / name).exists():
                continue
            model = keras.models.load_model(mine / name)
            assert_optimizer_state(model.optimizer, expected, f"worker {index}: {name}")
        backup = [f for f in os.listdir(mine / "backup") if f.endswith(".weights.h5")]
        assert backup, os.listdir(mine / "backup")
        model = rw.build()
        model.optimizer.build(model.trainable_variables)
        model.load_weights(mine / "backup" / backup[0])
        assert_optimizer_state(model.optimizer, expected, f"worker {index}: backup")


@pytest.mark.timeout(3 * TIMEOUT + 120)
def test_load_model_and_fit_single_process_continues_exactly(runs, reference):
    import keras
    import resume_worker as rw

    _, expected = reference
    model = keras.models.load_model(runs / "w0" / "saved.keras")
    rw.fit(model, 1)
    for j, (a, e) in enumerate(zip(model.trainable_variables, expected)):
        assert_close(a.numpy(), e, f"single-process resume: weight {j}")


@pytest.mark.timeout(3 * TIMEOUT + 120)
@pytest.mark.parametrize("phase", ["load", "backup"])
def test_a_new_cluster_continues_exactly(runs, reference, phase):
    _, expected = reference
    for index in range(2):
        actual = weights(runs / f"{phase}-worker{index}.npz")
        assert len(actual) == len(expected)
        for j, (a, e) in enumerate(zip(actual, expected)):
            assert_close(a, e, f"{phase}: worker {index}, weight {j}")
