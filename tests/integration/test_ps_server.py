"""A real PS task in a subprocess, driven by real gRPC clients."""

import concurrent.futures
import json
import signal
import threading
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import ps_helpers
from prophet_tf import cluster as cluster_lib
from prophet_tf.cluster import free_port
from prophet_tf.engine.answers_first import AnswersFirst
from prophet_tf.ps import client as ps_client
from prophet_tf.ps import sharding
from prophet_tf.ps.v1 import ps_pb2

LIMIT = 32  # the ps2 fixture's --max-partition-bytes: the kernel is split in 3
SHAPES = {0: ("dense/kernel", (6, 4)), 1: ("dense/bias", (4,))}
SPECS = [ps_pb2.VariableSpec(key=k, name=n, shape=s, dtype="float32", priority=k)
         for k, (n, s) in SHAPES.items()]
PARTITIONS = sharding.plan(SPECS, 1, LIMIT, spread=True)
BY_ID = {(p.key, p.partition): p for p in PARTITIONS}
SGD1 = json.dumps({"module": "keras.optimizers", "class_name": "SGD",
                   "config": {"name": "SGD", "learning_rate": 1.0}, "registered_name": None})


def grads(step, worker):
    """Integer-valued float32 gradients: sums and SGD(lr=1) updates are exact."""
    rng = np.random.default_rng(1000 * step + worker)
    return {k: rng.integers(-50, 50, size=s).astype(np.float32) for k, (_, s) in SHAPES.items()}


def pull_all(client, min_version, timeout=30):
    out = {k: np.zeros(s, np.float32) for k, (_, s) in SHAPES.items()}
    versions = set()
    for chunk in client.pull(PARTITIONS, min_version, timeout=timeout):
        ps_helpers.write_chunk(chunk, out, BY_ID)
        versions.add(chunk.version)
    return out, versions


def push_step(client, step, worker=None):
    worker = client.worker_id if worker is None else worker
    chunks = ps_helpers.gradient_chunks(grads(step, worker), PARTITIONS, step)
    return ps_helpers.push(client, chunks, timeout=30)


@pytest.fixture(scope="module")
def model(ps2):
    """Both workers registered; worker 0 sent the initial values (version 0)."""
    clients = [ps_client.PSClient(ps2.address, w, 2) for w in range(2)]
    clients[0].wait_ready(60)
    initial = {k: np.arange(np.prod(s), dtype=np.float32).reshape(s)
               for k, (_, s) in SHAPES.items()}
    response = clients[0].register(SPECS, SGD1, initial, max_partition_bytes=LIMIT, timeout=60)
    clients[1].register(SPECS, SGD1, max_partition_bytes=LIMIT, timeout=60)
    assert len(response.partitions) == len(PARTITIONS) == 4
    yield clients
    for c in clients:
        c.close()


def current(clients):
    """(values, version) the PS serves now."""
    values, versions = pull_all(clients[0], 0)
    assert len(versions) == 1
    return values, versions.pop()


def run_step(clients, step):
    for c in clients:
        push_step(c, step)
    return pull_all(clients[0], step + 1)


@pytest.mark.timeout(60)
def test_health_reports_serving(ps2):
    with grpc.insecure_channel(ps2.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "prophet_tf.ps.v1.ParameterServer"):
            response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert response.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.timeout(120)
def test_two_concurrent_workers_sum_exactly_and_ignore_duplicates(model):
    start_values, start = current(model)
    steps = 4
    errors, duplicates = [], [0, 0]

    def worker(client):
        try:
            w = client.worker_id
            expected = {k: v.copy() for k, v in start_values.items()}
            for step in range(start, start + steps):
                duplicates[w] += push_step(client, step)
                if w == 1:  # a retried push: counted once
                    duplicates[w] += push_step(client, step)
                values, versions = pull_all(client, step + 1)
                assert versions == {step + 1}
                for k in expected:
                    expected[k] -= grads(step, 0)[k] + grads(step, 1)[k]
                    np.testing.assert_array_equal(values[k], expected[k])
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(c,)) for c in model]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not errors, errors
    assert duplicates == [0, steps * len(PARTITIONS)]
    # A late retry of the last step is a duplicate too and changes nothing.
    assert push_step(model[0], start + steps - 1) == len(PARTITIONS)
    assert current(model)[1] == start + steps


