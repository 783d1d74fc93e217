"""`prophet_tf.Strategy(device=...)`: the model computes on the chosen device, the op
library's ops run on its host CPU, and the weights stay exact.

This machine has no GPU. The cluster's workers split their CPU into two logical
devices before TensorFlow starts (device_worker.py): CPU:0 is the host, CPU:1
stands in for an accelerator. With `device="/cpu:1"`:

- placement: as TensorFlow's runtime reports it (`log_device_placement`, read
  from each worker's stderr), every MatMul and convolution of forward and
  backward runs on CPU:1, every AwaitParam and PushGrad on CPU:0;
- exactness: the weights equal single-process Keras at the global batch;
- the variables: parameters on the host, metrics on the compute device.

Then, without a cluster: the default device (the first GPU, else the CPU),
PROPHET_TF_DEVICE, and the ValueError for a device that does not exist or is
malformed, raised before the engine is made.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from cluster import (ROOT, KerasClusters, child_env, free_port, reap, run_ps)

HERE = pathlib.Path(__file__).resolve().parent
DEVICE_WORKER = HERE / "device_worker.py"
CLUSTER_TIMEOUT = 240.0  # two workers logging every placement, on a busy 2-core box
WATCHDOG = 200.0
RTOL = 1e-6
HOST = "/job:localhost/replica:0/task:0/device:CPU:0"
COMPUTE = "/job:localhost/replica:0/task:0/device:CPU:1"
CONFIG = dict(workers=2, ps=1, optimizer="adam", model="cnn", data="numpy")
# The model's compute: Dense (MatMul), Conv2D and their gradients.
MODEL_OPS = ("MatMul", "Conv2D", "Conv2DBackpropFilter", "Conv2DBackpropInput", "BiasAdd",
             "BiasAddGrad")
PROPHET_OPS = ("AwaitParam", "PushGrad")

# TensorFlow's own log lines: a graph node's placement (placer.cc) and an eager op's
# (execute.cc), at INFO level.
PLACED = re.compile(r"placer\.cc:\d+\] (?P<node>\S+): \((?P<op>\w+)\): (?P<device>/\S+)\s*$",
                    re.M)
EXECUTED = re.compile(r"execute\.cc:\d+\] Executing op (?P<op>\w+) in device (?P<device>/\S+)",
                      re.M)


@dataclasses.dataclass
class Worker:
    code: int | None
    stdout: str
    stderr: str
    info: dict
    arrays: dict

    def describe(self) -> str:
        return f"exit {self.code}\n--- stdout:\n{self.stdout[-3000:]}\n--- stderr tail:\n" + \
            "\n".join(line for line in self.stderr.splitlines()
                      if not PLACED.search(line) and not EXECUTED.search(line))[-3000:]

    def placements(self) -> dict[str, set[str]]:
        """Op type -> the devices TensorFlow placed (graph) or ran (eager) it on."""
        found: dict[str, set[str]] = {}
        for pattern in (PLACED, EXECUTED):
            for m in pattern.finditer(self.stderr):
                found.setdefault(m["op"], set()).add(m["device"])
        return found


def run_workers(tmp: pathlib.Path, ps_address: str, device: str) -> list[Worker]:
    """Two device_worker.py processes with their own TF_CONFIG; stdout and stderr kept
    apart; always reaped."""
    env = child_env(drop=("TF_CONFIG", "PROPHET_TF_SCHEDULER", "PROPHET_TF_DEVICE",
                          "TF_USE_LEGACY_KERAS"),
                    TF_CPP_MIN_LOG_LEVEL="0",  # The placement lines are INFO.
                    TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="2",
                    OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(CONFIG["workers"])]
    out = tmp / "out"
    procs, files = [], []
    try:
        for i in range(CONFIG["workers"]):
            task_env = dict(env, TF_CONFIG=json.dumps({
                "cluster": {"worker": addresses, "ps": [ps_address]},
                "task": {"type": "worker", "index": i}}))
            paths = (tmp / f"worker{i}.out", tmp / f"worker{i}.err")
            files.append(paths)
            with open(paths[0], "wb") as stdout, open(paths[1], "wb") as stderr:
                procs.append(subprocess.Popen(
                    [sys.executable, str(DEVICE_WORKER), "--device", device,
                     "--model", CONFIG["model"], "--optimizer", CONFIG["optimizer"],
                     "--data", CONFIG["data"], "--watchdog", str(WATCHDOG), "--out", str(out)],
                    stdout=stdout, stderr=stderr, env=task_env, cwd=ROOT))
        deadline = time.monotonic() + CLUSTER_TIMEOUT
        codes = []
        for p in procs:
            try:
                codes.append(p.wait(max(deadline - time.monotonic(), 0.1)))
            except subprocess.TimeoutExpired:
                codes.append(None)
    finally:
        for p in procs:
            reap(p)
    workers = []
    for i, (code, (stdout, stderr)) in enumerate(zip(codes, files)):
        info_path, npz_path = out / f"worker{i}.json", out / f"worker{i}.npz"
        info = json.loads(info_path.read_text()) if info_path.exists() else {}
        arrays = dict(np.load(npz_path)) if npz_path.exists() else {}
        workers.append(Worker(code, stdout.read_text(errors="replace"),
                              stderr.read_text(errors="replace"), info, arrays))
    return workers


@pytest.fixture(scope="module")
def on_cpu1(tmp_path_factory):
    """A 2-worker cluster (1 PS) training keras_worker's CNN with device="/cpu:1"."""
    tmp = tmp_path_factory.mktemp("device")
    with run_ps(tmp, "--num-workers", str(CONFIG["workers"])) as ps:
        workers = run_workers(tmp, ps.address, "/cpu:1")
    for i, worker in enumerate(workers):
        assert worker.code == 0, f"worker {i}: " + worker.describe()
    return workers


