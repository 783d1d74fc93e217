"""A loss-scaled model on the PS: each step applied or skipped as all workers' verdicts say."""
import concurrent.futures
import json

import grpc
import keras
import numpy as np
import pytest

from prophet_tf import keras_optimizer, optimizer_policy
from prophet_tf.ps.v1 import ps_pb2
from test_servicer import (LIMIT, SHAPES, Context, expect_abort, grad_chunks,  # noqa: F401
                           initial, lr_schedule, make_servicer, pull, push, register, specs,
                           start_against_keras)

pytestmark = pytest.mark.timeout(120)


def scaled_config(optimizer, variables=None):
    return keras_optimizer.config_json(optimizer, variables, loss_scaling=True)


def verdict_request(worker_id, step, finite):
    return ps_pb2.GatherRequest(worker_id=worker_id, round=step,
                                payload=b"\x01" if finite else b"\x00")


def verdicts(servicer, step, finite_by_worker):
    """Every worker's Verdict call, concurrently (each waits for all); their answers."""
    with concurrent.futures.ThreadPoolExecutor(len(finite_by_worker)) as pool:
        calls = [pool.submit(servicer.Verdict, verdict_request(w, step, f), Context())
                 for w, f in enumerate(finite_by_worker)]
        return [[p == b"\x01" for p in c.result(timeout=30).payloads] for c in calls]


def random_grads(rng):
    return {k: rng.standard_normal(s).astype(np.float32) for k, (_, s) in SHAPES.items()}


@pytest.mark.parametrize("clipping", [{}, {"global_clipnorm": 1.0}],
                         ids=["plain", "global-clipnorm"])
def test_steps_wait_for_the_verdicts_then_apply_or_skip_like_single_process(make_servicer,
                                                                          clipping):
    """With global_clipnorm the PS clips the (unscaled) sums of the applied steps."""
    servicer = make_servicer()
    values = initial(3)
    reference_vars = [keras.Variable(values[k]) for k in SHAPES]
    reference = keras.optimizers.Adam(0.1, **clipping)
    reference.build(reference_vars)
    cfg = scaled_config(keras.optimizers.Adam(0.1, **clipping))
    register(servicer, 0, cfg, values)
    register(servicer, 1, cfg)
    rng = np.random.default_rng(7)
    overflowed_step = 1
    for step in range(4):
        grads = [random_grads(rng) for _ in range(2)]
        if step == overflowed_step:
            grads[1][0][2, 1] = np.inf  # one worker, one partition of one variable
        push(servicer, 0, grad_chunks(grads[0], step))
        push(servicer, 1, grad_chunks(grads[1], step))  # accepted: the verdicts decide
        # Complete sums wait for the verdicts: no partition reaches step + 1.
        expect_abort(servicer.Pull, ps_pb2.PullRequest(
            worker_id=0, min_version=step + 1, items=[ps_pb2.KeyPartition(key=0, partition=0)]),
            grpc.StatusCode.DEADLINE_EXCEEDED, context=Context(timeout=0.3))
        finite = [True, step != overflowed_step]
        assert verdicts(servicer, step, finite) == [finite, finite]
        if all(finite):
            reference.apply([grads[0][k] + grads[1][k] for k in SHAPES], reference_vars)
        got, versions = pull(servicer, step + 1)
        assert set(versions.values()) == {step + 1}
        for k, variable in enumerate(reference_vars):
            # Exact Adam after the skip: its iteration count did not advance.
            np.testing.assert_allclose(got[k], variable.numpy(), rtol=1e-6, atol=1e-7,
                                       err_msg=f"{SHAPES[k][0]} at step {step}")


