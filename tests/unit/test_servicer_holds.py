"""Pushes first on the PS: answers to other hosts' workers wait for the local pusher."""
import concurrent.futures
import time

import grpc
import keras
import pytest

from prophet_tf.ps.holds import AnswerHolds
from prophet_tf.ps.v1 import ps_pb2
from test_servicer import (Context, config, expect_abort, grad_chunks, ints,  # noqa: F401
                           initial, make_servicer, plan, push, register)

pytestmark = pytest.mark.timeout(120)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_a_hold_names_its_workers_and_ends_when_the_step_is_pushed():
    holds = AnswerHolds(limit_s=30, clock=Clock())
    assert not holds.held_locked(1, 5)  # nothing waits before a pusher speaks
    assert holds.pushed_locked(0, 3, [1, 2])
    assert not holds.held_locked(1, 4)  # version 4 needs step 3: pushed
    assert holds.held_locked(1, 5) and holds.held_locked(2, 5)
    assert not holds.held_locked(0, 5) and not holds.held_locked(3, 5)  # not named
    assert not holds.pushed_locked(0, 3, [1, 2])  # a repeated notice changes nothing
    assert holds.pushed_locked(0, 4, [1, 2])
    assert not holds.held_locked(1, 5)
    holds.forget_locked(0)
    assert not holds.held_locked(1, 9)


def test_a_hold_lapses_after_the_limit_and_says_so(caplog):
    clock = Clock()
    holds = AnswerHolds(limit_s=30, clock=clock)
    holds.pushed_locked(0, 0, [1])
    assert holds.held_locked(1, 2)  # the clock of this hold starts here
    clock.now += 29
    assert holds.held_locked(1, 2)
    clock.now += 2
    assert not holds.held_locked(1, 2)
    assert "has not pushed step 1 within 30 s" in caplog.text
    assert not holds.held_locked(1, 7)  # the pusher is forgotten until it speaks again
    holds.pushed_locked(0, 5, [1])
    assert holds.held_locked(1, 7)


def test_limit_must_be_positive():
    with pytest.raises(ValueError, match="limit_s must be > 0. Received: 0"):
        AnswerHolds(limit_s=0)


def pushed(servicer, worker_id, step, workers):
    return servicer.Pushed(ps_pb2.PushedRequest(worker_id=worker_id, step=step,
                                                workers=workers), Context())


def pulled_versions(servicer, worker_id, min_version, timeout=10.0):
    request = ps_pb2.PullRequest(worker_id=worker_id, min_version=min_version, items=[
        ps_pb2.KeyPartition(key=p.key, partition=p.partition) for p in plan()])
    return {ps_pb2.ParameterChunk.FromString(b).version
            for b in servicer.Pull(request, Context(timeout))}


def owed(servicer, version, workers):
    return servicer.Owed(ps_pb2.OwedRequest(worker_id=0, max_version=version, workers=workers),
                         Context()).partitions


def step(servicer, n):
    """Both workers push step n; returns once version n+1 is applied."""
    for worker in (0, 1):
        push(servicer, worker, grad_chunks(ints(10 * n + worker), n))
    assert pulled_versions(servicer, 0, n + 1) == {n + 1}  # worker 0's answers never wait


def test_answers_of_the_next_version_wait_for_the_local_pushers_step(make_servicer):
    servicer = make_servicer()
    cfg = config(keras.optimizers.SGD(1.0))
    register(servicer, 0, cfg, initial())
    register(servicer, 1, cfg)
    pushed(servicer, 0, 0, [1])  # worker 0 is on this PS's host, worker 1 is not
    step(servicer, 0)
    assert pulled_versions(servicer, 1, 1) == {1}  # step 0 is pushed: version 1 goes
    step(servicer, 1)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(pulled_versions, servicer, 1, 2)
        deadline = time.monotonic() + 10
        while owed(servicer, 2, [1]) != len(plan()) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)
        assert not waiting.done()  # version 2 is applied, but worker 0 still pushes step 1
        assert owed(servicer, 2, [1]) == len(plan())  # held answers are owed
        pushed(servicer, 0, 1, [1])
        assert waiting.result(10) == {2}
    assert owed(servicer, 2, [1]) == 0


def test_a_leaving_pusher_holds_nothing(make_servicer):
    servicer = make_servicer()
    cfg = config(keras.optimizers.SGD(1.0))
    register(servicer, 0, cfg, initial())
    register(servicer, 1, cfg)
    pushed(servicer, 0, 0, [1])
    step(servicer, 0)
    step(servicer, 1)
    servicer.Heartbeat(ps_pb2.HeartbeatRequest(worker_id=0, steps_pushed=2, leaving=True),
                       Context())
    assert pulled_versions(servicer, 1, 2) == {2}


@pytest.mark.parametrize("fields, fragment", [
    (dict(worker_id=2, step=0, workers=[1]), "worker_id must be in [0, 2). Received: worker_id=2"),
    (dict(worker_id=0, step=-1, workers=[1]), "step must be >= 0. Received: step=-1"),
    (dict(worker_id=0, step=0, workers=[1, 5, -1]), "Received: workers=[-1, 5]"),
])
def test_a_bad_pushed_notice_is_refused_and_holds_nothing(make_servicer, fields, fragment):
    servicer = make_servicer()
    cfg = config(keras.optimizers.SGD(1.0))
    register(servicer, 0, cfg, initial())
    register(servicer, 1, cfg)
    expect_abort(servicer.Pushed, ps_pb2.PushedRequest(**fields),
                 grpc.StatusCode.INVALID_ARGUMENT, fragment)
    step(servicer, 0)
    step(servicer, 1)
    assert pulled_versions(servicer, 1, 2) == {2}  # nothing was held
