"""use_ema on the PS, without a network: each partition's moving average, updated as
Keras updates the whole variable's, and SwapAverages, Keras' finalize_variable_values
at the end of fit (prophet_tf/ps/ema.py)."""

import threading

import grpc
import keras
import numpy as np
import pytest

from prophet_tf import optimizer_policy
from prophet_tf.ps import protocol, sharding
from prophet_tf.ps.v1 import ps_pb2
from test_servicer import (LIMIT, SHAPES, Context, config, expect_abort,  # noqa: F401
                           grad_chunks, initial, make_servicer, pull, push, register, specs,
                           start_against_keras)

pytestmark = pytest.mark.timeout(120)

AVERAGES = "_model_variables_moving_average"  # Keras' slot list of the averages


def swap_request(worker_id, round_id, version):
    return ps_pb2.GatherRequest(worker_id=worker_id, round=round_id,
                                payload=protocol.encode_swap_version(version))


def swap_all(servicer, round_id, version, workers=2):
    """Every worker's SwapAverages at once; their errors (none: all answered)."""
    errors = []

    def call(worker_id):
        try:
            servicer.SwapAverages(swap_request(worker_id, round_id, version), Context(30))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=call, args=(w,)) for w in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return errors


@pytest.mark.parametrize("make_optimizer", [
    lambda: keras.optimizers.Adam(0.05, use_ema=True, ema_momentum=0.8),
    # Keras overwrites the variables with their averages every 2 iterations too.
    lambda: keras.optimizers.SGD(0.1, momentum=0.9, use_ema=True, ema_momentum=0.5,
                                 ema_overwrite_frequency=2),
    # Averages of every raw step, updates every 2nd.
    lambda: keras.optimizers.SGD(0.1, use_ema=True, ema_momentum=0.6,
                                 gradient_accumulation_steps=2),
    # The cut kernel applied whole (whole_apply.py), its average whole too.
    lambda: keras.optimizers.Adafactor(0.1, use_ema=True, ema_momentum=0.7),
    lambda: keras.optimizers.Nadam(0.05, use_ema=True, global_clipnorm=1.0),
    # Lamb's two phases over the cut kernel (lamb.py): the average follows the second.
    lambda: keras.optimizers.Lamb(0.05, use_ema=True, ema_momentum=0.7,
                                  ema_overwrite_frequency=3),
    lambda: keras.optimizers.Lamb(0.05, use_ema=True, gradient_accumulation_steps=2),
], ids=["adam", "momentum-overwrite-2", "sgd-accumulate-2", "adafactor", "nadam-clip",
        "lamb-overwrite-3", "lamb-accumulate-2"])
def test_averages_and_their_swap_follow_single_process_keras(make_servicer, make_optimizer):
    """Two workers, the kernel in three partitions: 5 steps, the swap at the end of fit,
    2 more steps. Every version equals Keras' variables applied the summed
    gradients, the swapped one their averages, and the optimizer state holds them."""
    whole = optimizer_policy.needs_whole_variables(keras.optimizers.serialize(make_optimizer()))
    partitions = sharding.plan(specs(), 1, LIMIT, spread=not whole)
    assert sum(p.key == 0 for p in partitions) == 3
    servicer = make_servicer(max_partition_bytes=LIMIT)
    reference_vars, reference, reference_apply, _ = start_against_keras(
        servicer, make_optimizer, initial(3))
    rng = np.random.default_rng(7)

    def check(version, what):
        got, versions = pull(servicer, version, partitions)
        assert set(versions.values()) == {version}
        for k, variable in enumerate(reference_vars):
            np.testing.assert_allclose(got[k], variable.numpy(), rtol=2e-6, atol=1e-7,
                                       err_msg=f"{SHAPES[k][0]} {what}")
        return got

    def train(steps):
        for step in steps:
            grads = [{k: rng.standard_normal(s).astype(np.float32)
                      for k, (_, s) in SHAPES.items()} for _ in range(2)]
            for worker in (1, 0):
                push(servicer, worker, grad_chunks(grads[worker], step, partitions))
            reference_apply([grads[0][k] + grads[1][k] for k in SHAPES])
            check(step + 1, f"at step {step}")

    train(range(5))
    before = [v.numpy() for v in reference_vars]
    assert not swap_all(servicer, 0, 5)
    reference.finalize_variable_values(reference_vars)
    swapped = check(5, "swapped in at version 5")
    assert any(not np.allclose(swapped[k], before[k]) for k in SHAPES)  # it swapped
    train(range(5, 7))
    request = ps_pb2.OptimizerStateRequest(worker_id=0, min_version=7)
    state = {}
    for m in servicer.ReadOptimizerState(request, Context(10)):
        if m.slot == AVERAGES:
            array = np.frombuffer(m.data, m.dtype).reshape(tuple(m.shape))
            joined = state.setdefault(m.key, np.zeros(SHAPES[m.key][1], np.float32))
            if array.shape == joined.shape:
                joined[...] = array
            else:
                joined.reshape(-1)[m.begin:m.begin + array.size] = array.reshape(-1)
    assert sorted(state) == sorted(SHAPES)
    for k in SHAPES:
        np.testing.assert_allclose(state[k], getattr(reference, AVERAGES)[k].numpy(),
                                   rtol=2e-6, atol=1e-7, err_msg=f"{SHAPES[k][0]}'s average")