def raw_push(client, worker_id, chunk_fields):
    stub = client._channel.unary_unary(
        "/prophet_tf.ps.v1.ParameterServer/Push",
        request_serializer=ps_pb2.PushRequest.SerializeToString,
        response_deserializer=ps_pb2.PushResponse.FromString)
    chunks = [ps_pb2.GradientChunk(**fields) for fields in chunk_fields]
    return stub(ps_pb2.PushRequest(worker_id=worker_id, chunks=chunks), timeout=30)


@pytest.mark.timeout(180)
def test_bad_inputs_get_their_status_and_change_nothing(model):
    _, version = current(model)
    while version < 2:  # so that "from the past" exists
        run_step(model, version)
        version += 1
    push_step(model[1], version)  # a pending half-step must survive too
    snapshot, _ = current(model)
    good = dict(key=1, partition=0, step=version, dtype="float32",
                data=grads(version, 0)[1].tobytes())
    cases = [
        ([dict(good, key=9)], grpc.StatusCode.NOT_FOUND, ["key=9"]),
        ([dict(good, partition=5)], grpc.StatusCode.NOT_FOUND, ["partition=5"]),
        ([dict(good, dtype="float16")], grpc.StatusCode.INVALID_ARGUMENT,
         ["expected float32", "dtype='float16'"]),
        ([dict(good, data=b"\0" * 12)], grpc.StatusCode.INVALID_ARGUMENT,
         ["expected 16 bytes", "Received: 12 bytes"]),
        ([dict(good, step=version + 1)], grpc.StatusCode.FAILED_PRECONDITION,
         ["too far ahead", f"version {version}", f"step={version + 1}"]),
        ([dict(good, step=version - 2)], grpc.StatusCode.FAILED_PRECONDITION,
         ["from the past", f"step={version - 2}"]),
        # A good chunk followed by a bad one: the good one is not counted either.
        ([good, dict(good, key=0, partition=0, data=b"\0")], grpc.StatusCode.INVALID_ARGUMENT,
         ["expected 32 bytes", "Received: 1 bytes"]),
    ]
    for chunks, code, fragments in cases:
        error = ps_helpers.rpc_error(lambda: raw_push(model[0], 0, chunks))
        assert error.code() == code, (chunks, error.details())
        for fragment in fragments:
            assert fragment in error.details()
    error = ps_helpers.rpc_error(lambda: raw_push(model[0], 2, [good]))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "worker_id=2" in error.details()

    error = ps_helpers.rpc_error(lambda: model[0].pull([(0, 9)], 0, timeout=30))
    assert error.code() == grpc.StatusCode.NOT_FOUND and "partition=9" in error.details()

    # Nothing changed: same values and version; worker 0's step still pending.
    values, now = current(model)
    assert now == version
    for k in values:
        np.testing.assert_array_equal(values[k], snapshot[k])
    assert push_step(model[0], version) == 0  # nothing of worker 0 had been counted
    values, versions = pull_all(model[0], version + 1)
    for k in values:
        np.testing.assert_array_equal(
            values[k], snapshot[k] - (grads(version, 0)[k] + grads(version, 1)[k]))


def _connections_to(port: int) -> set[str]:
    """The client ends of this namespace's established TCP connections to ``port``."""
    ends = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in list(f)[1:]:
                local, remote, state = line.split()[1:4]
                if state == "01" and int(remote.rsplit(":", 1)[1], 16) == port:
                    ends.add(local)
    return ends


def _loaded_tensorflow(pid: int) -> bool:
    """Whether process `pid` has TensorFlow's native library mapped."""
    with open(f"/proc/{pid}/maps") as maps:
        return "_pywrap_tensorflow_internal" in maps.read()


@pytest.mark.timeout(120)
def test_the_first_register_imports_tensorflow_not_the_start(start_ps):
    """A PS task serves health checks, and rejects a malformed declaration, without
    TensorFlow (seconds of CPU per task whose job never starts); the first model
    declared loads it."""
    ps = start_ps("--num-workers", "1", "--max-partition-bytes", str(LIMIT))
    with ps_client.PSClient(ps.address, 0, 1) as client:
        client.wait_ready(60)
        error = ps_helpers.rpc_error(lambda: client._register(ps_pb2.RegisterRequest(
            worker_id=0, num_workers=2, variables=SPECS, optimizer_config=SGD1), timeout=30))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
        assert not _loaded_tensorflow(ps.proc.pid)
        initial = {k: np.ones(s, np.float32) for k, (_, s) in SHAPES.items()}
        client.register(SPECS, SGD1, initial, max_partition_bytes=LIMIT, timeout=60)
        assert _loaded_tensorflow(ps.proc.pid)
        push_step(client, 0)
        values, versions = pull_all(client, 1)
        assert versions == {1}
        np.testing.assert_array_equal(values[1], 1 - grads(0, 0)[1])


