"""The integration tests' cluster harness: real processes on localhost, always reaped.

- `child_env`, `launch_env`, `run_prophet`: the environment and the
  `python -m prophet_tf ...` call of a child process.
- `free_port`, `reap`, `reap_group`: ports and process ends.
- `run_ps`: one PS task (`python -m prophet_tf.ps.server`) on a free port.
- `WorkerProcesses`: worker processes started by hand with their own TF_CONFIG (no
  launcher, which would stop everyone when one task dies): what a multi-host job sees.
- `KerasClusters`: clusters of keras_worker.py started by `prophet-tf launch`, one per
  configuration, and the single-process Keras references they are compared with.

Nothing here imports TensorFlow: keras_worker is imported only to build a reference.
"""
from __future__ import annotations

import argparse
import contextlib
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

from prophet_tf import cluster as cluster_lib

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
KERAS_WORKER = HERE / "keras_worker.py"
START_TIMEOUT = 120.0  # a PS task starting on a busy 2-core machine
# One TensorFlow thread of each kind: 2 cores are shared by every task of a cluster.
ONE_TF_THREAD = {"TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1"}


# -- processes ---------------------------------------------------------------------------------

def child_env(*, drop=("TF_CONFIG", "PROPHET_TF_DEVICE"), **extra: str) -> dict:
    """This process's environment for a child: the checkout importable, TensorFlow quiet,
    the variables in `drop` removed (so the caller's shell cannot leak into a test), then
    `extra` set."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2")
    for name in drop:
        env.pop(name, None)
    env.update(extra)
    return env


# What a `prophet-tf launch` (and its tasks) must not inherit from the caller's shell.
LAUNCH_DROP = ("TF_CONFIG", "PROPHET_TF_SCHEDULER", "PROPHET_TF_LOG_LEVEL", "PROPHET_TF_DEVICE")


def launch_env(**extra: str) -> dict:
    """child_env for `prophet-tf launch`: one TensorFlow thread per task, LAUNCH_DROP unset."""
    return child_env(drop=LAUNCH_DROP, **ONE_TF_THREAD, **extra)


def run_prophet(*args: str, env: dict, timeout: float, cwd=ROOT) -> subprocess.CompletedProcess:
    """`python -m prophet_tf ARGS` to its end, output captured, no stdin."""
    return subprocess.run([sys.executable, "-m", "prophet_tf", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


free_port = cluster_lib.free_port


def reap(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after `grace_s`; waits for the process either way."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def reap_group(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """For a process started with start_new_session=True (a launcher): SIGTERM (it stops
    its children), then SIGKILL whatever is left of its process group."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    try:  # Anything left in the session this test started.
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if proc.poll() is None:
        proc.wait(10)


# -- a PS task ---------------------------------------------------------------------------------

@dataclasses.dataclass
class PSProcess:
    proc: subprocess.Popen
    port: int
    log_path: pathlib.Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextlib.contextmanager
def run_ps(tmp_dir: pathlib.Path, *args: str, tf_config: str | None = None):
    """Starts ``python -m prophet_tf.ps.server --port 0 --port-file F ARGS``.

    With ``tf_config``, TF_CONFIG is set to it and ``--port 0`` left out (the
    port comes from the cluster spec); otherwise TF_CONFIG is unset.
    Yields a PSProcess once the port file exists; terminates (then kills) the
    process on exit, whatever happened.
    """
    port_file = tmp_dir / "port"
    log_path = tmp_dir / "ps.log"
    env = child_env(**ONE_TF_THREAD, PROPHET_TF_LOG_LEVEL="INFO")
    if tf_config is not None:
        env["TF_CONFIG"] = tf_config
    port_args = [] if tf_config is not None else ["--port", "0"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "prophet_tf.ps.server", *port_args,
             "--port-file", str(port_file), *args],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while not port_file.exists():
            if proc.poll() is not None:
                raise RuntimeError(f"PS exited with {proc.returncode}:\n{log_path.read_text()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"PS did not start in {START_TIMEOUT} s:\n"
                                   f"{log_path.read_text()}")
            time.sleep(0.05)
        yield PSProcess(proc, int(port_file.read_text()), log_path)
    finally:
        reap(proc)


# -- workers started by hand -------------------------------------------------------------------

class WorkerProcesses:
    """`argv` run once per worker, each with its own TF_CONFIG (workers on free ports, the
    given PS addresses) added to `env`; output in log_dir/worker<i>.log. Reaped on exit."""

    def __init__(self, log_dir: pathlib.Path, ps_addresses, num_workers: int, argv, env: dict):
        self.procs, self.logs = [], []
        workers = [f"127.0.0.1:{free_port()}" for _ in range(num_workers)]
        try:
            for i in range(num_workers):
                task_env = dict(env, TF_CONFIG=json.dumps({
                    "cluster": {"worker": workers, "ps": list(ps_addresses)},
                    "task": {"type": "worker", "index": i}}))
                self.logs.append(log_dir / f"worker{i}.log")
                with open(self.logs[-1], "wb") as out:
                    self.procs.append(subprocess.Popen(
                        argv, stdout=out, stderr=subprocess.STDOUT, env=task_env, cwd=ROOT))
        except BaseException:
            self.reap()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.reap()

    def log(self, i: int) -> str:
        return self.logs[i].read_text(errors="replace")

    def wait(self, timeout: float) -> list[int | None]:
        """Exit codes once all have exited or `timeout` has passed (None: still running)."""
        deadline = time.monotonic() + timeout
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(max(deadline - time.monotonic(), 0.1)))
            except subprocess.TimeoutExpired:
                codes.append(None)
        return codes

    def reap(self) -> None:
        for p in self.procs:
            reap(p)


