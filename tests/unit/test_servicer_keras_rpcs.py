"""The servicer's RPCs behind Keras' answers, without a network: Gather (whole-data
metrics and predictions) and the optimizer state that saved models hold."""

import threading
import time

import grpc
import keras
import numpy as np
import pytest

from prophet_tf.ps import gather
from prophet_tf.ps.v1 import ps_pb2
from test_servicer import (SHAPES, Context, config, expect_abort, grad_chunks,  # noqa: F401
                           initial, make_servicer, plan, push, register)

pytestmark = pytest.mark.timeout(120)


def gather_request(worker_id, round_id, payload):
    return ps_pb2.GatherRequest(worker_id=worker_id, round=round_id, payload=payload)


def gather_all(servicer, round_id, payloads):
    """Every worker's Gather of `round_id` at once; their answers by worker."""
    answers = {}

    def call(worker_id):
        answers[worker_id] = list(servicer.Gather(
            gather_request(worker_id, round_id, payloads[worker_id]), Context()).payloads)

    threads = [threading.Thread(target=call, args=(w,)) for w in range(len(payloads))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return answers


def test_gather_gives_every_worker_all_payloads_in_worker_order(make_servicer):
    servicer = make_servicer(num_workers=3)
    for round_id in range(3):
        payloads = [f"w{w}r{round_id}".encode() for w in range(3)]
        assert gather_all(servicer, round_id, payloads) == {w: payloads for w in range(3)}
        # A round is forgotten once every worker has called for the next one.
        assert list(servicer._gatherer._rounds) == [round_id]


def test_gather_rejects_bad_requests_naming_them(make_servicer):
    servicer = make_servicer(num_workers=2)
    expect_abort(servicer.Gather, gather_request(2, 0, b"x"), grpc.StatusCode.INVALID_ARGUMENT,
                 "Received: worker_id=2")
    expect_abort(servicer.Gather, gather_request(0, -1, b"x"), grpc.StatusCode.INVALID_ARGUMENT,
                 "Received: round=-1")
    # Worker 1 never comes: the wait ends at the deadline, naming it.
    expect_abort(servicer.Gather, gather_request(0, 5, b"a"), grpc.StatusCode.DEADLINE_EXCEEDED,
                 "no payload from workers [1]", context=Context(timeout=0.3))
    # The same round again with other bytes: the workers disagree on their calls.
    expect_abort(servicer.Gather, gather_request(0, 5, b"b"), grpc.StatusCode.INVALID_ARGUMENT,
                 "another payload for gather round 5")


def test_gather_refuses_more_open_rounds_than_allowed(make_servicer):
    servicer = make_servicer(num_workers=2)
    for round_id in range(gather.MAX_OPEN_ROUNDS):
        expect_abort(servicer.Gather, gather_request(0, round_id, b"a"),
                     grpc.StatusCode.DEADLINE_EXCEEDED, context=Context(timeout=0.01))
    expect_abort(servicer.Gather, gather_request(0, 99, b"a"),
                 grpc.StatusCode.RESOURCE_EXHAUSTED, "Received: round=99")


def test_a_retry_beside_its_still_waiting_first_call_completes_the_round_once(make_servicer):
    # Worker 0's first call is still waiting when its retry and worker 1
    # complete the round: three fetches of one round, which is forgotten once.
    servicer = make_servicer(num_workers=2)
    first = {}
    waiting = threading.Thread(target=lambda: first.setdefault("answer", list(
        servicer.Gather(gather_request(0, 0, b"a"), Context(timeout=30)).payloads)))
    waiting.start()
    time.sleep(0.3)
    assert gather_all(servicer, 0, [b"a", b"b"]) == {0: [b"a", b"b"], 1: [b"a", b"b"]}
    waiting.join(30)
    assert first["answer"] == [b"a", b"b"]
    assert gather_all(servicer, 1, [b"c", b"d"]) == {0: [b"c", b"d"], 1: [b"c", b"d"]}
    assert list(servicer._gatherer._rounds) == [1]


def test_a_retry_after_its_first_call_fetched_the_round_still_gets_the_answer(make_servicer):
    # Worker 0's client gave up on its first call, but the PS's side of it was
    # still waiting (its deadline comes later than the client's) and took the
    # answer along with worker 1. The retry must find the round, not open a
    # new one that worker 1 never joins.
    servicer = make_servicer(num_workers=2)
    first = threading.Thread(target=lambda: servicer.Gather(
        gather_request(0, 0, b"a"), Context(timeout=30)))
    first.start()
    time.sleep(0.3)
    answer = servicer.Gather(gather_request(1, 0, b"b"), Context(timeout=30))
    assert list(answer.payloads) == [b"a", b"b"]
    first.join(30)
    retry = servicer.Gather(gather_request(0, 0, b"a"), Context(timeout=2))
    assert list(retry.payloads) == [b"a", b"b"]
    # Then the next round goes as usual, and round 0 is forgotten.
    assert gather_all(servicer, 1, [b"c", b"d"]) == {0: [b"c", b"d"], 1: [b"c", b"d"]}
    assert list(servicer._gatherer._rounds) == [1]


def read_state(servicer, min_version, timeout=10.0):
    """{(slot, key): whole array} joined from the partitions' elements."""
    out = {}
    request = ps_pb2.OptimizerStateRequest(worker_id=0, min_version=min_version)
    for m in servicer.ReadOptimizerState(request, Context(timeout)):
        assert m.version == min_version
        array = np.frombuffer(m.data, m.dtype).reshape(tuple(m.shape))
        whole = out.setdefault((m.slot, m.key), np.zeros(SHAPES[m.key][1], np.float32))
        if array.shape != whole.shape:
            whole.reshape(-1)[m.begin:m.begin + array.size] = array.reshape(-1)
        else:
            whole[...] = array
    return out


def test_optimizer_state_after_a_step_is_the_momentum_of_the_summed_gradient(make_servicer):
    servicer = make_servicer()  # the kernel is split into 3 partitions
    cfg = config(keras.optimizers.SGD(0.1, momentum=0.9))
    register(servicer, 0, cfg, initial())
    register(servicer, 1, cfg)
    grads = [initial(seed=s) for s in (1, 2)]
    for worker in (0, 1):
        push(servicer, worker, grad_chunks(grads[worker], 0))
    state = read_state(servicer, 1)  # waits for version 1
    assert sorted(state) == [("momentums", k) for k in SHAPES]
    for key in SHAPES:
        np.testing.assert_allclose(state["momentums", key],
                                   -0.1 * (grads[0][key] + grads[1][key]), rtol=1e-6)


def test_optimizer_state_mid_accumulation_holds_each_partitions_summed_gradients(make_servicer):
    """gradient_accumulation_steps on the PS: after the first of 2 steps nothing is
    applied, and the state (what saved models and checkpoints hold) is the sum."""
    servicer = make_servicer()  # the kernel is split into 3 partitions
    cfg = config(keras.optimizers.SGD(0.1, momentum=0.9, gradient_accumulation_steps=2))
    values = initial()
    register(servicer, 0, cfg, values)
    register(servicer, 1, cfg)
    grads = [initial(seed=s) for s in (1, 2)]
    for worker in (0, 1):
        push(servicer, worker, grad_chunks(grads[worker], 0))
    state = read_state(servicer, 1)
    assert sorted(state) == sorted([(slot, k) for k in SHAPES
                                    for slot in ("_accumulated_gradients", "momentums")])
    for key in SHAPES:
        np.testing.assert_allclose(state["_accumulated_gradients", key],
                                   grads[0][key] + grads[1][key], rtol=1e-6)
        np.testing.assert_array_equal(state["momentums", key], np.zeros_like(values[key]))


def test_written_state_is_what_the_next_step_starts_from(make_servicer):
    servicer = make_servicer(num_workers=1)
    cfg = config(keras.optimizers.SGD(0.1, momentum=0.9))
    register(servicer, 0, cfg, initial())
    momentum = initial(seed=5)
    slots = [ps_pb2.OptimizerSlot(worker_id=0, key=k, slot="momentums", dtype="float32",
                                  shape=list(np.shape(v)), data=np.asarray(v).tobytes())
             for k, v in momentum.items()]
    assert servicer.WriteOptimizerState(iter(slots), Context()).slots == len(plan())
    state = read_state(servicer, 0)
    for key in SHAPES:
        np.testing.assert_array_equal(state["momentums", key], momentum[key])
    grads = initial(seed=6)
    push(servicer, 0, grad_chunks(grads, 0))
    state = read_state(servicer, 1)
    for key in SHAPES:
        np.testing.assert_allclose(state["momentums", key],
                                   0.9 * momentum[key] - 0.1 * grads[key], rtol=1e-6)


def test_a_cut_variable_applied_whole_has_whole_slots_read_and_written_once(make_servicer):
    """Adafactor's factored slots of the kernel cut into 3 partitions: one message per
    slot, with the matrix's row and column shapes; written back, the next step
    starts from them."""
    servicer = make_servicer(num_workers=1)  # the kernel is split into 3 partitions
    cfg = config(keras.optimizers.Adafactor(0.1))
    values = initial()
    register(servicer, 0, cfg, values)
    def kernel_slots(version):
        request = ps_pb2.OptimizerStateRequest(worker_id=0, min_version=version)
        return [m for m in servicer.ReadOptimizerState(request, Context(10)) if m.key == 0]

    assert sorted((m.slot, m.partition, tuple(m.shape)) for m in kernel_slots(0)) == [
        ("_c", 0, (4,)), ("_r", 0, (6,)), ("_v", 0, (6, 4))]
    reference_var = keras.Variable(values[0])
    reference = keras.optimizers.Adafactor(0.1)
    reference.build([reference_var])
    rng = np.random.default_rng(3)
    written = {"_r": rng.random(6, np.float32), "_c": rng.random(4, np.float32),
               "_v": rng.random((6, 4), np.float32)}
    for name, array in written.items():
        getattr(reference, name)[0].assign(array)
    slots = [ps_pb2.OptimizerSlot(worker_id=0, key=0, slot=name, dtype="float32",
                                  shape=list(array.shape), data=array.tobytes())
             for name, array in written.items()]
    assert servicer.WriteOptimizerState(iter(slots), Context()).slots == 3
    grads = initial(seed=6)
    push(servicer, 0, grad_chunks(grads, 0))
    reference.apply([grads[0]], [reference_var])
    for m in kernel_slots(1):
        np.testing.assert_allclose(np.frombuffer(m.data, np.float32).reshape(m.shape),
                                   getattr(reference, m.slot)[0].numpy(), rtol=1e-6,
                                   err_msg=m.slot)


def test_write_rejects_an_unknown_slot_naming_it(make_servicer):
    servicer = make_servicer(num_workers=1)
    register(servicer, 0, config(keras.optimizers.SGD(0.1, momentum=0.9)), initial())
    bad = ps_pb2.OptimizerSlot(key=1, slot="velocities", dtype="float32", shape=[4],
                               data=np.zeros(4, np.float32).tobytes())
    expect_abort(servicer.WriteOptimizerState, iter([bad]), grpc.StatusCode.INVALID_ARGUMENT,
                 "no slot 'velocities'", "momentums")


def test_state_needs_a_registered_model(make_servicer):
    servicer = make_servicer()
    expect_abort(servicer.ReadOptimizerState,
                 ps_pb2.OptimizerStateRequest(worker_id=0, min_version=0),
                 grpc.StatusCode.FAILED_PRECONDITION, "No model is registered")


def test_gather_fails_at_once_when_a_missing_worker_left(make_servicer):
    servicer = make_servicer(num_workers=2)
    # Worker 1 takes part in round 0, then leaves; a round it never joins cannot complete.
    assert gather_all(servicer, 0, [b"a", b"b"]) == {0: [b"a", b"b"], 1: [b"a", b"b"]}
    servicer.Heartbeat(ps_pb2.HeartbeatRequest(worker_id=1, steps_pushed=3, leaving=True),
                       Context())
    # ABORTED at once; waiting would have ended at the 30 s deadline (DEADLINE_EXCEEDED).
    expect_abort(servicer.Gather, gather_request(0, 1, b"c"), grpc.StatusCode.ABORTED,
                 "worker 1 left the job after pushing 3 steps", context=Context(timeout=30))