@pytest.mark.parametrize("name", sorted(optimizer_policy.SUPPORTED_OPTIMIZERS))
def test_every_builtin_optimizer_skips_an_overflowed_step_as_loss_scaling_does(
        make_servicer, name):
    """Each optimizer the policy supports as a LossScaleOptimizer's inner one, its rate
    from a schedule, decaying weights, the kernel in three partitions: the overflowed
    step is skipped everywhere and its iteration (schedule, bias corrections, Nadam's
    product) does not count, as Keras' LossScaleOptimizer skips its inner apply."""
    servicer = make_servicer(max_partition_bytes=LIMIT)
    reference_vars, _, reference_apply, _ = start_against_keras(
        servicer, lambda: getattr(keras.optimizers, name)(lr_schedule(), weight_decay=0.01),
        initial(5), make_config=scaled_config)
    rng = np.random.default_rng(9)
    for step in range(4):
        grads = [random_grads(rng) for _ in range(2)]
        finite = [True, step != 1]
        if not finite[1]:
            grads[1][0][3, 0] = np.nan
        for worker in (0, 1):
            push(servicer, worker, grad_chunks(grads[worker], step))
        verdicts(servicer, step, finite)
        if all(finite):
            reference_apply([grads[0][k] + grads[1][k] for k in SHAPES])
        got, _ = pull(servicer, step + 1)
        for k, variable in enumerate(reference_vars):
            np.testing.assert_allclose(got[k], variable.numpy(), rtol=2e-6, atol=1e-7,
                                       err_msg=f"{name}: {SHAPES[k][0]} at step {step}")


def test_a_verdict_before_the_pushes_decides_them_when_they_complete(make_servicer):
    servicer = make_servicer()
    values = initial(4)
    cfg = scaled_config(keras.optimizers.SGD(1.0))
    register(servicer, 0, cfg, values)
    register(servicer, 1, cfg)
    assert verdicts(servicer, 0, [False, True]) == [[False, True]] * 2
    grads = random_grads(np.random.default_rng(1))
    push(servicer, 0, grad_chunks(grads, 0))
    push(servicer, 1, grad_chunks(grads, 0))
    got, versions = pull(servicer, 1)
    assert set(versions.values()) == {1}
    for k in SHAPES:
        np.testing.assert_array_equal(got[k], values[k])  # skipped: the values kept


def test_verdicts_are_refused_without_loss_scaling_or_with_a_bad_payload(make_servicer):
    plain = make_servicer()
    cfg = keras_optimizer.config_json(keras.optimizers.SGD(1.0))
    register(plain, 0, cfg, initial())
    register(plain, 1, cfg)
    expect_abort(plain.Verdict, verdict_request(0, 0, True),
                 grpc.StatusCode.FAILED_PRECONDITION, "LossScaleOptimizer", "step 0")
    # Without loss scaling an overflowed gradient still fails the push at once.
    grads = random_grads(np.random.default_rng(2))
    grads[1][0] = np.nan
    expect_abort(plain.Push, ps_pb2.PushRequest(worker_id=0, chunks=grad_chunks(grads, 0)),
                 grpc.StatusCode.INVALID_ARGUMENT, "NaN or Inf")

    scaled = make_servicer()
    cfg = scaled_config(keras.optimizers.SGD(1.0))
    register(scaled, 0, cfg, initial())
    register(scaled, 1, cfg)
    expect_abort(scaled.Verdict, ps_pb2.GatherRequest(worker_id=0, round=0, payload=b"\x02"),
                 grpc.StatusCode.INVALID_ARGUMENT, "0 or 1", "payload=b'\\x02'")
    expect_abort(scaled.Verdict, verdict_request(5, 0, True), grpc.StatusCode.INVALID_ARGUMENT,
                 "worker_id=5")


def test_workers_must_agree_on_loss_scaling(make_servicer):
    servicer = make_servicer()
    register(servicer, 0, scaled_config(keras.optimizers.SGD(1.0)), initial())
    request = ps_pb2.RegisterRequest(
        worker_id=1, num_workers=2, variables=specs(),
        optimizer_config=keras_optimizer.config_json(keras.optimizers.SGD(1.0)))
    expect_abort(servicer.Register, request, grpc.StatusCode.INVALID_ARGUMENT,
                 "prophet_tf_loss_scaling")


def test_the_loss_scaling_mark_is_checked_like_the_rest_of_the_config():
    text = keras_optimizer.config_json(keras.optimizers.SGD(1.0), loss_scaling=True)
    assert json.loads(text)[optimizer_policy.LOSS_SCALING_KEY] is True
    assert optimizer_policy.loss_scaling(optimizer_policy.parse_config(text))
    bad = json.loads(text)
    bad[optimizer_policy.LOSS_SCALING_KEY] = "yes"
    with pytest.raises(ValueError, match="prophet_tf_loss_scaling is not true or false"):
        optimizer_policy.parse_config(json.dumps(bad))