@pytest.mark.timeout(60)
def test_pushes_travel_on_a_connection_of_their_own(start_ps):
    """A push's answer must not queue behind pulled parameters in the buffers
    of one TCP connection: a client's pushes use a connection apart."""
    ps = start_ps("--num-workers", "1", "--max-partition-bytes", str(LIMIT))
    port = int(ps.address.rsplit(":", 1)[1])
    with ps_client.PSClient(ps.address, 0, 1) as client:
        client.wait_ready(60)
        initial = {k: np.zeros(s, np.float32) for k, (_, s) in SHAPES.items()}
        client.register(SPECS, SGD1, initial, max_partition_bytes=LIMIT, timeout=60)
        pull_all(client, 0)
        before = _connections_to(port)
        push_step(client, 0)
        after = _connections_to(port)
        assert len(after - before) == 1, (before, after)
        values, versions = pull_all(client, 1)  # on the first connection again
        assert versions == {1} and not _connections_to(port) - after
        np.testing.assert_array_equal(values[1], -grads(0, 0)[1])


@pytest.mark.timeout(120)
def test_a_worker_with_another_model_is_rejected_and_the_others_fail_fast(start_ps):
    ps = start_ps("--num-workers", "2", "--max-partition-bytes", str(LIMIT))
    clients = [ps_client.PSClient(ps.address, w, 2) for w in range(2)]
    clients[0].wait_ready(60)
    initial = {k: np.zeros(s, np.float32) for k, (_, s) in SHAPES.items()}
    clients[0].register(SPECS, SGD1, initial, max_partition_bytes=LIMIT, timeout=60)
    bad_specs = [ps_pb2.VariableSpec(key=0, name="dense/kernel", shape=[6, 5], dtype="float32"),
                 SPECS[1]]
    error = ps_helpers.rpc_error(lambda: clients[1]._register(ps_pb2.RegisterRequest(
        worker_id=1, num_workers=2, variables=bad_specs, optimizer_config=SGD1,
        max_partition_bytes=LIMIT), timeout=30))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'dense/kernel'" in error.details() and "shape=[6, 5]" in error.details()
    # Worker 0 waits for a step that can never come: it hears why at once.
    error = ps_helpers.rpc_error(lambda: list(clients[0].pull(PARTITIONS, 1, timeout=30)))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "worker 1 declared another model" in error.details()
    for c in clients:
        c.close()