# -- on a cluster ----------------------------------------------------------------------------

@pytest.mark.timeout(CLUSTER_TIMEOUT + 120)
def test_model_ops_on_the_compute_device_and_prophet_ops_on_the_host(on_cpu1):
    for i, worker in enumerate(on_cpu1):
        assert worker.info["compute_device"] == COMPUTE
        placed = worker.placements()
        for op in MODEL_OPS:
            assert placed.get(op) == {COMPUTE}, \
                f"worker {i}: {op} placed on {placed.get(op)}, expected only {COMPUTE}"
        for op in PROPHET_OPS:
            assert placed.get(op) == {HOST}, \
                f"worker {i}: {op} placed on {placed.get(op)}, expected only {HOST}"


@pytest.mark.timeout(CLUSTER_TIMEOUT + 120)
def test_weights_equal_single_process_keras(on_cpu1):
    clusters = KerasClusters({"device": CONFIG}, keras="keras3", timeout=CLUSTER_TIMEOUT,
                             watchdog=WATCHDOG)
    expected = clusters.reference(CONFIG)["trainable"]
    for i, worker in enumerate(on_cpu1):
        actual = [worker.arrays[f"t{j}"] for j in range(len(expected))]
        for j, (a, e) in enumerate(zip(actual, expected)):
            assert a.shape == e.shape
            error = float(np.max(np.abs(a - e))) / max(float(np.max(np.abs(e))), 1e-30)
            assert error <= RTOL, f"worker {i}, trainable variable {j}: relative error {error:.3g}"
    for a, b in zip(*[[w.arrays[f"t{j}"] for j in range(len(expected))] for w in on_cpu1]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.timeout(CLUSTER_TIMEOUT + 120)
def test_parameters_live_on_the_host_and_metrics_on_the_compute_device(on_cpu1):
    for i, worker in enumerate(on_cpu1):
        devices = worker.info["variable_devices"]
        assert set(devices["trainable"]) == {HOST}, f"worker {i}: {devices}"
        assert devices["metrics"] and set(devices["metrics"]) == {COMPUTE}, \
            f"worker {i}: {devices}"


# -- without a cluster -------------------------------------------------------------------------

# Never dialed: a Strategy connects to nothing until training starts.
NO_CLUSTER = {"cluster": {"worker": ["127.0.0.1:1001"], "ps": ["127.0.0.1:2001"]},
              "task": {"type": "worker", "index": 0}}

RESOLVE_SCRIPT = f"""
import json, os, sys
import tensorflow as tf
(cpu,) = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()])
import prophet_tf
from prophet_tf import devices

def compute_device(**kwargs):
    strategy = prophet_tf.Strategy(cluster={NO_CLUSTER!r}, **kwargs)
    try:
        return strategy.extended.worker_devices[0]
    finally:
        strategy.shutdown()

found = {{"default": compute_device(), "default_device": devices.default_device(),
          "logical_device": compute_device(device=tf.config.list_logical_devices("CPU")[1])}}
os.environ[devices.DEVICE_ENV] = "/cpu:1"
found["env"] = compute_device()
found["explicit_over_env"] = compute_device(device="/device:CPU:0")
print(json.dumps(found))
"""


@pytest.mark.timeout(120)
def test_default_is_the_first_gpu_else_the_cpu_and_prophet_tf_device_sets_it():
    """Two CPU devices and no GPU: None gives CPU:0, whatever else exists."""
    env = child_env(drop=("TF_CONFIG", "PROPHET_TF_DEVICE"))
    proc = subprocess.run([sys.executable, "-c", RESOLVE_SCRIPT], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found == {"default": HOST, "default_device": HOST, "logical_device": COMPUTE,
                     "env": COMPUTE, "explicit_over_env": HOST}, found


@pytest.mark.timeout(60)
@pytest.mark.parametrize("device, fragment", [
    ("/gpu:63", "does not exist"),
    ("/cpu:63", "does not exist"),
    ("/job:worker/task:3/cpu:0", "does not exist"),  # another task's: not this process's
    ("banana", "not a TensorFlow device string"),
    ("/cpu:x", "not a TensorFlow device string"),
    ("", "must be a TensorFlow device string"),
    (0, "must be a TensorFlow device string"),
])
def test_a_missing_or_malformed_device_is_named_before_the_engine_is_made(
        monkeypatch, device, fragment):
    from prophet_tf.strategy import Strategy
    monkeypatch.delenv("PROPHET_TF_DEVICE", raising=False)
    with pytest.raises(ValueError) as raised:
        # The scheduler is invalid too, which the engine would name: the device comes first.
        Strategy(cluster=NO_CLUSTER, scheduler="lifo", device=device)
    message = str(raised.value)
    assert fragment in message and message.endswith(f"Received: device={device!r}"), message
    if fragment == "does not exist":
        assert "TensorFlow's devices here: /device:CPU:0" in message, message


@pytest.mark.timeout(60)
def test_a_bad_prophet_tf_device_is_named(monkeypatch):
    from prophet_tf.strategy import Strategy
    monkeypatch.setenv("PROPHET_TF_DEVICE", "/gpu:63")
    with pytest.raises(ValueError, match=re.escape("Received: PROPHET_TF_DEVICE='/gpu:63'")):
        Strategy(cluster=NO_CLUSTER)
