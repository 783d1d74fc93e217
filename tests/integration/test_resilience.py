"""Failures are detected and named within 30 s; PS checkpoints resume a killed job.

Real PS processes and real worker processes (resilience_worker.py) on
loopback. The clusters are started by hand (not by the launcher, which would
stop everyone as soon as one task dies): this is what a TF_CONFIG job on
several hosts sees.
"""
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from cluster import WorkerProcesses, child_env

WORKER = pathlib.Path(__file__).with_name("resilience_worker.py")
DETECTION_LIMIT_S = 30.0


def _workers(log_dir: pathlib.Path, ps_address: str, args) -> WorkerProcesses:
    """Two resilience workers for one PS (reaped by the caller's `finally`)."""
    return WorkerProcesses(log_dir, [ps_address], 2, [sys.executable, str(WORKER), *args],
                           child_env())


def _wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def _exit_time(proc: subprocess.Popen, since: float, limit: float) -> float:
    try:
        proc.wait(max(since + limit - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        raise AssertionError(f"process {proc.args[:3]} still running {limit} s after the "
                             "failure") from None
    return time.monotonic() - since


@pytest.mark.timeout(240)
def test_a_killed_worker_fails_the_others_and_the_ps_naming_it(tmp_path, start_ps):
    ps = start_ps("--num-workers", "2")
    progress = tmp_path / "progress"
    cluster = _workers(tmp_path, ps.address,
                       [str(tmp_path / "out"), "--epochs", "1000", "--die-worker", "1",
                       "--die-at", "6", "--progress", str(progress), "--step-delay", "0.05"])
    try:
        _wait_until(lambda: cluster.procs[1].poll() is not None, 180, "worker 1 to die")
        died = time.monotonic()
        assert cluster.procs[1].returncode == -signal.SIGKILL, cluster.log(1)
        worker_s = _exit_time(cluster.procs[0], died, DETECTION_LIMIT_S)
        ps_s = _exit_time(ps.proc, died, DETECTION_LIMIT_S)
        assert cluster.procs[0].returncode not in (0, None)
        assert ps.proc.returncode == 1
        assert "Worker 1 was lost" in cluster.log(0), cluster.log(0)[-3000:]
        assert "Worker 1 was lost" in ps.log(), ps.log()[-3000:]
        print(f"detected: worker 0 exited {worker_s:.1f} s and the PS {ps_s:.1f} s after "
              "worker 1 was killed")
    finally:
        cluster.reap()


@pytest.mark.timeout(240)
def test_a_killed_ps_fails_the_workers_naming_its_address(tmp_path, start_ps):
    ps = start_ps("--num-workers", "2")
    progress = tmp_path / "progress"
    cluster = _workers(tmp_path, ps.address,
                       [str(tmp_path / "out"), "--epochs", "1000", "--progress", str(progress),
                       "--step-delay", "0.05"])
    try:
        _wait_until(lambda: progress.exists() and int(progress.read_text() or 0) >= 5, 180,
                    "5 training steps")
        ps.proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        times = [_exit_time(p, killed, DETECTION_LIMIT_S) for p in cluster.procs]
        for i, p in enumerate(cluster.procs):
            assert p.returncode not in (0, None)
            assert ps.address in cluster.log(i), cluster.log(i)[-3000:]
        print(f"detected: workers exited {max(times):.1f} s after the PS was killed")
    finally:
        cluster.reap()


@pytest.mark.timeout(420)
def test_a_killed_job_resumes_from_checkpoints_to_the_same_weights(tmp_path, start_ps):
    """Worker 1 dies in epoch 3; the relaunch resumes from the epoch-2 backup
    (BackupAndRestore) and the PS checkpoint of the same step, and ends with
    the weights of a run that was never interrupted (computed here, to the bit)."""
    steps_per_epoch, epochs = 5, 4
    common = ["--epochs", str(epochs), "--steps-per-epoch", str(steps_per_epoch)]
    checkpoints, backup = tmp_path / "ckpt", tmp_path / "backup"
    ps_args = ["--num-workers", "2", "--checkpoint-dir", str(checkpoints),
               "--checkpoint-steps", str(steps_per_epoch)]
    job = [str(tmp_path / "job"), *common, "--backup", str(backup), "--die-worker", "1",
           "--die-at", "13", "--die-once", str(tmp_path / "died")]
    # Attempt 1: worker 1 dies at step 13 (epoch 3), the rest fail.
    ps1 = start_ps(*ps_args)
    (tmp_path / "a1").mkdir()
    first = _workers(tmp_path / "a1", ps1.address, job)
    try:
        codes = first.wait(300)
        ps1.proc.wait(60)
    finally:
        first.reap()
    assert codes[1] == -signal.SIGKILL and codes[0] != 0, (codes, first.log(0)[-2000:])
    assert sorted(os.listdir(checkpoints)) == ["ckpt-000000005", "ckpt-000000010"]
    # Attempt 2: everything restarts; the PS restores step 10 = the backup's.
    ps2 = start_ps(*ps_args)
    (tmp_path / "a2").mkdir()
    second = _workers(tmp_path / "a2", ps2.address, job)
    try:
        assert second.wait(300) == [0, 0], second.log(0)[-3000:] + second.log(1)[-3000:]
    finally:
        second.reap()
    assert "Restored the checkpoint of step 10" in ps2.log()
    assert "done after 20 steps" in second.log(0)
    import keras_worker  # TensorFlow in this process: only for the reference.
    import resilience_worker

    keras_worker.limit_threads()  # one intra-op thread, as in the workers
    expected = resilience_worker.reference(epochs, steps_per_epoch, workers=2)
    for i in range(2):
        with np.load(tmp_path / f"job.{i}.npz") as got:
            assert got.files == [f"arr_{j}" for j in range(len(expected))], got.files
            for j, want in enumerate(expected):
                np.testing.assert_allclose(got[f"arr_{j}"], want, rtol=1e-6, atol=1e-7)