@pytest.mark.timeout(120)
def test_oversized_message_is_resource_exhausted(model):
    _, version = current(model)
    big = ps_client.PSClient(model[0].address, 0, 2, max_message_bytes=128 << 20)
    try:
        chunk = ps_client.Chunk(1, 0, version, np.zeros((65 << 20) // 4, np.float32))
        error = ps_helpers.rpc_error(lambda: ps_helpers.push(big, [chunk], timeout=60))
    finally:
        big.close()
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
    assert str(64 << 20) in error.details()  # gRPC names the limit
    assert current(model)[1] == version
    assert push_step(model[0], version) == 0  # the server still serves; nothing counted
    push_step(model[1], version)
    assert pull_all(model[0], version + 1)[1] == {version + 1}


@pytest.mark.timeout(120)
def test_pull_waits_for_the_version_then_returns_it(model):
    _, version = current(model)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(pull_all, model[1], version + 1)
        push_step(model[0], version)
        time.sleep(0.5)
        assert not future.done()  # waiting for worker 1's push
        push_step(model[1], version)
        _, versions = future.result(30)
    assert versions == {version + 1}


def _until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.timeout(90)
def test_owed_counts_what_waiting_pulls_were_not_sent_and_holds_answers_first(model, ps2):
    _, version = current(model)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        pulled = pool.submit(pull_all, model[1], version + 1)
        _until(lambda: model[0].owed(version + 1, [1]) == len(PARTITIONS))
        assert model[0].owed(version, [1]) == 0  # pulls of newer versions do not count
        assert model[0].owed(version + 1, [0]) == 0  # nor other workers' pulls
        # Worker 0 shares a host with this PS; worker 1 and PS 1 are on another.
        config = cluster_lib.ClusterConfig(
            workers=("127.0.0.1:1", "127.0.0.2:1"), ps=(ps2.address, "127.0.0.2:2"),
            task_type="worker", task_index=0)
        gate = AnswersFirst(config, [model[0], None], threading.Event(), max_wait_s=30)
        assert (gate.local_ps, gate.other_workers) == ([0], [1])
        assert gate.applies_to(1) and not gate.applies_to(0)
        gate.wait(version)  # nothing of version <= `version` is owed: no wait
        held = pool.submit(gate.wait, version + 1)
        time.sleep(0.5)
        assert not held.done()  # PS 0 still owes worker 1 version + 1
        for c in model:
            push_step(c, version)
        _, versions = pulled.result(30)
        held.result(30)
    assert versions == {version + 1}
    assert gate.waited_s >= 0.5
    _until(lambda: model[0].owed(version + 1, [1]) == 0)

    for kwargs, fragment in [(dict(max_version=-1, workers=[1]), "max_version=-1"),
                             (dict(max_version=0, workers=[1, 7]), "workers=[7]")]:
        error = ps_helpers.rpc_error(lambda: model[0].owed(**kwargs, timeout=10))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert fragment in error.details()


def test_answers_first_stays_off_on_one_host():
    local = cluster_lib.ClusterConfig(workers=("127.0.0.1:1", "127.0.0.1:2"),
                                      ps=("127.0.0.1:3",), task_type="worker", task_index=1)
    gate = AnswersFirst(local, [None], threading.Event(), max_wait_s=1)
    assert not gate.active and not gate.applies_to(0)
    dedicated = cluster_lib.ClusterConfig(workers=("10.0.0.1:1", "10.0.0.2:1"),
                                          ps=("10.0.0.3:1",), task_type="worker", task_index=0)
    gate = AnswersFirst(dedicated, [None], threading.Event(), max_wait_s=1)
    assert not gate.active and gate.local_ps == [] and gate.other_workers == [1]


@pytest.mark.timeout(60)
def test_pull_deadline_expires(model):
    _, version = current(model)
    start = time.monotonic()
    # Ended by its deadline (version + 10 never comes), not before.
    error = ps_helpers.rpc_error(lambda: pull_all(model[0], version + 10, timeout=0.5))
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - start > 0.4


@pytest.mark.timeout(180)
def test_sigterm_stops_the_server_with_exit_code_0(start_ps):
    ps = start_ps("--num-workers", "1", "--grace", "1", "--max-partition-bytes", str(LIMIT))
    with ps_client.PSClient(ps.address, 0, 1) as client, \
            concurrent.futures.ThreadPoolExecutor(1) as pool:
        client.wait_ready(30)
        assert f"prophet-tf ps listening on 127.0.0.1:{ps.port}" in ps.log()
        client.register(SPECS, SGD1, max_partition_bytes=LIMIT, timeout=60)
        # A pull of version 0 waits (no initial values): shutdown must not hang on it.
        pending = pool.submit(lambda: list(client.pull(PARTITIONS, 0, timeout=120)))
        time.sleep(0.5)
        ps.proc.send_signal(signal.SIGTERM)
        # Within 60 s: hanging on the pull would last its 120 s.
        assert ps.proc.wait(60) == 0, ps.log()
        with pytest.raises(grpc.RpcError):
            pending.result(30)


@pytest.mark.timeout(180)
def test_tf_config_describes_the_task(start_ps):
    port = free_port()  # TF_CONFIG names fixed ports; take one the OS just had free
    tf_config = json.dumps({
        "cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"], "ps": [f"127.0.0.1:{port}"]},
        "task": {"type": "ps", "index": 0}})
    ps = start_ps("--host", "127.0.0.1", tf_config=tf_config)
    assert ps.port == port
    assert "ps 0 of 1, 2 workers" in ps.log()
    with ps_client.PSClient(ps.address, 1, 2) as client:
        client.wait_ready(30)
        response = client.register(SPECS, SGD1, timeout=60)
    assert (response.ps_index, response.num_ps) == (0, 1)
