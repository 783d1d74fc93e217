"""Push + pull throughput of one worker and one PS task on loopback.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_transport.py [--mb 100] [--reps 7]

A PS task runs in a subprocess (W=1, SGD). Each repetition is one training
step's traffic for a model of ``--mb`` MB of float32 (a few large variables,
split into 4 MiB partitions): every partition's gradient is pushed (one
partition per request, ``--inflight`` requests at a time) while one Pull stream
asks for every partition at the next version, so pulls overlap pushes and the
PS's optimizer applies, as in the engine. Pulled chunks are copied into
full-size arrays, as a worker's staging buffers would be. Reported:

* ``step``: model bytes / wall time of push + apply + pull (a 100 MB model at
  1 GB/s takes 0.1 s); ``wire``: bytes moved both ways / the same time;
* CPU time per step of the client and of the PS process;
* ``push`` and ``pull`` alone (push to an idle PS; pull of a ready version);
* the same traffic through a bare gRPC server (prebuilt bytes, no PS work,
  same options): what grpcio itself allows on this machine;
* numpy memcpy of the same size, the machine's memory reference.
Median and spread (min..max) over the repetitions after one warm-up.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # ps_helpers: cut gradients into chunks, write pulls back

from prophet_tf import codec  # noqa: E402
import ps_helpers  # noqa: E402
from prophet_tf.ps import client as ps_client  # noqa: E402
from prophet_tf.ps import protocol  # noqa: E402
from prophet_tf.ps import sharding  # noqa: E402
from prophet_tf.ps.v1 import ps_pb2  # noqa: E402

LR = 0.001
SGD_CONFIG = ('{"module": "keras.optimizers", "class_name": "SGD", "config": '
              f'{{"name": "SGD", "learning_rate": {LR}}}, "registered_name": null}}')
ENV = dict(TF_CPP_MIN_LOG_LEVEL="2", TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1",
           PROPHET_TF_LOG_LEVEL="WARNING")


def start(args: list[str], tmp: str) -> tuple[subprocess.Popen, int]:
    """Starts ``python ARGS --port-file F`` and waits for the port."""
    port_file = os.path.join(tmp, f"port{len(os.listdir(tmp))}")
    env = dict(os.environ, PYTHONPATH=str(ROOT), **ENV)
    proc = subprocess.Popen([sys.executable, *args, "--port-file", port_file], env=env)
    deadline = time.monotonic() + 120
    while not os.path.exists(port_file):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{args} did not start (exit code {proc.poll()})")
        time.sleep(0.05)
    return proc, int(pathlib.Path(port_file).read_text())


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU time of this process, or of ``pid`` (Linux /proc)."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def summary(seconds: list[float], nbytes: int) -> str:
    rates = sorted(nbytes / s / 1e9 for s in seconds)
    return (f"{statistics.median(rates):6.2f} GB/s  (spread {rates[0]:.2f}..{rates[-1]:.2f}, "
            f"median {statistics.median(seconds) * 1e3:.0f} ms)")


# --- a bare gRPC server: the same traffic without any PS work ---------------

def bare_server(port_file: str) -> int:
    import grpc

    codec.tune_allocator()
    payloads = {}

    def push(request, context):
        return b""

    def pull(request, context):  # request: b"<count> <size>"
        count, size = map(int, request.split())
        payload = payloads.setdefault(size, b"\0" * size)
        for _ in range(count):
            yield payload

    grpc_server = grpc.server(concurrent.futures.ThreadPoolExecutor(16),
                              options=protocol.server_options())
    grpc_server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bare.Bare", {
        "Push": grpc.unary_unary_rpc_method_handler(push),
        "Pull": grpc.unary_stream_rpc_method_handler(pull)}),))
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    pathlib.Path(port_file).write_text(str(port))
    grpc_server.wait_for_termination()
    return 0


def bare_steps(port: int, sizes: list[int], reps: int, inflight: int) -> list[float]:
    import grpc

    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=protocol.channel_options())
    push = channel.unary_unary("/bare.Bare/Push")
    pull = channel.unary_stream("/bare.Bare/Pull")
    payloads = [b"\0" * size for size in sizes]
    request = f"{len(sizes)} {max(sizes)}".encode()
    times = []
    with concurrent.futures.ThreadPoolExecutor(inflight) as pool, \
            concurrent.futures.ThreadPoolExecutor(1) as puller:
        for _ in range(reps + 1):
            t = time.perf_counter()
            pulled = puller.submit(lambda: sum(len(m) for m in pull(request, timeout=60)))
            for f in [pool.submit(push, p, timeout=60) for p in payloads]:
                f.result()
            pulled.result()
            times.append(time.perf_counter() - t)
    channel.close()
    return times[1:]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=100.0, help="model size in MB (1e6 bytes)")
    parser.add_argument("--variables", type=int, default=4)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--inflight", type=int, default=4, help="concurrent push requests")
    parser.add_argument("--bare-server", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.bare_server:
        return bare_server(args.port_file)
    codec.tune_allocator()  # as a worker would; the PS main does it too

    cols = 1000
    rows = int(args.mb * 1e6 / 4 / cols / args.variables)
    shapes = [(rows, cols)] * args.variables
    model_bytes = sum(4 * r * c for r, c in shapes)
    specs = [ps_pb2.VariableSpec(key=i, name=f"dense_{i}/kernel", shape=s, dtype="float32",
                                 priority=i) for i, s in enumerate(shapes)]
    partitions = sharding.owned_by(sharding.plan(specs, 1, spread=True), 0)
    by_id = {(p.key, p.partition): p for p in partitions}
    rng = np.random.default_rng(0)
    params = {i: rng.standard_normal(s, dtype=np.float32) for i, s in enumerate(shapes)}
    grads = {i: np.ones(s, np.float32) for i, s in enumerate(shapes)}
    out = {i: np.empty(s, np.float32) for i, s in enumerate(shapes)}

    src = np.ones(model_bytes // 4, np.float32)
    dst = np.empty_like(src)
    memcpy = []
    for _ in range(args.reps):
        t = time.perf_counter()
        np.copyto(dst, src)
        memcpy.append(time.perf_counter() - t)
    del src, dst

    with tempfile.TemporaryDirectory() as tmp:
        proc, port = start(["-m", "prophet_tf.ps.server", "--num-workers", "1", "--port", "0"],
                           tmp)
        try:
            client = ps_client.PSClient(f"127.0.0.1:{port}", worker_id=0, num_workers=1)
            client.wait_ready(60)
            client.register(specs, SGD_CONFIG, params, timeout=120)
            pool = concurrent.futures.ThreadPoolExecutor(args.inflight)
            puller = concurrent.futures.ThreadPoolExecutor(1)

            def push_all(step):
                chunks = ps_helpers.gradient_chunks(grads, partitions, step)
                for f in [pool.submit(ps_helpers.push, client, [c], 60) for c in chunks]:
                    f.result()

            def pull_all(version):
                n = 0
                for chunk in client.pull(partitions, version, timeout=60):
                    ps_helpers.write_chunk(chunk, out, by_id)
                    n += 1
                assert n == len(partitions)

            step_t, push_t, pull_t = [], [], []
            for step in range(args.reps + 1):  # step 0 also traces the applies
                if step == 1:
                    cpu0 = cpu_seconds(), cpu_seconds(proc.pid)
                t = time.perf_counter()
                pulled = puller.submit(pull_all, step + 1)
                push_all(step)
                pulled.result()
                step_t.append(time.perf_counter() - t)
            cpu = [(cpu_seconds() - cpu0[0]) / args.reps,
                   (cpu_seconds(proc.pid) - cpu0[1]) / args.reps]
            for step in range(args.reps + 1, 2 * args.reps + 2):
                t = time.perf_counter()
                push_all(step)
                push_t.append(time.perf_counter() - t)
                pull_all(step + 1)  # waits for the applies: not timed
                t = time.perf_counter()
                pull_all(step + 1)
                pull_t.append(time.perf_counter() - t)
            steps = 2 * args.reps + 2
            np.testing.assert_allclose(out[0][:2, :4], params[0][:2, :4] - LR * steps,
                                       atol=1e-4, err_msg="the PS's values are wrong")
            client.close()
            pool.shutdown()
            puller.shutdown()
        finally:
            stop(proc)
        bare, port = start([__file__, "--bare-server"], tmp)
        try:
            bare_t = bare_steps(port, [p.nbytes for p in partitions], args.reps, args.inflight)
        finally:
            stop(bare)

    print(f"model: {model_bytes / 1e6:.0f} MB float32 in {len(shapes)} variables, "
          f"{len(partitions)} partitions; W=1, 1 PS on loopback; SGD applied on the PS; "
          f"{args.reps} reps after 1 warm-up; {args.inflight} pushes in flight")
    print(f"step (push+apply+pull, model bytes/s): {summary(step_t[1:], model_bytes)}")
    print(f"wire (both directions, bytes/s):       {summary(step_t[1:], 2 * model_bytes)}")
    print(f"CPU per step: client {cpu[0] * 1e3:.0f} ms, PS {cpu[1] * 1e3:.0f} ms "
          f"(wall {statistics.median(step_t[1:]) * 1e3:.0f} ms, {os.cpu_count()} cores)")
    print(f"push only:                             {summary(push_t[1:], model_bytes)}")
    print(f"pull only:                             {summary(pull_t[1:], model_bytes)}")
    print(f"bare gRPC step, same traffic:          {summary(bare_t, model_bytes)}")
    print(f"memcpy (numpy copyto, reference):      {summary(memcpy, model_bytes)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
