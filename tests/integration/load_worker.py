"""A worker process for the load test: plain PSClient, no TensorFlow.

    python load_worker.py --ps HOST:PORT,HOST:PORT --worker W --workers N --steps S
                          --retry-p P --seed SEED --out RESULT.json

Every step it pushes its integer-valued float32 gradients to each PS task,
pulls the next version from each and checks it against the numpy-computed
parameters (SGD with lr=1: ``param -= sum of the workers' gradients``), so an
update lost or counted twice fails at the step where it happens.

Transient errors are injected on purpose, each with probability P per push:

* a lost response: the push is sent again after it succeeded; the PS must
  count every chunk of the copy as a duplicate;
* a short deadline (0.5 to 5 ms): the push may time out before or after the
  PS applied it; it is retried on DEADLINE_EXCEEDED/UNAVAILABLE until it
  succeeds, and the retry must find either all of its chunks counted
  (the PS had it) or none.

The counts go to the JSON result; any mismatch exits 1 with the reason.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import sys
import time

import grpc
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # tests/: ps_helpers
import ps_helpers  # noqa: E402
from prophet_tf.ps import client as ps_client  # noqa: E402
from prophet_tf.ps import sharding  # noqa: E402
from prophet_tf.ps.v1 import ps_pb2  # noqa: E402

# name, shape; float32. The kernel is cut into element ranges over both PS tasks.
SHAPES = {0: ("dense/kernel", (64, 32)), 1: ("dense/bias", (32,)),
          2: ("out/kernel", (32, 10)), 3: ("out/bias", (10,)), 4: ("scale", ())}
MAX_PARTITION_BYTES = 2048
SGD1 = json.dumps({"module": "keras.optimizers", "class_name": "SGD",
                   "config": {"name": "SGD", "learning_rate": 1.0}, "registered_name": None})
RETRYABLE = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
RETRY_FOR_S = 30.0  # how long a timed-out push is retried before the worker gives up


def specs():
    return [ps_pb2.VariableSpec(key=k, name=n, shape=s, dtype="float32", priority=k)
            for k, (n, s) in SHAPES.items()]


def initial_values():
    return {k: (np.arange(int(np.prod(s))) % 13 - 6).astype(np.float32).reshape(s)
            for k, (_, s) in SHAPES.items()}


def gradient(worker: int, step: int, key: int) -> np.ndarray:
    """Small integers in [-11, 11]: every sum and update is exact in float32."""
    shape = SHAPES[key][1]
    index = np.arange(int(np.prod(shape)), dtype=np.int64)
    return (((worker + 8 * step + 3 * key + index) % 23) - 11).astype(np.float32).reshape(shape)


def expected_after(steps: int, workers: int) -> dict[int, np.ndarray]:
    """The parameters after ``steps`` SGD steps, computed in numpy."""
    values = initial_values()
    for step in range(steps):
        for key in values:
            values[key] = values[key] - sum(gradient(w, step, key) for w in range(workers))
    return values


def rows(array, p):
    return sharding.elements(array, p)


class Worker:
    def __init__(self, addresses, worker, workers, retry_p, rng):
        self.worker, self.workers, self.retry_p, self.rng = worker, workers, retry_p, rng
        self.clients = [ps_client.PSClient(a, worker, workers) for a in addresses]
        self.plan = sharding.plan(specs(), len(addresses), MAX_PARTITION_BYTES, spread=True)
        self.owned = [sharding.owned_by(self.plan, i) for i in range(len(addresses))]
        self.by_id = {(p.key, p.partition): p for p in self.plan}
        self.counts = dict(pushes=0, resent=0, short_deadline=0, deadline_exceeded=0,
                           processed_before_timeout=0, duplicates=0, pulls=0)

    def register(self):
        for c in self.clients:
            c.wait_ready(120)
            c.register(specs(), SGD1, initial_values() if self.worker == 0 else None,
                       max_partition_bytes=MAX_PARTITION_BYTES, timeout=120)

    def pull(self, version):
        """Every partition of ``version`` from every PS, as full arrays."""
        out = {k: np.zeros(s, np.float32) for k, (_, s) in SHAPES.items()}
        for c, owned in zip(self.clients, self.owned):
            for chunk in c.pull(owned, version, timeout=120):
                if chunk.version != version:
                    raise AssertionError(f"asked for version {version}, got {chunk.version} "
                                         f"of key {chunk.key} partition {chunk.partition}")
                ps_helpers.write_chunk(chunk, out, self.by_id)
            self.counts["pulls"] += 1
        return out

    def push(self, client, chunks):
        self.counts["pushes"] += 1
        n = len(chunks)
        if self.rng.random() < self.retry_p:  # the deadline expires around the call
            self.counts["short_deadline"] += 1
            try:
                duplicates = ps_helpers.push(client, chunks,
                                             timeout=self.rng.uniform(0.0005, 0.005))
                self.check(duplicates == 0, f"a first push found {duplicates} duplicates")
            except grpc.RpcError as e:
                if e.code() not in RETRYABLE:
                    raise
                self.counts["deadline_exceeded"] += 1
                # Retried for a bounded time: a PS that died must fail the run
                # with its error, not leave it retrying until pytest's timeout.
                give_up = time.monotonic() + RETRY_FOR_S
                while True:
                    try:
                        duplicates = ps_helpers.push(client, chunks, timeout=60)
                        break
                    except grpc.RpcError as retry_error:
                        if retry_error.code() not in RETRYABLE or time.monotonic() > give_up:
                            raise
                        time.sleep(0.05)
                self.check(duplicates in (0, n), f"a retry found {duplicates} of {n} counted")
                self.counts["processed_before_timeout"] += duplicates == n
                self.counts["duplicates"] += duplicates
        else:
            duplicates = ps_helpers.push(client, chunks, timeout=60)
            self.check(duplicates == 0, f"a first push found {duplicates} duplicates")
        if self.rng.random() < self.retry_p:  # the response was lost: send it again
            self.counts["resent"] += 1
            duplicates = ps_helpers.push(client, chunks, timeout=60)
            self.check(duplicates == n, f"a resent push found {duplicates} of {n} counted")
            self.counts["duplicates"] += duplicates

    def check(self, ok, message):
        if not ok:
            raise AssertionError(f"worker {self.worker}: {message}")

    def run(self, steps):
        self.register()
        expected = initial_values()
        values = self.pull(0)
        self.compare(values, expected, 0)
        for step in range(steps):
            grads = {k: gradient(self.worker, step, k) for k in SHAPES}
            for client, owned in zip(self.clients, self.owned):
                chunks = ps_helpers.gradient_chunks(grads, owned, step)
                if len(chunks) > 1 and self.rng.random() < 0.3:  # in two blocks
                    cut = self.rng.randrange(1, len(chunks))
                    self.push(client, chunks[:cut])
                    self.push(client, chunks[cut:])
                else:
                    self.push(client, chunks)
            for key in expected:
                expected[key] = expected[key] - sum(gradient(w, step, key)
                                                    for w in range(self.workers))
            self.compare(self.pull(step + 1), expected, step + 1)

    def compare(self, values, expected, version):
        for key in expected:
            if not np.array_equal(values[key], expected[key]):
                wrong = int(np.count_nonzero(values[key] != expected[key]))
                raise AssertionError(f"worker {self.worker}: version {version} of variable "
                                     f"{key} differs from numpy in {wrong} elements")

    def close(self):
        for c in self.clients:
            c.close()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ps", required=True, help="comma-separated PS addresses")
    parser.add_argument("--worker", type=int, required=True)
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--retry-p", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    worker = Worker(args.ps.split(","), args.worker, args.workers, args.retry_p,
                    random.Random(args.seed * 1000 + args.worker))
    started = time.monotonic()
    try:
        worker.run(args.steps)
    finally:
        worker.close()
    with open(args.out, "w") as f:
        json.dump(dict(worker.counts, worker=args.worker,
                       seconds=time.monotonic() - started), f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
