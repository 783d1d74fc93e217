"""prophet_tf.Strategy with tf_keras (Keras 2) models: real clusters, as test_strategy.

Each cluster runs tests/integration/tf_keras_worker.py on every worker through
`python -m prophet_tf launch`; the PS tasks stay Keras 3. The workers write
their final weights and what they saw to files that the tests compare with
plain single-process tf_keras run here, in the test process, from the same
model/data/optimizer code.

  sgd          2 workers, 1 PS, MLP, numpy arrays        tf.keras, TF_USE_LEGACY_KERAS=1
  momentum     2 workers, 1 PS, MLP, tf.data.Dataset     `import tf_keras`, no TF_USE_LEGACY_KERAS
  adam         2 workers, 2 PS, CNN, tf_keras Sequence   tf.keras, TF_USE_LEGACY_KERAS=1
  schedule     2 workers, 2 PS, MLP, SGD + ExponentialDecay
  bn           2 workers, 1 PS, MLP with BatchNormalization, 3 epochs
  lr_callback  2 workers, 1 PS, momentum, LearningRateScheduler
  misuse       1 worker, 1 PS: each unsupported option in turn, then AdamW with
               weight decay (bias excluded), which must train exactly
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WORKER = HERE / "tf_keras_worker.py"
sys.path.insert(0, str(HERE))
import tf_keras_worker as tkw  # noqa: E402  (imports TensorFlow)

STEPS = 6        # per epoch
BATCH = 4        # per worker
CLUSTER_TIMEOUT = 210.0  # whole launch, TensorFlow imports included, on a busy 2-core box
WATCHDOG = 150.0  # a worker prints its stacks and exits after this long
RTOL = 1e-5

CONFIGS = {
    "sgd": dict(workers=2, ps=1, optimizer="sgd", model="mlp", data="numpy"),
    "momentum": dict(workers=2, ps=1, optimizer="momentum", model="mlp", data="dataset",
                     keras="tf_keras"),
    "adam": dict(workers=2, ps=2, optimizer="adam", model="cnn", data="sequence"),
    "schedule": dict(workers=2, ps=2, optimizer="schedule", model="mlp", data="numpy"),
    "bn": dict(workers=2, ps=1, optimizer="adam", model="bn", data="numpy", epochs=3, steps=4),
    "lr_callback": dict(workers=2, ps=1, optimizer="momentum", model="mlp", data="numpy",
                        epochs=3, steps=3, lr_callback=True),
    "misuse": dict(workers=1, ps=1, optimizer="adamw", model="mlp", data="numpy",
                   scenario="misuse", watchdog=110.0),
}


def child_env(config: dict) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2",
               TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="2", OMP_NUM_THREADS="1",
               PYTHONFAULTHANDLER="1")
    for name in ("TF_CONFIG", "PROPHET_TF_SCHEDULER", "TF_USE_LEGACY_KERAS"):
        env.pop(name, None)
    if config.get("keras", "tf.keras") == "tf.keras":
        env["TF_USE_LEGACY_KERAS"] = "1"  # tf.keras is tf_keras (the PS still uses Keras 3).
    return env


def worker_args(config: dict, out_dir: pathlib.Path) -> list[str]:
    return ["--keras", config.get("keras", "tf.keras"),
            "--scenario", config.get("scenario", "train"), "--optimizer", config["optimizer"],
            "--model", config["model"], "--data", config["data"],
            "--steps", str(config.get("steps", STEPS)), "--epochs", str(config.get("epochs", 1)),
            "--batch", str(BATCH), "--watchdog", str(config.get("watchdog", WATCHDOG)),
            "--out", str(out_dir)] + (["--lr-callback"] if config.get("lr_callback") else [])


def reap(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """SIGTERM (the launcher stops its children), then SIGKILL the process group."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    try:  # Anything left in the session this test started (start_new_session=True).
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if proc.poll() is None:
        proc.wait(10)


