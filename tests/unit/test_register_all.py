"""A worker declares its model to every PS task at once (ps/client.register_all).

Two PS servicers on real gRPC servers in this process; each one's Register waits
until the other's has begun, so declaring to one after the other cannot pass.
"""
import json
import threading

import grpc
import numpy as np
import pytest

from prophet_tf.ps import client as client_lib
from prophet_tf.ps.server import create_server
from prophet_tf.ps.servicer import ParameterServerServicer
from prophet_tf.ps.v1 import ps_pb2

pytestmark = pytest.mark.timeout(120)

SPECS = [ps_pb2.VariableSpec(key=0, name="dense/kernel", shape=[4, 2], dtype="float32"),
         ps_pb2.VariableSpec(key=1, name="dense/bias", shape=[2], dtype="float32")]
SGD = json.dumps({"module": "keras.optimizers", "class_name": "SGD",
                  "config": {"name": "SGD", "learning_rate": 1.0}, "registered_name": None})
MEET_S = 30.0  # how long each Register waits for the other's


class MeetingServicer(ParameterServerServicer):
    """A Register that begins only once the other PS task's Register has begun."""

    def __init__(self, barrier: threading.Barrier, **kwargs):
        super().__init__(**kwargs)
        self.barrier = barrier

    def Register(self, request, context):
        try:
            self.barrier.wait()
        except threading.BrokenBarrierError:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          "the other PS task's Register did not begin meanwhile")
        return super().Register(request, context)


@pytest.fixture
def two_ps():
    barrier = threading.Barrier(2, timeout=MEET_S)
    servers, clients = [], []
    try:
        for index in range(2):
            servicer = MeetingServicer(barrier, num_workers=1, ps_index=index, num_ps=2)
            server, port = create_server("127.0.0.1:0", servicer)
            server.start()
            servers.append((server, servicer))
            clients.append(client_lib.PSClient(f"127.0.0.1:{port}", 0, 1))
        yield clients
    finally:
        for client in clients:
            client.close()
        for server, servicer in servers:
            server.stop(0).wait()
            servicer.close()


def test_every_ps_task_is_declared_to_at_once(two_ps):
    initial = {0: np.arange(8, dtype=np.float32).reshape(4, 2), 1: np.ones(2, np.float32)}
    responses = client_lib.register_all(two_ps, SPECS, SGD, initial, timeout=60)
    assert [r.ps_index for r in responses] == [0, 1]  # in the clients' order
    owned = [{p.key for p in r.partitions} for r in responses]
    assert set.union(*owned) == {0, 1} and all(owned), owned  # each owns a share


def test_a_rejection_is_raised_after_every_call_ended(two_ps):
    bad = [ps_pb2.VariableSpec(key=0, name="dense/kernel", shape=[4, -2], dtype="float32")]
    with pytest.raises(grpc.RpcError) as raised:
        client_lib.register_all(two_ps, bad, SGD, timeout=60)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value.details()
