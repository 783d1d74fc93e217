"""Push + pull throughput and CPU of one worker and its PS processes on loopback.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_transport.py [--mb 100] [--reps 7] \
        [--ps 1,2,4] [--json benchmarks/transport.json] [--baseline-root ../before]

PS tasks run in subprocesses (W=1, SGD), as many as ``--ps`` says (each count a
run of its own). Each repetition is one training step's traffic for a model of
``--mb`` MB of float32 (a few large variables, split into 4 MiB partitions over
the PS tasks): every partition's gradient is pushed (one partition per
request, ``--inflight`` requests at a time) while one Pull stream per PS asks
for its partitions at the next version, so pulls overlap pushes and the PS's
optimizer applies, as in the engine. Pulled chunks are copied into full-size
arrays, as a worker's staging buffers would be. Reported:

* ``step``: model bytes / wall time of push + apply + pull (a 100 MB model at
  1 GB/s takes 0.1 s);
* CPU time per step of the client and of the PS processes, as CPU-seconds per
  GB on the wire (a step moves the model both ways);
* ``push`` and ``pull`` alone (push to an idle PS; pull of a ready version);
* the same traffic through as many bare gRPC servers (prebuilt bytes, no PS
  work, same options), with their CPU too: what grpcio itself costs here;
* numpy memcpy of the same size, the machine's memory reference;
* with ``--baseline-root``, the same for PS processes run from another
  checkout (e.g. ``git worktree add ../before HEAD~1`` and its protos built),
  the two sets of PS processes taking turns step by step: a change's effect
  in one run, where separate runs would also measure the machine's drift.
Median and spread (min..max) over the repetitions after one warm-up;
``prophet-tf report``'s ``transport`` kind renders the JSON.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
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
sys.path.insert(0, str(ROOT / "benchmarks"))  # trees: the baseline checkout

from prophet_tf import codec  # noqa: E402
from prophet_tf.bench.transport_table import cpu_per_gb as per_gb  # noqa: E402
import ps_helpers  # noqa: E402
import trees  # noqa: E402
from prophet_tf.ps import client as ps_client  # noqa: E402
from prophet_tf.ps import protocol  # noqa: E402
from prophet_tf.ps import sharding  # noqa: E402
from prophet_tf.ps.v1 import ps_pb2  # noqa: E402

LR = 0.001
SGD_CONFIG = ('{"module": "keras.optimizers", "class_name": "SGD", "config": '
              f'{{"name": "SGD", "learning_rate": {LR}}}, "registered_name": null}}')
ENV = dict(TF_CPP_MIN_LOG_LEVEL="2", TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1",
           PROPHET_TF_LOG_LEVEL="WARNING")


def start(args: list[str], tmp: str, root: pathlib.Path = ROOT) -> tuple[subprocess.Popen, int]:
    """Starts ``python ARGS --port-file F`` with ``root``'s prophet_tf and waits for the port."""
    port_file = os.path.join(tmp, f"port{len(os.listdir(tmp))}")
    env = dict(os.environ, PYTHONPATH=str(root), **ENV)
    # Through _die_with_parent: a bench that is killed leaves no server behind.
    # In root: `python -m` puts the working directory first on the path, before PYTHONPATH.
    proc = subprocess.Popen([sys.executable, "-m", "prophet_tf.tools._die_with_parent",
                             str(os.getpid()), sys.executable, *args, "--port-file", port_file],
                            env=env, cwd=root)
    return proc, wait_for_port(proc, port_file, args)


def wait_for_port(proc: subprocess.Popen, port_file: str, args: list[str]) -> int:
    """The port a server started as ``args`` wrote to ``port_file`` (killed if it
    does not within 2 minutes)."""
    deadline = time.monotonic() + 120
    while not os.path.exists(port_file):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"{args} did not start (exit code {proc.poll()})")
        time.sleep(0.05)
    return int(pathlib.Path(port_file).read_text())


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


