"""Clipping norms over several PS tasks: they agree on each step's norms through task 0.

Three PS servicers on real gRPC servers in this process and two workers' real clients
(register_all, pushes, pulls); the PS tasks call task 0's ShareNorm over gRPC. The
applied values equal Keras' SGD with global_clipnorm, or clipnorm, on whole variables.
"""
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import grpc  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import ps_helpers  # noqa: E402
from prophet_tf import keras_optimizer, optimizer_policy  # noqa: E402
from prophet_tf.ps import client as client_lib, clipping, norm_sharing, sharding  # noqa: E402
from prophet_tf.ps.server import create_server  # noqa: E402
from prophet_tf.ps.servicer import ParameterServerServicer  # noqa: E402
from prophet_tf.ps.v1 import ps_pb2  # noqa: E402

pytestmark = pytest.mark.timeout(120)

SHAPES = {0: ("dense/kernel", (12, 8)), 1: ("dense/bias", (8,)), 2: ("out/kernel", (8, 3))}
SPECS = [ps_pb2.VariableSpec(key=k, name=n, shape=list(s), dtype="float32")
         for k, (n, s) in SHAPES.items()]
LIMIT = 64  # bytes: every variable cut into element ranges over all three tasks
NUM_PS, NUM_WORKERS = 3, 2


def serve(num_ps: int):
    """(servicers, servers, addresses) of num_ps PS tasks on free ports."""
    servicers, servers, addresses = [], [], []
    for index in range(num_ps):
        servicer = ParameterServerServicer(NUM_WORKERS, index, num_ps, max_partition_bytes=LIMIT,
                                           worker_timeout_s=5.0)
        server, port = create_server("127.0.0.1:0", servicer)
        server.start()
        servicers.append(servicer)
        servers.append(server)
        addresses.append(f"127.0.0.1:{port}")
    return servicers, servers, addresses


@pytest.fixture
def cluster():
    servicers, servers, addresses = serve(NUM_PS)
    workers = [[client_lib.PSClient(a, w, NUM_WORKERS) for a in addresses]
               for w in range(NUM_WORKERS)]
    yield servicers, workers
    for clients in workers:
        for c in clients:
            c.close()
    for server, servicer in zip(servers, servicers):
        server.stop(0).wait()
        servicer.close()


@pytest.mark.parametrize("accumulation", [None, 2])
@pytest.mark.parametrize("option", ["global_clipnorm", "clipnorm"])
def test_several_ps_tasks_clip_by_norms_as_keras(cluster, option, accumulation):
    """With gradient accumulation Keras clips the average of every 2 steps' gradients:
    step 1's (clipped) and step 3's (under the clip); steps 0 and 2 accumulate."""
    partitions = train_as_keras(cluster, lambda: keras.optimizers.SGD(
        0.1, momentum=0.9, gradient_accumulation_steps=accumulation, **{option: 1.0}))
    assert {p.ps_index for p in partitions} == set(range(NUM_PS))  # every task shares
    assert len({p.key for p in partitions if p.ps_index == 1}) > 1  # and splits variables
    assert clipping.shared_groups(partitions, option == "clipnorm")[1] == [0, 1, 2]


def test_lamb_with_global_clipnorm_over_several_ps_tasks_as_keras(cluster):
    """Lamb keeps each variable on one task (its cut kernels' trust ratio is that task's
    to take: prophet_tf.ps.lamb); the step's clipping norm spans the tasks."""
    partitions = train_as_keras(cluster, lambda: keras.optimizers.Lamb(
        0.01, weight_decay=0.01, global_clipnorm=1.0))
    owners = {}
    for p in partitions:
        owners.setdefault(p.key, set()).add(p.ps_index)
    assert all(len(tasks) == 1 for tasks in owners.values())
    assert sum(p.key == 0 for p in partitions) > 1  # dense/kernel is cut
    assert len({p.ps_index for p in partitions}) > 1


