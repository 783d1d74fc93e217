"""prophet_tf.Strategy end to end: real clusters (`python -m prophet_tf launch`).

Each cluster runs tests/integration/strategy_worker.py on every worker; the
workers write their final weights, predictions and what they saw to files that
the tests compare with plain single-process Keras run here, in the test
process, from the same model/data/optimizer code.

A cluster is started once per configuration and shared by the tests that look
at it (clusters are the expensive part: each task imports TensorFlow):

  sgd       2 workers, 1 PS, MLP, numpy arrays
  momentum  2 workers, 1 PS, MLP, tf.data.Dataset
  adam      2 workers, 2 PS, CNN, keras.utils.PyDataset (variables on both PS tasks)
  schedule  2 workers, 2 PS, MLP, numpy, SGD with ExponentialDecay
  bn        2 workers, 1 PS, MLP with BatchNormalization, 3 epochs
  misuse    1 worker, 1 PS: model outside scope() (2 ways), jit_compile, clipnorm,
            run_eagerly (in this order, in one worker process)

plus a hand-made cluster (one PS from conftest, two worker subprocesses) whose
workers build different models.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WORKER = HERE / "strategy_worker.py"
sys.path.insert(0, str(HERE))
import strategy_worker as sw  # noqa: E402  (imports TensorFlow and Keras)

STEPS = 6        # per epoch
BATCH = 4        # per worker
CLUSTER_TIMEOUT = 150.0  # whole launch, TensorFlow imports included, on a busy 2-core box
WATCHDOG = 90.0  # a worker prints its stacks and exits after this long
RTOL = 1e-5

CONFIGS = {
    "sgd": dict(workers=2, ps=1, optimizer="sgd", model="mlp", data="numpy"),
    "momentum": dict(workers=2, ps=1, optimizer="momentum", model="mlp", data="dataset"),
    "adam": dict(workers=2, ps=2, optimizer="adam", model="cnn", data="pydataset"),
    "schedule": dict(workers=2, ps=2, optimizer="schedule", model="mlp", data="numpy"),
    "bn": dict(workers=2, ps=1, optimizer="adam", model="bn", data="numpy", epochs=3, steps=4),
    "lr_callback": dict(workers=2, ps=1, optimizer="momentum", model="mlp", data="numpy",
                        epochs=3, steps=3, lr_callback=True),
    # fit -> evaluate -> predict -> fit, run twice (see test_fit_evaluate_predict_fit...).
    "rounds": dict(workers=2, ps=2, optimizer="adam", model="cnn", data="pydataset", rounds=2),
    "misuse": dict(workers=1, ps=1, optimizer="sgd", model="mlp", data="numpy",
                   scenario="misuse", watchdog=40.0),
}


def child_env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2",
               TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="2", OMP_NUM_THREADS="1",
               PYTHONFAULTHANDLER="1")
    for name in ("TF_CONFIG", "PROPHET_TF_SCHEDULER"):
        env.pop(name, None)
    return env


def worker_args(config: dict, out_dir: pathlib.Path) -> list[str]:
    return ["--scenario", config.get("scenario", "train"), "--optimizer", config["optimizer"],
            "--model", config["model"], "--data", config["data"],
            "--steps", str(config.get("steps", STEPS)), "--epochs", str(config.get("epochs", 1)),
            "--batch", str(BATCH), "--watchdog", str(config.get("watchdog", WATCHDOG)),
            "--rounds", str(config.get("rounds", 1)),
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

    def trainable(self, index: int) -> list[np.ndarray]:
        arrays = self.npz(index)
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
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=child_env(),
                                cwd=ROOT, start_new_session=True)
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
    root = tmp_path_factory.mktemp("clusters")
    return lambda name: cluster_run(name, root)


_REFERENCES: dict[tuple, dict] = {}


def reference(config: dict, workers: int | None = None) -> dict:
    """Single-process Keras at the global batch, same data order and initial weights."""
    workers = config["workers"] if workers is None else workers
    key = (config["optimizer"], config["model"], config.get("steps", STEPS),
           config.get("epochs", 1), workers, config.get("lr_callback", False),
           config.get("rounds", 1))
    if key not in _REFERENCES:
        sw.limit_threads()
        args = argparse.Namespace(optimizer=config["optimizer"], model=config["model"],
                                  data="numpy", steps=config.get("steps", STEPS),
                                  epochs=config.get("epochs", 1), batch=BATCH, workers=workers,
                                  hidden=8, lr_callback=config.get("lr_callback", False),
                                  rounds=config.get("rounds", 1))
        _REFERENCES[key] = sw.single_process(args)
    return _REFERENCES[key]


def assert_close(actual, expected, what: str) -> None:
    """Within RTOL of the expected value, relative to each tensor's largest entry."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    scale = max(float(np.max(np.abs(expected))), 1e-30)
    error = float(np.max(np.abs(actual - expected))) / scale
    assert error <= RTOL, f"{what}: max relative error {error:.3g} > {RTOL}"
    np.testing.assert_allclose(actual, expected, rtol=10 * RTOL, atol=RTOL * scale,
                               err_msg=what)


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
    """After 6 steps on 2 workers at batch b: plain Keras at batch 2b, on both workers."""
    run = runs(name)
    run.check_ok()
    expected = reference(run.config)["trainable"]
    for index in range(run.config["workers"]):
        actual = run.trainable(index)
        assert len(actual) == len(expected)
        for j, (a, e) in enumerate(zip(actual, expected)):
            assert_close(a, e, f"{name}: worker {index}, trainable variable {j}")
    for a, b in zip(run.trainable(0), run.trainable(1)):
        np.testing.assert_array_equal(a, b)  # Both pulled the same bytes.
    info = run.info(0)
    assert info["steps_per_epoch"] == [STEPS]


