"""Overlap, read from the stamps and timelines of a real 2-worker run (no timing thresholds).

(a) In iteration k, the first gradient push (the timeline's push transfers)
    starts before the last gradient of the iteration is ready (the op
    library's READY stamps): pushes overlap backprop.
(b) Layer 0's forward of step k+1 starts (its AwaitParam completes) before the
    last parameter of version k+1 is delivered: each layer waits only for its
    own parameters. Layer 0's gradient is the last one ready, but the P3
    scheduler sends it ahead of the later layers' slices still waiting, and
    the PS returns each partition the moment it is applied, the most urgent
    first.

Both must hold in every step. The run is built so that a loaded machine cannot
decide them: the first layer's gradient is ready 60 ms after the others and
only once the iteration's first push has begun (a layer whose backward waits
for both: mlp_worker.py), so in a worker that overlaps, (a) holds whatever
the load, and one that does not fails it after its wait runs out. The
workers' transport is paced at 200 Mbit/s (prophet_tf.ps.shaping), so the
later layers' 3.7 MB take about 150 ms each way: layer 0's parameters are
back well before the later layers' last ones.
"""
import json
import os
import sys

import numpy as np
import pytest

from prophet_tf.ps import shaping
from prophet_tf.engine import timeline
from prophet_tf.engine.timeline import StampKind
from prophet_tf.tools.launch import launch

STEPS = 8
WORKER = os.path.join(os.path.dirname(__file__), "mlp_worker.py")
# Small first layer, large later layers: layer 0's parameters arrive long
# before the last ones when its gradient overtakes theirs.
MODEL = ["--inputs", "64", "--units", "64,256,512,512,512,512", "--batch", "1024",
         "--optimizer", "sgd", "--backward-delay-ms", "60", "--stamps"]


@pytest.fixture(scope="module")
def stamps(tmp_path_factory):
    directory = tmp_path_factory.mktemp("overlap")
    prefix = str(directory / "stamps")
    trace = str(directory / "timeline-{worker}.json")
    # The workers inherit both: the link pacing and where to write the timeline.
    settings = {shaping.SHAPE_ENV: "200", timeline.TIMELINE_ENV: trace}
    previous = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        code = launch([sys.executable, WORKER, prefix, str(STEPS), *MODEL],
                      num_workers=2, num_ps=1, scheduler="p3")
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value
    assert code == 0
    runs = []
    for i in range(2):
        with open(trace.replace("{worker}", str(i))) as f:
            events = json.load(f)["traceEvents"]
        runs.append((np.load(f"{prefix}.{i}.npz"), [e for e in events if e.get("cat") == "push"]))
    return runs


def _times(records, kind, step=None, key=None):
    mask = records["kind"] == kind
    if step is not None:
        mask &= records["step"] == step
    if key is not None:
        mask &= records["key"] == key
    return records["t_ns"][mask]


@pytest.mark.timeout(240)
def test_pushes_start_before_backprop_ends(stamps):
    for run, pushes in stamps:
        records, keys = run["stamps"], run["keys"]
        overlapped = []
        for iteration in range(1, STEPS):  # Iteration 0 includes tracing.
            ready = _times(records, StampKind.READY, iteration)
            mine = [e for e in pushes if e["args"]["step"] == iteration]
            pushed = {name for e in mine for name in e["args"]["keys"]}
            assert len(ready) == len(keys) and len(pushed) == len(keys), iteration
            first_push_ns = min(e["ts"] for e in mine) * 1e3  # the trace is in µs
            overlapped.append(bool(first_push_ns < ready.max()))
        assert all(overlapped), (
            f"the first push began before the last gradient was ready in only "
            f"{sum(overlapped)} of {len(overlapped)} iterations: {overlapped}")


@pytest.mark.timeout(240)
def test_first_layer_forward_starts_before_last_parameter_arrives(stamps):
    for run, _ in stamps:
        records, keys = run["stamps"], run["keys"]
        first_layer = int(keys[0])
        early = []
        for version in range(2, STEPS):
            delivered = _times(records, StampKind.DELIVER, version)
            assert len(delivered) == len(keys), version
            layer0_forward = _times(records, StampKind.AWAIT_END, version, first_layer)
            assert len(layer0_forward) >= 1
            early.append(bool(layer0_forward.min() < delivered.max()))
        assert all(early), (
            f"layer 0's forward began before the last parameter arrived in only "
            f"{sum(early)} of {len(early)} steps: {early}")