def test_a_swap_waits_for_every_worker_and_the_version_and_happens_once(make_servicer):
    servicer = make_servicer()
    cfg = config(keras.optimizers.SGD(0.1, use_ema=True, ema_momentum=0.5))
    register(servicer, 0, cfg, initial(1))
    register(servicer, 1, cfg)
    # Worker 1 never asks: worker 0's call ends at its deadline, naming it.
    expect_abort(servicer.SwapAverages, swap_request(0, 0, 1),
                 grpc.StatusCode.DEADLINE_EXCEEDED, "no payload from workers [1]",
                 context=Context(timeout=0.3))
    # Both ask before step 0 is applied: the swap waits for version 1.
    answered = []
    calls = threading.Thread(target=lambda: answered.append(swap_all(servicer, 0, 1)))
    calls.start()
    calls.join(0.5)
    assert calls.is_alive()
    grads = [initial(seed=s) for s in (2, 3)]
    for worker in (0, 1):
        push(servicer, worker, grad_chunks(grads[worker], 0))
    calls.join(30)
    assert answered == [[]]  # both answered, no error
    # Keras' first average is the value itself (its momentum is 0 at iteration 0).
    stepped, _ = pull(servicer, 1)
    values = initial(1)
    for k in SHAPES:
        np.testing.assert_allclose(stepped[k], values[k] - 0.1 * (grads[0][k] + grads[1][k]),
                                   rtol=1e-6)
    # The same round again (a retry): answered at once, nothing swapped twice.
    servicer.SwapAverages(swap_request(1, 0, 1), Context(5))
    again, versions = pull(servicer, 1)
    assert set(versions.values()) == {1}
    for k in SHAPES:
        np.testing.assert_array_equal(again[k], stepped[k])


def test_swaps_are_refused_naming_what_is_wrong(make_servicer):
    servicer = make_servicer()
    expect_abort(servicer.SwapAverages, swap_request(0, 0, 0),
                 grpc.StatusCode.FAILED_PRECONDITION, "no model")
    register(servicer, 0, config(keras.optimizers.SGD(0.1)), initial())
    expect_abort(servicer.SwapAverages, swap_request(0, 0, 0),
                 grpc.StatusCode.FAILED_PRECONDITION, "use_ema=True", "another optimizer")
    servicer = make_servicer()
    cfg = config(keras.optimizers.SGD(0.1, use_ema=True))
    register(servicer, 0, cfg, initial())
    register(servicer, 1, cfg)
    bad = ps_pb2.GatherRequest(worker_id=0, round=0, payload=b"\x01")
    expect_abort(servicer.SwapAverages, bad, grpc.StatusCode.INVALID_ARGUMENT,
                 "(8 bytes)", "Received: 1 bytes")
    errors = []
    thread = threading.Thread(target=lambda: errors.append(expect_abort(
        servicer.SwapAverages, swap_request(0, 0, 0), grpc.StatusCode.INVALID_ARGUMENT)))
    thread.start()
    expect_abort(servicer.SwapAverages, swap_request(1, 0, 4), grpc.StatusCode.INVALID_ARGUMENT,
                 "ended fit at different steps: [0, 4]")
    thread.join(30)
    assert errors and "[0, 4]" in errors[0]