class BareClient:
    """grpcio's client of bare servers (``sizes[i]``: server i's message sizes):
    one step's traffic at a time, as bench_transport's PS steps send it."""

    def __init__(self, ports: list[int], sizes: list[list[int]], inflight: int):
        import grpc

        self.channels = [grpc.insecure_channel(f"127.0.0.1:{port}",
                                               options=protocol.channel_options())
                         for port in ports]
        pushes = [c.unary_unary("/bare.Bare/Push") for c in self.channels]
        self.pulls = [c.unary_stream("/bare.Bare/Pull") for c in self.channels]
        self.payloads = [(push, b"\0" * size) for push, own in zip(pushes, sizes) for size in own]
        self.requests = [f"{len(own)} {max(own)}".encode() for own in sizes]
        self.pool = concurrent.futures.ThreadPoolExecutor(inflight)
        self.pullers = concurrent.futures.ThreadPoolExecutor(len(ports))

    def step(self) -> float:
        """Every push, a Pull stream per server beside them: the wall time."""
        t = time.perf_counter()
        pulled = [self.pullers.submit(lambda p=p, r=r: sum(len(m) for m in p(r, timeout=60)))
                  for p, r in zip(self.pulls, self.requests)]
        for f in [self.pool.submit(push, payload, timeout=60) for push, payload in self.payloads]:
            f.result()
        for f in pulled:
            f.result()
        return time.perf_counter() - t

    def close(self) -> None:
        self.pool.shutdown()
        self.pullers.shutdown()
        for channel in self.channels:
            channel.close()


def bare_steps(ports: list[int], sizes: list[list[int]], reps: int, inflight: int,
               servers: list[int]) -> dict:
    """The same traffic through bare servers (``sizes[i]``: server i's message
    sizes): wall time and CPU per step of this client and of the servers."""
    client = BareClient(ports, sizes, inflight)
    times = []
    try:
        for rep in range(reps + 1):
            if rep == 1:
                cpu0 = cpu_seconds(), sum(cpu_seconds(pid) for pid in servers)
            times.append(client.step())
        cpu = (cpu_seconds() - cpu0[0]) / reps, (sum(map(cpu_seconds, servers)) - cpu0[1]) / reps
    finally:
        client.close()
    return {"step_s": times[1:], "client_cpu_s": cpu[0], "server_cpu_s": cpu[1]}


def partition_sizes(shapes: list, num_ps: int) -> list[list[int]]:
    """Each PS task's partitions' bytes, in its pull order, for float32 variables
    of ``shapes`` cut as the engine cuts them."""
    plan = sharding.plan(variable_specs(shapes), num_ps, spread=True)
    return [[p.nbytes for p in sharding.owned_by(plan, i)] for i in range(num_ps)]


def variable_specs(shapes: list) -> list:
    return [ps_pb2.VariableSpec(key=i, name=f"dense_{i}/kernel", shape=s, dtype="float32",
                                priority=i) for i, s in enumerate(shapes)]


def model_shapes(mb: float, variables: int) -> list[tuple[int, int]]:
    """``variables`` float32 matrices of 1000 columns, ``mb`` MB in all."""
    cols = 1000
    return [(int(mb * 1e6 / 4 / cols / variables), cols)] * variables