@pytest.mark.timeout(2 * CLUSTER_TIMEOUT + 60)
@pytest.mark.parametrize("attempt", [1, 2])
def test_fit_evaluate_predict_fit_on_a_pydataset_ends_cleanly_and_exact(tmp_path, attempt):
    """Regression: a worker died with SIGSEGV between fit and evaluate.

    The cause was TensorFlow's MultiDeviceIterator, which OneDeviceStrategy's
    distributed datasets iterate with (README "How it works", "Input"); this
    cluster (2 PS, Adam, CNN, PyDataset) met it most often. Run fresh twice.
    """
    run = cluster_run("rounds", tmp_path)  # A fresh cluster per attempt (own tmp_path).
    _RUNS.pop("rounds", None)
    run.check_ok()
    assert "Segmentation fault" not in run.log, run.describe()
    expected = reference(run.config)["trainable"]
    for index in range(run.config["workers"]):
        for j, (a, e) in enumerate(zip(run.trainable(index), expected)):
            assert_close(a, e, f"attempt {attempt}: worker {index}, trainable variable {j}")
    assert run.info(0)["iterations"] == 2 * STEPS


@pytest.mark.timeout(CLUSTER_TIMEOUT + 60)
def test_learning_rate_callback_reaches_the_ps(runs):
    """LearningRateScheduler changes the rate on the workers; the PS must train with it."""
    run = runs("lr_callback")
    run.check_ok()
    expected = reference(run.config)["trainable"]
    without = reference({**run.config, "lr_callback": False})["trainable"]
    assert any(not np.allclose(e, w, rtol=1e-4) for e, w in zip(expected, without))
    for index in range(run.config["workers"]):
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
    x, _ = sw.make_data("bn", config["steps"] * global_batch)
    for index in range(workers):
        mean, var = np.zeros(sw.IN_DIM), np.ones(sw.IN_DIM)
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
    save = run.info(0)["save"]
    assert save.get("ok") and save["equal"], save


# -- 3. reads after fit ----------------------------------------------------------------------

@pytest.mark.timeout(CLUSTER_TIMEOUT + 60)
def test_evaluate_predict_get_weights_see_latest_parameters(runs):
    run = runs("sgd")
    run.check_ok()
    workers = run.config["workers"]
    global_batch = BATCH * workers
    x_probe, y_probe = sw.probe_data("mlp", global_batch)
    expected = reference(run.config)["trainable"]
    for index in range(workers):
        arrays, info = run.npz(index), run.info(index)
        trainable = run.trainable(index)
        # get_weights after fit: the last step's parameters (= single-process step 6).
        weights = [arrays[f"w{j}"] for j in range(info["num_weights"])]
        assert len(weights) == len(trainable)
        for j, (w, t, e) in enumerate(zip(weights, trainable, expected)):
            np.testing.assert_array_equal(w, t)
            assert_close(w, e, f"worker {index}: get_weights()[{j}]")
        # predict and evaluate: computed from those weights, on this worker's share
        # of each global batch (every dataset is split, see README "Data").
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


# -- 4. dataset kinds --------------------------------------------------------------------------

