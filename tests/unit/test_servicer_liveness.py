"""The servicer's heartbeats, lost and departed workers, and checkpoints.

Same in-process servicer and helpers as test_servicer.py; checkpoints go to
a real directory.
"""
import os
import threading
import time

import grpc
import keras
import numpy as np
import pytest

from prophet_tf.ps import checkpoint as checkpoint_lib
from prophet_tf.ps import liveness
import ps_helpers
from prophet_tf.ps.v1 import ps_pb2
from test_servicer import (Context, config, expect_abort, grad_chunks, initial,  # noqa: F401
                           ints, make_servicer, plan, pull, push, register, specs)

pytestmark = pytest.mark.timeout(120)


def heartbeat(servicer, worker_id, steps=0, leaving=False):
    return servicer.Heartbeat(ps_pb2.HeartbeatRequest(
        worker_id=worker_id, steps_pushed=steps, leaving=leaving), Context()).failure


def train(servicer, steps, first=0, seed=0):
    """Both workers push `steps` steps of integer gradients from step `first`."""
    for step in range(first, first + steps):
        for worker in (0, 1):
            push(servicer, worker, grad_chunks(ints(seed + 10 * step + worker), step))
        pull(servicer, step + 1)


# ------------------------------------------------------------------ liveness

class _Clock:
    """A monotonic clock that moves only when told to."""

    def __init__(self):
        self.now = time.monotonic()

    def monotonic(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    """The clock the PS reads heartbeats on, moved by the test alone: which
    worker is lost then follows from what the test sends, not from how
    promptly a loaded machine runs its threads. The watchdog still wakes on
    real time."""
    fake = _Clock()
    monkeypatch.setattr(liveness, "time", fake)
    return fake


def test_a_silent_worker_is_lost_and_fails_waiting_pulls(make_servicer, clock):
    failures = []
    servicer = make_servicer(worker_timeout_s=0.5, on_failure=failures.append)
    cfg = config(keras.optimizers.SGD(1.0))
    register(servicer, 0, cfg, initial())
    register(servicer, 1, cfg)
    heartbeat(servicer, 0)
    heartbeat(servicer, 1)  # watched from now on; then silent

    def worker_1_falls_silent():
        time.sleep(0.2)  # the pull below is waiting by then, most likely
        clock.advance(0.3)
        heartbeat(servicer, 0)
        clock.advance(0.3)  # worker 1 silent for 0.6 s, worker 0 for 0.3 s
        heartbeat(servicer, 0)

    silence = threading.Thread(target=worker_1_falls_silent)
    silence.start()
    try:
        push(servicer, 0, grad_chunks(ints(1), 0))
        # Failed by the lost worker, not at its own deadline (DEADLINE_EXCEEDED).
        details = expect_abort(servicer.Pull, ps_pb2.PullRequest(
            worker_id=0, min_version=1, items=[ps_pb2.KeyPartition(key=1, partition=0)]),
            grpc.StatusCode.FAILED_PRECONDITION, "Worker 1 was lost",
            context=Context(timeout=30))
        assert "Worker 0" not in details
        deadline = time.monotonic() + 5
        while not failures and time.monotonic() < deadline:
            time.sleep(0.01)
        assert failures and "Worker 1 was lost" in failures[0]
        assert "Worker 1 was lost" in heartbeat(servicer, 0)
        assert servicer.failure == failures[0]
    finally:
        silence.join()


def test_a_worker_that_never_connects_fails_the_job(make_servicer, clock):
    servicer = make_servicer(startup_timeout_s=0.5)
    cfg = config(keras.optimizers.SGD(1.0))
    register(servicer, 0, cfg, initial())
    heartbeat(servicer, 0)
    clock.advance(0.4)
    heartbeat(servicer, 0)
    time.sleep(0.5)  # watchdog checks, within the limit
    assert servicer.failure is None
    clock.advance(0.2)
    heartbeat(servicer, 0)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and servicer.failure is None:
        time.sleep(0.05)
    assert "Worker 1 never connected" in (servicer.failure or "")


def test_clients_that_send_no_heartbeat_are_not_watched(make_servicer):
    servicer = make_servicer(worker_timeout_s=0.2, startup_timeout_s=0.2)
    cfg = config(keras.optimizers.SGD(1.0))
    register(servicer, 0, cfg, initial())
    register(servicer, 1, cfg)
    time.sleep(1.0)
    assert servicer.failure is None
    train(servicer, 1)


def test_heartbeats_keep_a_slow_worker_alive(make_servicer, clock):
    # A heartbeat every second of the PS's clock against a 3 s limit, for 5
    # s: without them the job would fail. Between two, the watchdog (every
    # 0.75 s) checks at least once.
    servicer = make_servicer(worker_timeout_s=3.0)
    cfg = config(keras.optimizers.SGD(1.0))
    register(servicer, 0, cfg, initial())
    register(servicer, 1, cfg)
    for _ in range(6):
        assert heartbeat(servicer, 0) == "" and heartbeat(servicer, 1) == ""
        time.sleep(0.8)
        assert servicer.failure is None
        clock.advance(1.0)
    assert heartbeat(servicer, 0) == "" and servicer.failure is None


def test_a_departed_worker_fails_pulls_it_can_never_complete(make_servicer):
    servicer = make_servicer()
    cfg = config(keras.optimizers.SGD(1.0))
    register(servicer, 0, cfg, initial())
    register(servicer, 1, cfg)
    train(servicer, 2)
    assert heartbeat(servicer, 1, steps=2, leaving=True) == ""
    _, versions = pull(servicer, 2)  # what it pushed is complete
    assert set(versions.values()) == {2}
    push(servicer, 0, grad_chunks(ints(5), 2))
    expect_abort(servicer.Pull, ps_pb2.PullRequest(
        worker_id=0, min_version=3, items=[ps_pb2.KeyPartition(key=0, partition=0)]),
        grpc.StatusCode.FAILED_PRECONDITION, "worker 1 left the job after pushing 2 steps",
        "min_version=3")
    assert servicer.failure is None  # not a job failure: worker 0 may be done too


@pytest.mark.parametrize("request_fields, code, fragment", [
    (dict(worker_id=5), grpc.StatusCode.INVALID_ARGUMENT, "worker_id=5"),
    (dict(worker_id=0, steps_pushed=-1), grpc.StatusCode.INVALID_ARGUMENT, "steps_pushed=-1"),
])
def test_bad_heartbeats_are_rejected(make_servicer, request_fields, code, fragment):
    servicer = make_servicer()
    register(servicer, 0, config(keras.optimizers.SGD(1.0)), initial())
    expect_abort(servicer.Heartbeat, ps_pb2.HeartbeatRequest(**request_fields), code, fragment)
    assert servicer.failure is None


# --------------------------------------------------------------- checkpoints

def _policy(tmp_path, **kwargs):
    return checkpoint_lib.CheckpointPolicy(str(tmp_path / "ckpt"), **kwargs)


def test_checkpoints_restore_parameters_optimizer_state_and_step(make_servicer, tmp_path):
    cfg = config(keras.optimizers.Adam(0.1))
    first = make_servicer(checkpoint=_policy(tmp_path, every_steps=2, keep=2))
    register(first, 0, cfg, initial())
    register(first, 1, cfg)
    train(first, 4)
    first.close()  # writes what is queued
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["ckpt-000000002", "ckpt-000000004"]
    reference, _ = pull(first, 4)
    # A new PS restores step 4 and continues exactly like the first one.
    second = make_servicer(checkpoint=_policy(tmp_path, every_steps=2, keep=2))
    assert register(second, 0, cfg, initial(seed=99)).version == 4  # its values are ignored
    assert register(second, 1, cfg).version == 4
    restored, versions = pull(second, 4)
    assert set(versions.values()) == {4}
    for key in reference:
        np.testing.assert_array_equal(restored[key], reference[key])
    # Without the checkpoint the Adam moments would start afresh: compare a
    # step from each against a PS that trained 5 steps without a break.
    train(second, 1, first=4)
    straight = make_servicer()
    register(straight, 0, cfg, initial())
    register(straight, 1, cfg)
    train(straight, 5)
    expected, _ = pull(straight, 5)
    got, _ = pull(second, 5)
    for key in expected:
        np.testing.assert_array_equal(got[key], expected[key])


def register_resuming(servicer, worker_id, cfg, resume_step, values=None):
    chunks = []
    if values is not None:
        for c in ps_helpers.gradient_chunks(values, plan(), 0):
            chunks.append(ps_pb2.ParameterChunk(key=c.key, partition=c.partition,
                                                dtype=c.array.dtype.name,
                                                data=c.array.tobytes()))
    return servicer.Register(ps_pb2.RegisterRequest(
        worker_id=worker_id, num_workers=2, variables=specs(), optimizer_config=cfg,
        initial_values=chunks, resume_step=resume_step), Context())


def test_workers_resuming_from_a_backup_get_the_checkpoint_of_that_step(make_servicer,
                                                                        tmp_path):
    cfg = config(keras.optimizers.SGD(1.0))
    first = make_servicer(checkpoint=_policy(tmp_path, every_steps=1, keep=5))
    register(first, 0, cfg, initial())
    register(first, 1, cfg)
    train(first, 2)
    at_2, _ = pull(first, 2)
    train(first, 1, first=2)
    first.close()
    second = make_servicer(checkpoint=_policy(tmp_path, every_steps=1, keep=5))
    assert register_resuming(second, 0, cfg, 2).version == 2  # not the newest, 3
    restored, versions = pull(second, 2)
    assert set(versions.values()) == {2}
    for key in at_2:
        np.testing.assert_array_equal(restored[key], at_2[key])
    # Every worker must resume from the same step.
    expect_abort(second.Register, ps_pb2.RegisterRequest(
        worker_id=1, num_workers=2, variables=specs(), optimizer_config=cfg, resume_step=3),
        grpc.StatusCode.INVALID_ARGUMENT, "resume_step=3", "resumed from step 2")


def test_resuming_without_a_checkpoint_starts_from_worker_0s_values(make_servicer):
    servicer = make_servicer()
    cfg = config(keras.optimizers.SGD(1.0))
    values = initial()
    assert register_resuming(servicer, 1, cfg, 7).version == 7
    assert register_resuming(servicer, 0, cfg, 7, values).version == 7
    got, versions = pull(servicer, 7)
    assert set(versions.values()) == {7}
    for key in values:
        np.testing.assert_array_equal(got[key], values[key])
    # The next step is 7: a push of step 0 is from the past.
    expect_abort(servicer.Push, ps_pb2.PushRequest(worker_id=0, chunks=grad_chunks(ints(1), 0)),
                 grpc.StatusCode.FAILED_PRECONDITION, "from the past")
    push(servicer, 0, grad_chunks(ints(1), 7))
    push(servicer, 1, grad_chunks(ints(2), 7))
    after, _ = pull(servicer, 8)
    for key in values:
        np.testing.assert_array_equal(after[key], values[key] - (ints(1)[key] + ints(2)[key]))


def test_a_checkpoint_of_another_model_is_refused(make_servicer, tmp_path):
    cfg = config(keras.optimizers.SGD(1.0))
    first = make_servicer(checkpoint=_policy(tmp_path, every_steps=1))
    register(first, 0, cfg, initial())
    register(first, 1, cfg)
    train(first, 1)
    first.close()
    second = make_servicer(checkpoint=_policy(tmp_path, every_steps=1))
    other = specs()
    other[1].name = "other/bias"
    request = ps_pb2.RegisterRequest(worker_id=0, num_workers=2, variables=other,
                                     optimizer_config=cfg)
    expect_abort(second.Register, request, grpc.StatusCode.FAILED_PRECONDITION,
                 "of another model", "other/bias")


def test_checkpoint_writes_are_atomic_and_debris_is_removed(tmp_path):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    (directory / ".tmp-ckpt-000000009-123").mkdir()  # a crash mid-write
    checkpointer = checkpoint_lib.Checkpointer(_policy(tmp_path, every_steps=3, keep=2))
    assert not (directory / ".tmp-ckpt-000000009-123").exists()
    assert checkpointer.steps() == []
    assert [s for s in range(1, 10) if checkpointer.due(s)] == [3, 6, 9]
    for step in (3, 6, 9):
        checkpointer.save(checkpoint_lib.Snapshot(step, {"x": 1}, {(0, 0): np.full(3, step)},
                                                  ["iterations"], [np.int64(step)]))
    checkpointer.flush()
    assert checkpointer.steps() == [6, 9]  # keep=2
    snapshot = checkpointer.load(9)
    np.testing.assert_array_equal(snapshot.params[0, 0], np.full(3, 9))
    assert snapshot.optimizer_values[0] == 9 and snapshot.signature == {"x": 1}
    (directory / "ckpt-000000009" / "state.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="ckpt-000000009"):
        checkpointer.load(9)
    checkpointer.close()


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(), "every_steps or every_secs"),
    (dict(every_steps=0), "every_steps=0"),
    (dict(every_secs=-1.0), "every_secs=-1.0"),
    (dict(every_steps=1, keep=0), "keep=0"),
])
def test_bad_checkpoint_policies_are_rejected(tmp_path, kwargs, fragment):
    with pytest.raises(ValueError, match="Received") as info:
        checkpoint_lib.CheckpointPolicy(str(tmp_path), **kwargs)
    assert fragment in str(info.value)