@dataclasses.dataclass
class Run:
    name: str
    config: dict
    code: int | None  # None: timed out
    seconds: float
    log: str
    out_dir: pathlib.Path

    def npz(self, index: int, tag: str = "") -> dict:
        with np.load(self.out_dir / f"worker{index}{tag}.npz") as f:
            return dict(f)

    def info(self, index: int) -> dict:
        path = self.out_dir / f"worker{index}.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def describe(self) -> str:
        status = "timed out" if self.code is None else f"exit code {self.code}"
        return f"cluster {self.name!r} {status} after {self.seconds:.0f} s; log tail:\n" + \
            self.log[-6000:]

    def check_ok(self) -> None:
        assert self.code == 0, self.describe()

    def trainable(self, index: int, tag: str = "") -> list[np.ndarray]:
        arrays = self.npz(index, tag)
        return [arrays[f"t{j}"] for j in range(sum(k.startswith("t") for k in arrays))]


_RUNS: dict[str, Run] = {}


def cluster_run(name: str, tmp_root: pathlib.Path) -> Run:
    """Runs CONFIGS[name] with `python -m prophet_tf launch` once; later calls reuse it."""
    if name in _RUNS:
        return _RUNS[name]
    config = CONFIGS[name]
    out_dir = tmp_root / name
    out_dir.mkdir(parents=True)
    log_path = tmp_root / f"{name}.log"
    command = [sys.executable, "-m", "prophet_tf", "launch", "--workers", str(config["workers"]),
               "--ps", str(config["ps"]), "--", sys.executable, str(WORKER),
               *worker_args(config, out_dir)]
    start = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                env=child_env(config), cwd=ROOT, start_new_session=True)
    try:
        code = proc.wait(CLUSTER_TIMEOUT)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        reap(proc)
    run = Run(name, config, code, time.monotonic() - start,
              log_path.read_text(errors="replace"), out_dir)
    _RUNS[name] = run
    return run


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tf_keras_clusters")
    return lambda name: cluster_run(name, root)


_REFERENCES: dict[tuple, dict] = {}


def reference(config: dict, workers: int | None = None, **overrides) -> dict:
    """Single-process tf_keras at the global batch, same data order and initial weights."""
    config = {**config, **overrides}
    workers = config["workers"] if workers is None else workers
    key = (config["optimizer"], config["model"], config.get("steps", STEPS),
           config.get("epochs", 1), workers, config.get("lr_callback", False))
    if key not in _REFERENCES:
        tkw.limit_threads()
        tkw.select_keras("tf_keras")
        args = argparse.Namespace(optimizer=config["optimizer"], model=config["model"],
                                  data="numpy", steps=config.get("steps", STEPS),
                                  epochs=config.get("epochs", 1), batch=BATCH, workers=workers,
                                  hidden=8, lr_callback=config.get("lr_callback", False))
        _REFERENCES[key] = tkw.single_process(args)
    return _REFERENCES[key]