@pytest.mark.timeout(CLUSTER_TIMEOUT + 60)
@pytest.mark.parametrize("kind,name", [("dataset", "momentum"), ("pydataset", "adam")])
def test_dataset_kinds_split_the_global_batch(runs, kind, name):
    run = runs(name)
    assert run.config["data"] == kind
    run.check_ok()
    steps = [run.info(i)["steps_per_epoch"] for i in range(run.config["workers"])]
    assert steps == [[STEPS]] * run.config["workers"], steps
    for j, (a, b) in enumerate(zip(run.trainable(0), run.trainable(1))):
        np.testing.assert_array_equal(a, b, err_msg=f"trainable variable {j}")
    # Each worker took STEPS steps on half of each batch: together, the global batch.
    for j, (a, e) in enumerate(zip(run.trainable(0), reference(run.config)["trainable"])):
        assert_close(a, e, f"{kind}: trainable variable {j}")


# -- 5. misuse -----------------------------------------------------------------------------

def misuse_case(runs, case: str) -> dict:
    run = runs("misuse")
    results = run.info(0).get("misuse", {})
    assert case in results, f"the worker never finished the {case!r} case. " + run.describe()
    return results[case]


@pytest.mark.timeout(CLUSTER_TIMEOUT + 60)
@pytest.mark.parametrize("case", ["outside_scope", "outside_scope_compiled_inside"])
def test_model_created_outside_scope_is_rejected(runs, case):
    result = misuse_case(runs, case)
    assert result["raised"], result
    assert "scope" in result["message"], result["message"]


@pytest.mark.timeout(CLUSTER_TIMEOUT + 60)
def test_jit_compile_is_rejected(runs):
    result = misuse_case(runs, "jit_compile")
    assert result["raised"], result
    assert "jit_compile" in result["message"], result["message"]


@pytest.mark.timeout(CLUSTER_TIMEOUT + 60)
def test_clipnorm_is_rejected(runs):
    result = misuse_case(runs, "clipnorm")
    assert result["raised"], result
    assert "clipnorm" in result["message"], result["message"]


@pytest.mark.timeout(CLUSTER_TIMEOUT + 60)
def test_run_eagerly_warns_and_trains(runs):
    run = runs("misuse")
    result = misuse_case(runs, "run_eagerly")
    assert not result["raised"], result.get("traceback")
    assert any("run_eagerly" in w for w in result["warnings"]), result["warnings"]
    # One worker at batch b is single-process Keras at batch b.
    expected = reference(run.config, workers=1)["trainable"]
    arrays = run.npz(0, ".eager")
    for j, e in enumerate(expected):
        assert_close(arrays[f"t{j}"], e, f"run_eagerly: trainable variable {j}")
    run.check_ok()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(150)
def test_workers_with_different_models_both_fail_naming_the_variable(start_ps, tmp_path):
    """Worker i builds a hidden layer of 8 + i units: no hang, both exit non-zero."""
    rpc_timeout = 8.0
    ps = start_ps("--num-workers", "2")
    workers = [f"127.0.0.1:{_free_port()}" for _ in range(2)]
    config = dict(CONFIGS["sgd"], watchdog=60.0)
    procs, logs = [], []
    try:
        for index in range(2):
            env = child_env()
            env["TF_CONFIG"] = json.dumps({"cluster": {"worker": workers, "ps": [ps.address]},
                                           "task": {"type": "worker", "index": index}})
            logs.append(tmp_path / f"worker{index}.log")
            with open(logs[-1], "wb") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, str(WORKER), *worker_args(config, tmp_path / "out"),
                     "--hidden-by-worker", "--rpc-timeout", str(rpc_timeout)],
                    stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT))
        deadline = time.monotonic() + 110
        codes = []
        for proc in procs:
            try:
                codes.append(proc.wait(max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
    finally:
        for proc in procs:
            reap(proc)
    texts = [p.read_text(errors="replace") for p in logs]
    report = "\n".join(f"--- worker {i} (exit {c}):\n{t[-3000:]}"
                       for i, (c, t) in enumerate(zip(codes, texts)))
    assert all(c is not None for c in codes), "a worker hung:\n" + report
    assert all(c != 0 for c in codes), report
    # The worker whose Register was rejected, and the one the PS tells about it,
    # both name the variable that differs.
    assert all("net/hidden/kernel" in t for t in texts), report
    assert not any("Timeout (0:" in t for t in texts), "the watchdog had to stop a worker:\n" + report