# -- Keras clusters through the launcher ------------------------------------------------------

STEPS = 6  # per epoch
BATCH = 4  # per worker
RTOL = 1e-5


def steps_per_epoch(config: dict) -> list[int]:
    """The steps of each epoch of a KerasClusters config."""
    return [config.get("steps", STEPS)] * config.get("epochs", 1)


@dataclasses.dataclass
class Run:
    """One finished (or timed out) `prophet-tf launch` of keras_worker.py."""
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


class KerasClusters:
    """`prophet-tf launch` clusters of keras_worker.py, one per entry of `configs`.

    A config names workers, ps, optimizer, model, data and optionally steps, epochs,
    rounds, lr_callback, scenario, watchdog and keras (else `keras`: one of
    keras_worker.KERAS_CHOICES). Each runs at most once per session unless asked
    for fresh; the workers get `watchdog` s before they print their stacks and exit,
    the whole launch `timeout` s.
    """

    def __init__(self, configs: dict, *, keras: str, timeout: float, watchdog: float):
        self.configs, self.keras = configs, keras
        self.timeout, self.watchdog = timeout, watchdog
        self._runs: dict[str, Run] = {}
        self._references: dict[tuple, dict] = {}

    def keras_of(self, config: dict) -> str:
        return config.get("keras", self.keras)

    def env(self, config: dict) -> dict:
        env = child_env(drop=("TF_CONFIG", "PROPHET_TF_SCHEDULER", "TF_USE_LEGACY_KERAS"),
                        TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="2",
                        OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
        if self.keras_of(config) == "tf.keras":
            env["TF_USE_LEGACY_KERAS"] = "1"  # tf.keras is tf_keras (the PS still uses Keras 3).
        return env

    def worker_args(self, config: dict, out_dir: pathlib.Path) -> list[str]:
        return ["--keras", self.keras_of(config),
                "--scenario", config.get("scenario", "train"), "--optimizer", config["optimizer"],
                "--model", config["model"], "--data", config["data"],
                "--steps", str(config.get("steps", STEPS)),
                "--epochs", str(config.get("epochs", 1)), "--batch", str(BATCH),
                "--watchdog", str(config.get("watchdog", self.watchdog)),
                "--rounds", str(config.get("rounds", 1)),
                "--out", str(out_dir)] + (["--lr-callback"] if config.get("lr_callback") else [])

    def run(self, name: str, tmp_root: pathlib.Path, fresh: bool = False) -> Run:
        """Runs configs[name] with `python -m prophet_tf launch`; later calls reuse the
        result unless `fresh`."""
        if name in self._runs and not fresh:
            return self._runs[name]
        config = self.configs[name]
        out_dir = tmp_root / name
        out_dir.mkdir(parents=True)
        log_path = tmp_root / f"{name}.log"
        command = [sys.executable, "-m", "prophet_tf", "launch",
                   "--workers", str(config["workers"]), "--ps", str(config["ps"]), "--",
                   sys.executable, str(KERAS_WORKER), *self.worker_args(config, out_dir)]
        start = time.monotonic()
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                    env=self.env(config), cwd=ROOT, start_new_session=True)
        try:
            code = proc.wait(self.timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            reap_group(proc)
        run = Run(name, config, code, time.monotonic() - start,
                  log_path.read_text(errors="replace"), out_dir)
        if not fresh:
            self._runs[name] = run
        return run

    def reference(self, config: dict, workers: int | None = None, **overrides) -> dict:
        """Single-process Keras of the same family at the global batch, same data order and
        initial weights; computed here, in the test process."""
        import keras_worker as kw  # TensorFlow: only the tests that compare import it.

        config = {**config, **overrides}
        workers = config["workers"] if workers is None else workers
        flavour = kw.family(self.keras_of(config))
        key = (flavour, config["optimizer"], config["model"], config.get("steps", STEPS),
               config.get("epochs", 1), workers, config.get("lr_callback", False),
               config.get("rounds", 1))
        if key not in self._references:
            kw.limit_threads()
            kw.select_keras(flavour)  # tf_keras imported directly: this process keeps Keras 3.
            args = argparse.Namespace(optimizer=config["optimizer"], model=config["model"],
                                      data="numpy", steps=config.get("steps", STEPS),
                                      epochs=config.get("epochs", 1), batch=BATCH,
                                      workers=workers, hidden=8,
                                      lr_callback=config.get("lr_callback", False),
                                      rounds=config.get("rounds", 1))
            self._references[key] = kw.single_process(args)
        return self._references[key]


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


# -- checks shared by test_strategy and test_tf_keras -----------------------------------------

def misuse_case(run: Run, case: str) -> dict:
    """What the misuse worker recorded for `case` (raised, type, message, ...)."""
    results = run.info(0).get("misuse", {})
    assert case in results, f"the worker never finished the {case!r} case. " + run.describe()
    return results[case]


def assert_batchnorm_averages_statistics(run: Run) -> None:
    """A BatchNorm model trains (fit, then one epoch of a custom loop); trainable weights
    (gamma and beta included) come from the PS, and after every train step of either the
    moving statistics are the mean of the workers' own updates (MultiWorkerMirroredStrategy's
    on-read mean), so every worker ends with the same statistics and evaluates, predicts
    and saves alike."""
    import keras_worker as kw

    config, workers = run.config, run.config["workers"]
    for index in range(workers):
        info = run.info(index)
        losses = info["history"]["loss"]
        assert len(losses) == config["epochs"] and all(np.isfinite(losses)), losses
        assert losses[-1] < losses[0], f"worker {index}: loss did not decrease: {losses}"
        assert info["steps_per_epoch"] == [config["steps"]] * config["epochs"]
        assert info["loop_steps"] == config["steps"]
        assert all(np.isfinite(v) for v in info["evaluate"].values()), info["evaluate"]
        assert np.all(np.isfinite(run.npz(index)["predict"]))
    # Trainable weights come from the PS: equal.
    names = run.info(0)["trainable_names"]
    assert any("bn_in/gamma" in n for n in names), names
    for j, (a, b) in enumerate(zip(run.trainable(0), run.trainable(1))):
        np.testing.assert_array_equal(a, b, err_msg=f"trainable {names[j]}")
    # The input BatchNorm's moving statistics: momentum 0.9 from mean 0 and variance 1,
    # each step's update the mean of the workers' (each normalizes its own share), in fit
    # and in the custom loop.
    global_batch = BATCH * workers
    x, _ = kw.make_data("bn", config["steps"] * global_batch)
    mean, var = np.zeros(kw.IN_DIM), np.ones(kw.IN_DIM)
    for _ in range(config["epochs"] + 1):  # the fit's epochs and the loop's
        for step in range(config["steps"]):
            batch = x[step * global_batch:(step + 1) * global_batch].astype(np.float64)
            shares = [batch[BATCH * i:BATCH * (i + 1)] for i in range(workers)]
            mean = 0.9 * mean + 0.1 * np.mean([s.mean(axis=0) for s in shares], axis=0)
            var = 0.9 * var + 0.1 * np.mean([s.var(axis=0) for s in shares], axis=0)
    first = run.npz(0)
    np.testing.assert_allclose(first["bn_in.moving_mean"], mean, rtol=1e-5, atol=1e-6,
                               err_msg="moving mean")
    np.testing.assert_allclose(first["bn_in.moving_variance"], var, rtol=1e-5, atol=1e-6,
                               err_msg="moving variance")
    # Every worker holds the same statistics, of both BatchNorm layers, to the bit; so
    # get_weights, predict and evaluate agree too.
    for index in range(1, workers):
        arrays = run.npz(index)
        for key in [k for k in first if ".moving_" in k] + ["predict"]:
            np.testing.assert_array_equal(arrays[key], first[key], err_msg=f"worker {index}: {key}")
        for j in range(run.info(0)["num_weights"]):
            np.testing.assert_array_equal(arrays[f"w{j}"], first[f"w{j}"],
                                          err_msg=f"worker {index}: get_weights()[{j}]")
        assert run.info(index)["evaluate"] == run.info(0)["evaluate"]
    save = run.info(0)["save"]
    assert save.get("ok") and save["equal"], save


def assert_reads_see_latest_parameters(run: Run, expected: list[np.ndarray], *,
                                      whole_data: bool) -> None:
    """After fit on an MLP: get_weights, predict and evaluate on every worker use the last
    step's parameters (`expected`, the single-process reference), and save/load keeps them.
    `whole_data`: predict and evaluate cover every row (Keras 3), else this worker's share
    of each global batch (tf_keras)."""
    import keras_worker as kw

    workers = run.config["workers"]
    global_batch = BATCH * workers
    x_probe, y_probe = kw.probe_data("mlp", global_batch)
    for index in range(workers):
        arrays, info = run.npz(index), run.info(index)
        trainable = run.trainable(index)
        weights = [arrays[f"w{j}"] for j in range(info["num_weights"])]
        assert len(weights) == len(trainable)
        for j, (w, t, e) in enumerate(zip(weights, trainable, expected)):
            np.testing.assert_array_equal(w, t)
            assert_close(w, e, f"worker {index}: get_weights()[{j}]")
        # predict and evaluate: computed from those weights, on every row (Keras 3) or
        # on this worker's share of each global batch (tf_keras; README "What fit computes").
        x_share, y_share = (a if whole_data else shares(a, global_batch, workers, index)
                            for a in (x_probe, y_probe))
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