def train_as_keras(cluster, make):
    """Two workers' pushes for 4 steps through the real clients, every pulled value
    against Keras applying their sums to whole variables; returns the partitions."""
    servicers, workers = cluster
    rng = np.random.default_rng(3)
    values = {k: rng.standard_normal(s).astype(np.float32) for k, (_, s) in SHAPES.items()}
    reference_vars = [keras.Variable(values[k], name=n.split("/")[-1])
                      for k, (n, _) in SHAPES.items()]
    reference = make()
    reference.build(reference_vars)
    config = keras_optimizer.config_json(make(), reference_vars)
    spread = not optimizer_policy.needs_whole_variables(json.loads(config))
    partitions = sharding.plan(SPECS, NUM_PS, LIMIT, spread=spread)
    for w, clients in enumerate(workers):
        client_lib.register_all(clients, SPECS, config, values if w == 0 else None, timeout=60,
                                max_partition_bytes=LIMIT)
    apply = tf.function(lambda grads: reference.apply(grads, reference_vars), autograph=False)
    by_key_partition = {(p.key, p.partition): p for p in partitions}
    for step, size in enumerate([2.0, 2.0, 0.01, 0.01]):
        # Large gradients on steps 0 and 1 (clipped), small on 2 and 3 (under the clip).
        grads = [{k: (size * rng.standard_normal(s)).astype(np.float32)
                  for k, (_, s) in SHAPES.items()} for _ in range(NUM_WORKERS)]
        for w, clients in enumerate(workers):
            for index, client in enumerate(clients):
                mine = [p for p in partitions if p.ps_index == index]
                ps_helpers.push(client, ps_helpers.gradient_chunks(grads[w], mine, step),
                                timeout=30)
        apply([grads[0][k] + grads[1][k] for k in SHAPES])
        got = {k: np.zeros(s, np.float32) for k, (_, s) in SHAPES.items()}
        for index, client in enumerate(workers[0]):
            mine = [p for p in partitions if p.ps_index == index]
            for chunk in client.pull(mine, step + 1, timeout=30):
                assert chunk.version == step + 1
                ps_helpers.write_chunk(chunk, got, by_key_partition)
        for k, variable in enumerate(reference_vars):
            np.testing.assert_allclose(got[k], variable.numpy(), rtol=1e-6, atol=1e-7,
                                       err_msg=f"step {step}, variable {k}")
    # Task 0 answered each step's round; nothing is held.
    assert all(s._norm_hold.pending() == {} for s in servicers if s._norm_hold)
    return partitions


def test_share_norm_is_refused_where_there_is_no_agreement(cluster):
    servicers, workers = cluster
    channel = grpc.insecure_channel(workers[0][1].address)
    call = channel.unary_unary("/prophet_tf.ps.v1.ParameterServer/ShareNorm",
                               request_serializer=ps_pb2.GatherRequest.SerializeToString,
                               response_deserializer=ps_pb2.GatherResponse.FromString)
    request = ps_pb2.GatherRequest(worker_id=0, round=0, payload=norm_sharing.encode(1.0))
    with pytest.raises(grpc.RpcError) as raised:
        call(request, timeout=10)
    assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "PS task 1 with no model" in raised.value.details()
    assert "Received: round=0 from sender 0" in raised.value.details()
    channel.close()


def test_a_register_without_task_0s_address_is_refused_naming_it(cluster):
    _, workers = cluster
    config = keras_optimizer.config_json(keras.optimizers.SGD(0.1, global_clipnorm=1.0),
                                         [keras.Variable(np.zeros(s, np.float32))
                                          for _, s in SHAPES.values()])
    with pytest.raises(grpc.RpcError) as raised:
        workers[1][2].register(SPECS, config, max_partition_bytes=LIMIT, timeout=60)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "Received: global_clipnorm=1.0, num_ps=3, ps0_address=''" in raised.value.details()


def test_shares_add_in_task_order_one_float64_per_group():
    payloads = [norm_sharing.encode([x, 2.0]) for x in (1e16, 1.0, -1e16)]
    assert norm_sharing.decode_totals(payloads, 2) == [(1e16 + 1.0) - 1e16, 6.0]
    with pytest.raises(ValueError, match="Received: 8 bytes"):
        norm_sharing.decode_totals([norm_sharing.encode([1.0])], 2)
