"""Overlap, read from the recorded stamps of a real 2-worker run (no timing thresholds).

(a) In step k, the first gradient push starts before the last gradient of the
    step is ready: pushes overlap backprop.
(b) Layer 0's forward of step k+1 starts (its AwaitParam completes) before the
    last parameter of version k+1 is delivered: each layer waits only for its
    own parameters, and they arrive in priority order.

Both must hold in every step. The run is built so that a loaded machine cannot
decide them: the first layer's gradient is ready 150 ms after the others (a
layer whose backward waits), and the workers' transport is paced at 200 Mbit/s
(prophet_tf.bench.shaping), so the later layers' 4 MB arrive about 160 ms
after layer 0's parameters.
"""
import os
import sys

import numpy as np
import pytest

from prophet_tf._native import StampKind
from prophet_tf.bench import shaping
from prophet_tf.engine import EngineStamp
from prophet_tf.tools.launch import launch

STEPS = 8
WORKER = os.path.join(os.path.dirname(__file__), "mlp_worker.py")
# Small first layer, large later layers: layer 0's parameters arrive long
# before the last ones when they are pulled in priority order.
MODEL = ["--inputs", "64", "--units", "64,256,512,512,512,512", "--batch", "1024",
         "--optimizer", "sgd", "--backward-delay-ms", "150", "--stamps"]


@pytest.fixture(scope="module")
def stamps(tmp_path_factory):
    prefix = str(tmp_path_factory.mktemp("overlap") / "stamps")
    previous = os.environ.get(shaping.SHAPE_ENV)
    os.environ[shaping.SHAPE_ENV] = "200"  # The workers inherit it.
    try:
        code = launch([sys.executable, WORKER, prefix, str(STEPS), *MODEL],
                      num_workers=2, num_ps=1)
    finally:
        if previous is None:
            os.environ.pop(shaping.SHAPE_ENV)
        else:
            os.environ[shaping.SHAPE_ENV] = previous
    assert code == 0
    return [np.load(f"{prefix}.{i}.npz") for i in range(2)]


def _times(records, kind, step=None, key=None):
    mask = records["kind"] == kind
    if step is not None:
        mask &= records["step"] == step
    if key is not None:
        mask &= records["key"] == key
    return records["t_ns"][mask]


@pytest.mark.timeout(240)
def test_pushes_start_before_backprop_ends(stamps):
    for run in stamps:
        records, keys = run["stamps"], run["keys"]
        overlapped = []
        for step in range(1, STEPS):  # Step 0 includes tracing.
            ready = _times(records, StampKind.READY, step)
            pushes = _times(records, EngineStamp.PUSH_BEGIN, step)
            assert len(ready) == len(keys) and len(pushes) == len(keys), step
            overlapped.append(bool(pushes.min() < ready.max()))
        assert all(overlapped), (
            f"the first push began before the last gradient was ready in only "
            f"{sum(overlapped)} of {len(overlapped)} steps: {overlapped}")


@pytest.mark.timeout(240)
def test_first_layer_forward_starts_before_last_parameter_arrives(stamps):
    for run in stamps:
        records, keys = run["stamps"], run["keys"]
        first_layer = int(keys[0])
        early = []
        for version in range(2, STEPS):
            delivered = _times(records, StampKind.DELIVER, version)
            assert len(delivered) == len(keys), version
            layer0_forward = _times(records, StampKind.AWAIT_END, version, first_layer)
            assert len(layer0_forward) >= 1
            early.append(bool(layer0_forward.min() < delivered.max()))
            # Delivered in priority order: layer 0 before every other layer.
            own = _times(records, StampKind.DELIVER, version, first_layer)
            assert own.min() <= delivered.min()
        assert all(early), (
            f"layer 0's forward began before the last parameter arrived in only "
            f"{sum(early)} of {len(early)} steps: {early}")
