"""Load: 8 worker processes against 2 real PS tasks, with injected retries.

The workers (``load_worker.py``: plain PSClient, no TensorFlow) push
integer-valued float32 gradients for a model spread over both PS tasks and
pull every version, checking it against numpy as they go; they resend pushes
whose response was "lost" and retry pushes sent with a deadline too short to
make it. At the end the test pulls the last version itself: every parameter
must equal the numpy value exactly, i.e. no update was lost or counted twice.
It prints the wall time and each PS's peak memory (VmHWM).
"""

import concurrent.futures
import contextlib
import json
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest

import ps_helpers
from prophet_tf.ps import client as ps_client

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import load_worker  # noqa: E402
from conftest import ROOT, _reap, run_ps  # noqa: E402

WORKERS, NUM_PS = 8, 2


def peak_memory_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmHWM for pid {pid}")


@contextlib.contextmanager
def ps_tasks_in_parallel(tmp_path):
    """The PS tasks, started together (each imports TensorFlow: seconds)."""
    managers = []
    for i in range(NUM_PS):
        directory = tmp_path / f"ps{i}"
        directory.mkdir()
        managers.append(run_ps(directory, "--num-workers", str(WORKERS), "--num-ps",
                               str(NUM_PS), "--ps-index", str(i), "--max-partition-bytes",
                               str(load_worker.MAX_PARTITION_BYTES), "--worker-timeout", "600"))
    with contextlib.ExitStack() as stack:
        with concurrent.futures.ThreadPoolExecutor(NUM_PS) as pool:
            futures = [pool.submit(m.__enter__) for m in managers]
        tasks, errors = [], []
        for manager, future in zip(managers, futures):
            try:
                tasks.append(future.result())
                stack.push(manager.__exit__)
            except Exception as e:  # that task reaped itself; the others are stopped below
                errors.append(e)
        if errors:
            raise errors[0]
        yield tasks


def run_load(tmp_path, steps, retry_p=0.1, seed=0):
    with ps_tasks_in_parallel(tmp_path) as ps_tasks:
        return drive(ps_tasks, tmp_path, steps, retry_p, seed)


def drive(ps_tasks, tmp_path, steps, retry_p, seed):
    addresses = ",".join(ps.address for ps in ps_tasks)
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    procs, logs = [], []
    started = time.monotonic()
    try:
        for w in range(WORKERS):
            log = open(tmp_path / f"worker{w}.log", "wb")
            logs.append(log)
            procs.append(subprocess.Popen(
                [sys.executable, str(HERE / "load_worker.py"), "--ps", addresses,
                 "--worker", str(w), "--workers", str(WORKERS), "--steps", str(steps),
                 "--retry-p", str(retry_p), "--seed", str(seed),
                 "--out", str(tmp_path / f"worker{w}.json")],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT))
        deadline = time.monotonic() + 600
        for w, proc in enumerate(procs):
            code = proc.wait(max(1.0, deadline - time.monotonic()))
            assert code == 0, (f"worker {w} exited with {code}:\n"
                               f"{(tmp_path / f'worker{w}.log').read_text()[-4000:]}")
        wall = time.monotonic() - started
    finally:
        for proc in procs:
            _reap(proc)
        for log in logs:
            log.close()
    results = [json.loads((tmp_path / f"worker{w}.json").read_text()) for w in range(WORKERS)]

    # The final parameters, pulled by the test itself, against numpy.
    expected = load_worker.expected_after(steps, WORKERS)
    plan = load_worker.sharding.plan(load_worker.specs(), NUM_PS,
                                     load_worker.MAX_PARTITION_BYTES, spread=True)
    by_id = {(p.key, p.partition): p for p in plan}
    values = {k: np.zeros(s, np.float32) for k, (_, s) in load_worker.SHAPES.items()}
    for i, ps in enumerate(ps_tasks):
        owned = load_worker.sharding.owned_by(plan, i)
        assert owned, f"PS {i} owns nothing: the model does not spread over both"
        with ps_client.PSClient(ps.address, 0, WORKERS) as client:
            for chunk in client.pull(owned, steps, timeout=60):
                assert chunk.version == steps
                ps_helpers.write_chunk(chunk, values, by_id)
    for key in expected:
        np.testing.assert_array_equal(values[key], expected[key], err_msg=f"variable {key}")

    peaks = [peak_memory_mb(ps.proc.pid) for ps in ps_tasks]
    for ps in ps_tasks:
        assert ps.proc.poll() is None
        assert "Traceback" not in ps.log(), ps.log()[-4000:]
    totals = {k: sum(r[k] for r in results) for k in results[0] if k not in ("worker",)}
    print(f"{WORKERS} workers x {steps} steps against {NUM_PS} PS tasks: wall {wall:.1f} s "
          f"(slowest worker {max(r['seconds'] for r in results):.1f} s); PS peak memory "
          f"(VmHWM) {', '.join(f'{p:.0f} MB' for p in peaks)}")
    print("injected: " + ", ".join(f"{k}={v}" for k, v in totals.items() if k != "seconds"))
    # The retries really happened, and the PS told the copies apart.
    assert totals["resent"] > 0 and totals["short_deadline"] > 0
    assert totals["deadline_exceeded"] > 0
    assert totals["duplicates"] > 0
    return wall, peaks, totals


@pytest.mark.timeout(180)
def test_load_8_workers_50_steps(tmp_path):
    run_load(tmp_path, steps=50)


@pytest.mark.slow  # the full size; `pytest --runslow` runs it (20-80 s here)
@pytest.mark.timeout(300)
def test_load_8_workers_200_steps(tmp_path):
    run_load(tmp_path, steps=200, seed=1)