class PSSet:
    """``num_ps`` PS processes run from the source tree ``root`` and this process's
    clients of them: one training step's traffic at a time, each timed with the
    CPU it cost this process and the PS processes."""

    def __init__(self, shapes: list, inflight: int, num_ps: int, tmp: str,
                 root: pathlib.Path = ROOT):
        specs = variable_specs(shapes)
        plan = sharding.plan(specs, num_ps, spread=True)
        self.partitions = len(plan)
        self.owned = [sharding.owned_by(plan, i) for i in range(num_ps)]
        self.by_id = {(p.key, p.partition): p for p in plan}
        rng = np.random.default_rng(0)
        self.params = {i: rng.standard_normal(s, dtype=np.float32) for i, s in enumerate(shapes)}
        self.grads = {i: np.ones(s, np.float32) for i, s in enumerate(shapes)}
        self.out = {i: np.empty(s, np.float32) for i, s in enumerate(shapes)}
        self.procs, self.clients, self.executors = [], [], []
        self.steps = 0  # steps pushed: the next push is of this step
        try:
            for i in range(num_ps):
                self.procs.append(start(["-m", "prophet_tf.ps.server", "--num-workers", "1",
                                         "--ps-index", str(i), "--num-ps", str(num_ps),
                                         "--port", "0"], tmp, root))
            self.clients = [ps_client.PSClient(f"127.0.0.1:{port}", worker_id=0, num_workers=1)
                            for _, port in self.procs]
            for client in self.clients:
                client.wait_ready(60)
            ps_client.register_all(self.clients, specs, SGD_CONFIG, self.params, timeout=120)
            self.pool = concurrent.futures.ThreadPoolExecutor(inflight)
            self.pullers = concurrent.futures.ThreadPoolExecutor(num_ps)  # a stream per PS
            self.stepper = concurrent.futures.ThreadPoolExecutor(1)  # pulls beside the pushes
            self.executors = [self.pool, self.pullers, self.stepper]
        except BaseException:
            self.close()
            raise
        self.pids = [proc.pid for proc, _ in self.procs]

    def _push_all(self) -> None:
        calls = [self.pool.submit(ps_helpers.push, client, [c], 60)
                 for client, own in zip(self.clients, self.owned)
                 for c in ps_helpers.gradient_chunks(self.grads, own, self.steps)]
        for f in calls:
            f.result()
        self.steps += 1

    def _pull_one(self, client, own, version: int) -> None:
        n = 0
        for chunk in client.pull(own, version, timeout=60):
            ps_helpers.write_chunk(chunk, self.out, self.by_id)
            n += 1
        assert n == len(own)

    def _pull_all(self, version: int) -> None:
        for f in [self.pullers.submit(self._pull_one, c, own, version)
                  for c, own in zip(self.clients, self.owned)]:
            f.result()

    def cpu(self) -> tuple[float, float]:
        """CPU-seconds so far of this process and of the PS processes."""
        return cpu_seconds(), sum(map(cpu_seconds, self.pids))

    def step(self) -> float:
        """Push + apply + pull of one step, pulls beside the pushes: its wall time."""
        t = time.perf_counter()
        pulled = self.stepper.submit(self._pull_all, self.steps + 1)
        self._push_all()
        pulled.result()
        return time.perf_counter() - t

    def push_then_pull(self) -> tuple[float, float]:
        """A push to an idle PS, then a pull of a ready version: their wall times."""
        t = time.perf_counter()
        self._push_all()
        push = time.perf_counter() - t
        self._pull_all(self.steps)  # waits for the applies: not timed
        t = time.perf_counter()
        self._pull_all(self.steps)
        return push, time.perf_counter() - t

    def check(self) -> None:
        np.testing.assert_allclose(self.out[0][:2, :4], self.params[0][:2, :4] - LR * self.steps,
                                   atol=1e-4, err_msg="the PS's values are wrong")

    def close(self) -> None:
        for client in self.clients:
            client.close()
        for executor in self.executors:
            executor.shutdown()
        for proc, _ in self.procs:
            stop(proc)


def ps_steps(sets: list[PSSet], reps: int) -> list[dict]:
    """Push + apply + pull through each PS set, the sets taking turns step by step
    (the first to go alternating), so that a machine whose speed drifts treats
    them alike: per set, the wall time and CPU per step of this client and of
    its PS processes, then push alone and pull alone."""
    times = [[] for _ in sets]
    cpu = [[0.0, 0.0] for _ in sets]
    for rep in range(reps + 1):  # rep 0 also traces the applies: not counted
        for i in (range(len(sets)) if rep % 2 == 0 else reversed(range(len(sets)))):
            before = sets[i].cpu()
            times[i].append(sets[i].step())
            if rep:
                cpu[i] = [c + now - then for c, now, then in zip(cpu[i], sets[i].cpu(), before)]
    alone = [[] for _ in sets]
    for _ in range(reps + 1):
        for i, ps_set in enumerate(sets):
            alone[i].append(ps_set.push_then_pull())
    results = []
    for ps_set, t, (client, ps), one in zip(sets, times, cpu, alone):
        ps_set.check()
        results.append({"partitions": ps_set.partitions,
                        "step_s": t[1:], "push_s": [a[0] for a in one[1:]],
                        "pull_s": [a[1] for a in one[1:]],
                        "client_cpu_s": client / reps, "ps_cpu_s": ps / reps})
    return results