def assert_close(actual, expected, what: str) -> None:
    """Within RTOL of the expected value, relative to each tensor's largest entry."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    scale = max(float(np.max(np.abs(expected))), 1e-30)
    error = float(np.max(np.abs(actual - expected))) / scale
    assert error <= RTOL, f"{what}: max relative error {error:.3g} > {RTOL}"


def shares(array: np.ndarray, global_batch: int, workers: int, index: int) -> np.ndarray:
    """Worker `index`'s rows of every global batch (README "Data")."""
    parts = []
    for begin in range(0, len(array), global_batch):
        batch = array[begin:begin + global_batch]
        n = len(batch)
        parts.append(batch[n * index // workers:n * (index + 1) // workers])
    return np.concatenate(parts)


def mlp_logits(weights: list[np.ndarray], x: np.ndarray) -> np.ndarray:
    kernel, bias, out_kernel, out_bias = (w.astype(np.float64) for w in weights)
    return np.tanh(x.astype(np.float64) @ kernel + bias) @ out_kernel + out_bias


def cross_entropy(logits: np.ndarray, y: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    return -log_probs[np.arange(len(y)), y]


# -- 1. exactness ------------------------------------------------------------------------------

@pytest.mark.timeout(CLUSTER_TIMEOUT + 60)
@pytest.mark.parametrize("name", ["sgd", "momentum", "adam", "schedule"])
def test_weights_equal_single_process_training(runs, name):
    """After 6 steps on 2 workers at batch b: plain tf_keras at batch 2b, on both workers."""
    run = runs(name)
    run.check_ok()
    expected = reference(run.config)["trainable"]
    for index in range(run.config["workers"]):
        info = run.info(index)
        assert info["keras"].startswith("tf_keras"), info["keras"]  # Not Keras 3.
        actual = run.trainable(index)
        assert len(actual) == len(expected)
        for j, (a, e) in enumerate(zip(actual, expected)):
            assert_close(a, e, f"{name}: worker {index}, trainable variable {j}")
        assert info["steps_per_epoch"] == [STEPS]
        assert info["iterations"] == STEPS  # The worker's optimizer counted every step.
    for a, b in zip(run.trainable(0), run.trainable(1)):
        np.testing.assert_array_equal(a, b)  # Both pulled the same bytes.
    # The PS ran a Keras 3 optimizer even though the workers use tf_keras.
    assert f"optimizer {'Adam' if name == 'adam' else 'SGD'}" in run.log, run.describe()


@pytest.mark.timeout(CLUSTER_TIMEOUT + 60)
def test_learning_rate_callback_reaches_the_ps(runs):
    """tf_keras's LearningRateScheduler changes the rate on the workers; the PS trains with it."""
    run = runs("lr_callback")
    run.check_ok()
    expected = reference(run.config)["trainable"]
    without = reference(run.config, lr_callback=False)["trainable"]
    assert any(not np.allclose(e, w, rtol=1e-4) for e, w in zip(expected, without))
    for index in range(run.config["workers"]):
        assert run.info(index)["history"]["lr"] == pytest.approx([0.1, 0.05, 0.025])
        for j, (a, e) in enumerate(zip(run.trainable(index), expected)):
            assert_close(a, e, f"lr_callback: worker {index}, trainable variable {j}")


# -- 2. BatchNorm --------------------------------------------------------------------------

@pytest.mark.timeout(CLUSTER_TIMEOUT + 60)
def test_batchnorm_trains_and_keeps_local_statistics(runs):
    run = runs("bn")
    run.check_ok()
    config, workers = run.config, run.config["workers"]
    for index in range(workers):
        info = run.info(index)
        losses = info["history"]["loss"]
        assert len(losses) == config["epochs"] and all(np.isfinite(losses)), losses
        assert losses[-1] < losses[0], f"worker {index}: loss did not decrease: {losses}"
        assert info["steps_per_epoch"] == [config["steps"]] * config["epochs"]
        assert all(np.isfinite(v) for v in info["evaluate"].values()), info["evaluate"]
        assert np.all(np.isfinite(run.npz(index)["predict"]))
    # Trainable weights (gamma and beta included) come from the PS: equal.
    names = run.info(0)["trainable_names"]
    assert any("bn_in/gamma" in n for n in names), names
    for j, (a, b) in enumerate(zip(run.trainable(0), run.trainable(1))):
        np.testing.assert_array_equal(a, b, err_msg=f"trainable {names[j]}")
    # The input BatchNorm's moving statistics: each worker's own shares, not averaged.
    # momentum 0.9, starting from mean 0 and variance 1, every training step of every epoch.
    global_batch = BATCH * workers
    x, _ = tkw.make_data("bn", config["steps"] * global_batch)
    means = []
    for index in range(workers):
        mean, var = np.zeros(tkw.IN_DIM), np.ones(tkw.IN_DIM)
        for _ in range(config["epochs"]):
            for step in range(config["steps"]):
                batch = x[step * global_batch:(step + 1) * global_batch].astype(np.float64)
                share = batch[BATCH * index:BATCH * (index + 1)]
                mean = 0.9 * mean + 0.1 * share.mean(axis=0)
                var = 0.9 * var + 0.1 * share.var(axis=0)
        arrays = run.npz(index)
        np.testing.assert_allclose(arrays["bn_in.moving_mean"], mean, rtol=1e-4, atol=1e-5,
                                   err_msg=f"worker {index}: moving mean")
        np.testing.assert_allclose(arrays["bn_in.moving_variance"], var, rtol=1e-4, atol=1e-5,
                                   err_msg=f"worker {index}: moving variance")
        means.append(arrays["bn_in.moving_mean"])
    assert not np.allclose(means[0], means[1])  # Local: the shares differ.
    save = run.info(0)["save"]
    assert save.get("ok") and save["equal"], save


# -- 3. reads after fit ----------------------------------------------------------------------

@pytest.mark.timeout(CLUSTER_TIMEOUT + 60)
def test_evaluate_predict_get_weights_see_latest_parameters(runs):
    run = runs("sgd")
    run.check_ok()
    workers = run.config["workers"]
    global_batch = BATCH * workers
    x_probe, y_probe = tkw.probe_data("mlp", global_batch)
    expected = reference(run.config)["trainable"]
    for index in range(workers):
        arrays, info = run.npz(index), run.info(index)
        trainable = run.trainable(index)
        weights = [arrays[f"w{j}"] for j in range(info["num_weights"])]
        assert len(weights) == len(trainable)
        for j, (w, t, e) in enumerate(zip(weights, trainable, expected)):
            np.testing.assert_array_equal(w, t)
            assert_close(w, e, f"worker {index}: get_weights()[{j}]")
        # predict and evaluate: from those weights, on this worker's share of each batch.
        x_share, y_share = (shares(a, global_batch, workers, index) for a in (x_probe, y_probe))
        logits = mlp_logits(weights, x_share)
        np.testing.assert_allclose(arrays["predict"], logits, rtol=1e-5, atol=1e-5,
                                   err_msg=f"worker {index}: predict")
        loss = cross_entropy(logits, y_share).mean()
        accuracy = np.mean(np.argmax(logits, axis=1) == y_share)
        assert info["evaluate"]["loss"] == pytest.approx(loss, rel=1e-5)
        assert info["evaluate"]["accuracy"] == pytest.approx(accuracy)
    save = run.info(0)["save"]
    assert save.get("ok"), save.get("error", {}).get("traceback")
    assert save["equal"], save


# -- 4. misuse -----------------------------------------------------------------------------

def misuse_case(runs, case: str) -> dict:
    run = runs("misuse")
    results = run.info(0).get("misuse", {})
    assert case in results, f"the worker never finished the {case!r} case. " + run.describe()
    return results[case]


@pytest.mark.timeout(CLUSTER_TIMEOUT + 60)
@pytest.mark.parametrize("case,fragments", [
    ("outside_scope", ["scope"]),
    ("clipnorm", ["clipnorm", "Received: clipnorm=1.0"]),
    ("clipvalue", ["clipvalue", "Received: clipvalue=1.0"]),
    ("global_clipnorm", ["global_clipnorm", "Received: global_clipnorm=1.0"]),
    ("use_ema", ["use_ema", "Received: use_ema=True"]),
    ("legacy_optimizer", ["legacy", "use tf_keras.optimizers.SGD"]),
    ("adaptive_epsilon", ["adaptive_epsilon", "Received: adaptive_epsilon=True"]),
    ("custom_schedule", ["schedule", "Received: learning_rate=", "Halving"]),
    ("jit_compile", ["jit_compile", "XLA"]),
    ("mixed_precision", ["mixed precision", "Received: variable", "AutoCastVariable"]),
])
def test_unsupported_use_is_rejected_with_a_clear_error(runs, case, fragments):
    assert case in tkw.MISUSE_CASES
    result = misuse_case(runs, case)
    assert result["raised"], result
    assert result["type"] == "ValueError", result
    for fragment in fragments:
        assert fragment in result["message"], result["message"]


@pytest.mark.timeout(CLUSTER_TIMEOUT + 60)
def test_after_rejections_a_valid_model_trains_exactly(runs):
    """The rejected cases changed nothing: AdamW (bias excluded from decay) trains as tf_keras."""
    run = runs("misuse")
    result = misuse_case(runs, "valid")
    assert not result["raised"], result.get("traceback")
    assert result["value"]["steps_per_epoch"] == [STEPS]
    # One worker at batch b is single-process tf_keras at batch b.
    expected = reference(run.config, workers=1)["trainable"]
    actual = run.trainable(0, ".valid")
    assert len(actual) == len(expected)
    for j, (a, e) in enumerate(zip(actual, expected)):
        assert_close(a, e, f"misuse/valid: trainable variable {j}")
    assert "optimizer AdamW" in run.log, run.describe()
    run.check_ok()