def traffic_arguments(description: str, reps: int) -> argparse.ArgumentParser:
    """A parser with the traffic's options, as this bench and bench_grpc_floor.py take them."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--mb", type=float, default=100.0, help="model size in MB (1e6 bytes)")
    parser.add_argument("--variables", type=int, default=4)
    parser.add_argument("--reps", type=int, default=reps)
    parser.add_argument("--inflight", type=int, default=4, help="concurrent push requests")
    parser.add_argument("--ps", default="1", help="comma-separated PS process counts (default 1)")
    return parser


def main(argv=None) -> int:
    parser = traffic_arguments(__doc__.split("\n\n")[0], reps=7)
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--baseline-root", type=pathlib.Path, default=None,
                        help="also run PS processes from this checkout of prophet_tf (its "
                             "protos built, same wire protocol), taking turns step by step "
                             "with this tree's: a before/after comparison in one run")
    parser.add_argument("--bare-server", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.bare_server:
        return bare_server(args.port_file)
    ps_counts = [int(n) for n in args.ps.split(",")]
    if not ps_counts or min(ps_counts) < 1 or args.reps < 1 or args.mb <= 0:
        parser.error(f"--ps takes PS counts >= 1, --reps >= 1, --mb > 0. Received: "
                     f"--ps={args.ps} --reps={args.reps} --mb={args.mb}")
    baseline = args.baseline_root
    if baseline is not None:
        baseline = baseline.resolve()
        if not (baseline / "prophet_tf" / "ps" / "v1" / "ps_pb2.py").is_file():
            parser.error("--baseline-root must be a prophet_tf checkout with its protos built "
                         f"(prophet_tf/ps/v1/ps_pb2.py; `make build` there). Received: "
                         f"--baseline-root={args.baseline_root}")
        for root in (ROOT, baseline):
            trees.check_imports_from(root, ENV)
    codec.tune_allocator()  # as a worker would; the PS main does it too

    shapes = model_shapes(args.mb, args.variables)
    model_bytes = sum(4 * r * c for r, c in shapes)

    src = np.ones(model_bytes // 4, np.float32)
    dst = np.empty_like(src)
    memcpy = []
    for _ in range(args.reps):
        t = time.perf_counter()
        np.copyto(dst, src)
        memcpy.append(time.perf_counter() - t)
    del src, dst

    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for num_ps in ps_counts:
            roots = [ROOT] if baseline is None else [ROOT, baseline]
            sets = []
            try:
                for root in roots:
                    sets.append(PSSet(shapes, args.inflight, num_ps, tmp, root))
                measured = ps_steps(sets, args.reps)
            finally:
                for ps_set in sets:
                    ps_set.close()
            run = {"ps": num_ps, "prophet": measured[0]}
            if baseline is not None:
                run["baseline"] = measured[1]
            bare = [start([__file__, "--bare-server"], tmp) for _ in range(num_ps)]
            try:
                run["bare"] = bare_steps([port for _, port in bare],
                                         partition_sizes(shapes, num_ps),
                                         args.reps, args.inflight, [p.pid for p, _ in bare])
            finally:
                for proc, _ in bare:
                    stop(proc)
            runs.append(run)

    print(f"model: {model_bytes / 1e6:.0f} MB float32 in {len(shapes)} variables; W=1 on "
          f"loopback; SGD applied on the PS; {args.reps} reps after 1 warm-up; "
          f"{args.inflight} pushes in flight; {os.cpu_count()} cores")
    for run in runs:
        p, b = run["prophet"], run["bare"]
        print(f"--- {run['ps']} PS process(es), {p['partitions']} partitions")
        for label, p in [("", p)] + ([("baseline ", run["baseline"])] if "baseline" in run else []):
            print(f"{label}step (push+apply+pull, model bytes/s): "
                  f"{summary(p['step_s'], model_bytes)}")
            print(f"{label}CPU-s per GB on the wire: client "
                  f"{per_gb(p['client_cpu_s'], model_bytes):.2f}, "
                  f"PS {per_gb(p['ps_cpu_s'], model_bytes):.2f}")
            print(f"{label}push only:                  {summary(p['push_s'], model_bytes)}")
            print(f"{label}pull only:                  {summary(p['pull_s'], model_bytes)}")
        print(f"bare gRPC step, same traffic:          {summary(b['step_s'], model_bytes)}")
        print(f"bare CPU-s per GB on the wire: client {per_gb(b['client_cpu_s'], model_bytes):.2f}, "
              f"servers {per_gb(b['server_cpu_s'], model_bytes):.2f}")
    print(f"memcpy (numpy copyto, reference):      {summary(memcpy, model_bytes)}")
    if args.json:
        config = {k: v for k, v in vars(args).items()
                  if k not in ("json", "bare_server", "port_file", "baseline_root")}
        config.update(model_bytes=model_bytes, cores=os.cpu_count(), commit=trees.commit(ROOT))
        if baseline is not None:
            config.update(baseline_root=str(baseline), baseline_commit=trees.commit(baseline))
        with open(args.json, "w") as f:
            json.dump({"config": config, "memcpy_s": memcpy, "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
