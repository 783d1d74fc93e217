"""gRPC's own CPU per GB on loopback, from Python (grpcio) and from C++: the
floor under any data path that keeps gRPC as its transport, beside TCP's,
prophet_tf's and TensorFlow's ring's.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_grpc_floor.py [--mb 100] [--reps 9] \
        [--ps 1,2] [--json benchmarks/grpc-floor.json]

Needs g++ and Debian's libgrpc++-dev and pkg-config (`apt-get install
libgrpc++-dev pkg-config`): ``benchmarks/native/bare_grpc.cc`` is compiled
into a temporary directory.

The traffic is ``bench_transport.py``'s bare traffic: one step pushes every
partition of an ``--mb`` MB float32 model (cut as the engine cuts it over
``--ps`` servers; ``--inflight`` unary calls at a time) while one Pull stream
per server brings as many messages back. No server does any work beyond
gRPC's: grpcio's sends prebuilt bytes and drops what it receives, as in
``bench_transport.py``; the C++ one sends a prebuilt slice by reference and
drops what it receives. Both speak the same methods, so each of the two
clients (grpcio in this process, C++ in a subprocess) runs against each of the
two kinds of servers, four pairs in all, taking turns step by step (the order
reversed every other step) so that the machine's drift falls on all alike.
Three more take the same turns:
* ``tcp``: the same bytes both ways through a plain TCP connection on
  loopback, no gRPC: what the kernel alone costs (both ends' CPU);
* ``prophet_tf/ps``: prophet_tf's own path, ``bench_transport.py``'s PS
  processes (decode, sum, SGD apply, encode) and their client;
* ``tf-ring``: with one server, two TensorFlow workers all-reducing the model
  with MultiWorkerMirroredStrategy's ring over gRPC, tf-mwms' transport; for
  two workers the wire carries the model each way, as a push and a pull do
  (both workers' CPU).
Per pair: the wall time of a step, and the CPU of the client and of the
servers per step, as CPU-seconds per GB on the wire (the model both ways).
Median and spread over ``--reps`` steps after a warm-up; ``prophet-tf
report``'s ``grpc_floor`` kind renders the JSON.

With ``--messages N``, the four gRPC pairs also take turns on a step of N
small pushes (``--message-bytes``) to one server while its Pull stream
brings N messages of that size back: the CPU of a message, not of a byte
(the ``grpc_messages`` kind).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_transport as transport  # noqa: E402
import trees  # noqa: E402
from prophet_tf.cluster import free_port  # noqa: E402

SOURCE = ROOT / "benchmarks" / "native" / "bare_grpc.cc"
KINDS = ("grpcio", "c++")


def build(out_dir: str) -> str:
    """Compiles bare_grpc.cc against the system's gRPC C++ library: the binary's path."""
    if shutil.which("pkg-config") is None or subprocess.run(
            ["pkg-config", "--exists", "grpc++"]).returncode != 0:
        sys.exit("bench_grpc_floor.py needs gRPC's C++ library and pkg-config: "
                 "apt-get install libgrpc++-dev pkg-config")
    flags = subprocess.run(["pkg-config", "--cflags", "--libs", "grpc++"], check=True,
                           capture_output=True, text=True).stdout.split()
    binary = os.path.join(out_dir, "bare_grpc")
    subprocess.run(["g++", "-O2", "-std=c++17", "-Wall", "-Wextra", "-o", binary, str(SOURCE),
                    *flags], check=True)
    return binary


def grpc_version() -> str:
    return subprocess.run(["pkg-config", "--modversion", "grpc++"], check=True,
                          capture_output=True, text=True).stdout.strip()


def start_native_server(binary: str, tmp: str) -> tuple[subprocess.Popen, int]:
    """A C++ bare server, which dies with this process: (process, port)."""
    port_file = os.path.join(tmp, f"native-port{len(os.listdir(tmp))}")
    proc = subprocess.Popen([sys.executable, "-m", "prophet_tf.tools._die_with_parent",
                             str(os.getpid()), binary, "server", port_file],
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    return proc, transport.wait_for_port(proc, port_file, ["bare_grpc", "server"])


class NativeClient:
    """The C++ client, one step per line it reads: wall and CPU per step."""

    def __init__(self, binary: str, ports: list[int], sizes: list[list[int]], inflight: int):
        targets = [f"{port}={','.join(map(str, own))}" for port, own in zip(ports, sizes)]
        self.proc = subprocess.Popen([binary, "client", str(inflight), *targets],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if self.proc.stdout.readline().strip() != "ready":
            self.close()
            raise RuntimeError(f"the C++ client did not start (exit code {self.proc.poll()})")
        self.cpu_s = 0.0

    def step(self) -> float:
        self.proc.stdin.write("step\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline().split()
        if len(line) != 2:
            raise RuntimeError(f"the C++ client failed a step (exit code {self.proc.poll()})")
        self.cpu_s += float(line[1])
        return float(line[0])

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class InProcess:
    """A pair whose client runs in this process (``pair``: ``step()`` -> wall
    seconds, ``close()``): this process's CPU counted per step."""

    def __init__(self, pair):
        self.pair, self.cpu_s = pair, 0.0

    def step(self) -> float:
        before = transport.cpu_seconds()
        wall = self.pair.step()
        self.cpu_s += transport.cpu_seconds() - before
        return wall

    def close(self) -> None:
        self.pair.close()


class TcpPair:
    """The same bytes through two loopback TCP sockets with no gRPC: one
    connection, the pushes' bytes one way while the pulls' come back, sent from
    one buffer and received into another by threads of this process. Its CPU
    is both ends': the kernel's cost of moving the bytes, under any transport
    over TCP here."""

    def __init__(self, sizes: list[list[int]]):
        self.nbytes = sum(map(sum, sizes))
        with socket.create_server(("127.0.0.1", 0)) as listener:
            self.ends = [socket.create_connection(listener.getsockname())]
            self.ends.append(listener.accept()[0])
        self.source = bytearray(self.nbytes)
        self.sinks = [bytearray(self.nbytes) for _ in self.ends]

    def _receive(self, end: socket.socket, sink: bytearray) -> None:
        view, got = memoryview(sink), 0
        while got < self.nbytes:
            n = end.recv_into(view[got:], min(self.nbytes - got, 4 << 20))
            if n == 0:
                raise RuntimeError("a TCP end closed early")
            got += n

    def step(self) -> float:
        t = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            done = [pool.submit(end.sendall, self.source) for end in self.ends]
            done += [pool.submit(self._receive, end, sink)
                     for end, sink in zip(reversed(self.ends), self.sinks)]
            for f in done:
                f.result()
        return time.perf_counter() - t

    def close(self) -> None:
        for end in self.ends:
            end.close()


def ring_worker(index: int, ports: list[int], nbytes: int) -> int:
    """A TensorFlow worker of a MultiWorkerMirroredStrategy ring, as tf-mwms runs
    it: an all-reduce (sum) of ``nbytes`` of float32 per step read from stdin,
    each answered "<wall s> <CPU s>" after "ready" (one warm-up step)."""
    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": [f"127.0.0.1:{port}" for port in ports]},
        "task": {"type": "worker", "index": index}})
    import tensorflow as tf

    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    values = tf.ones([nbytes // 4], tf.float32)
    run = tf.function(lambda: strategy.run(lambda: tf.distribute.get_replica_context()
                                           .all_reduce(tf.distribute.ReduceOp.SUM, values)))

    def first_of_sum() -> float:
        return float(strategy.experimental_local_results(run())[0][0])

    if first_of_sum() != len(ports):  # the warm-up step; every element sums to W
        sys.exit("the ring's sum is wrong")
    print("ready", flush=True)
    for _ in sys.stdin:
        before, t = transport.cpu_seconds(), time.perf_counter()
        total = first_of_sum()
        print(f"{time.perf_counter() - t} {transport.cpu_seconds() - before}", flush=True)
        if total != len(ports):
            sys.exit("the ring's sum is wrong")
    return 0


class TfRing:
    """Two TensorFlow workers all-reducing the model over loopback with their
    ring (tf-mwms' transport): per step, the wire carries the model each way
    between the two, as a push and a pull do. Wall: the slower worker's; CPU:
    both workers'."""

    def __init__(self, nbytes: int):
        ports = [free_port() for _ in range(2)]
        env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2")
        self.procs = [subprocess.Popen(
            [sys.executable, "-m", "prophet_tf.tools._die_with_parent", str(os.getpid()),
             sys.executable, __file__, "--ring-worker", str(i), "--ring-ports",
             ",".join(map(str, ports)), "--ring-bytes", str(nbytes)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
            for i in range(2)]
        for proc in self.procs:
            if proc.stdout.readline().strip() != "ready":
                self.close()
                raise RuntimeError(f"a ring worker did not start (exit code {proc.poll()})")
        self.cpu_s = 0.0

    def step(self) -> float:
        for proc in self.procs:
            proc.stdin.write("step\n")
            proc.stdin.flush()
        lines = [proc.stdout.readline().split() for proc in self.procs]
        if any(len(line) != 2 for line in lines):
            raise RuntimeError("a ring worker failed a step")
        self.cpu_s += sum(float(line[1]) for line in lines)
        return max(float(line[0]) for line in lines)

    def close(self) -> None:
        for proc in self.procs:
            proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class CheckedPSSet(transport.PSSet):
    """prophet_tf's own data path on the same traffic: PS processes that sum
    and apply SGD, and their client; closing checks the values it pulled,
    unless a step failed (then that step's error is the one to read)."""

    failed = False

    def step(self) -> float:
        try:
            return super().step()
        except BaseException:
            self.failed = True
            raise

    def close(self) -> None:
        try:
            if not self.failed:
                self.check()  # the values it pulled are the ones SGD gives
        finally:
            super().close()


def pairs_in_turns(clients: dict, servers: dict, reps: int) -> dict:
    """Each (client kind, server kind) pair's steps in turns: per pair, the wall
    times and the client's and servers' CPU per step."""
    names = list(clients)
    times = {name: [] for name in names}
    server_cpu = {name: 0.0 for name in names}
    for name in names:  # warm-up of every pair, not counted
        clients[name].step()
    for name in names:
        clients[name].cpu_s = 0.0
    for rep in range(reps):
        for name in (names if rep % 2 == 0 else reversed(names)):
            pids = servers[name[1]]
            before = sum(map(transport.cpu_seconds, pids))
            times[name].append(clients[name].step())
            server_cpu[name] += sum(map(transport.cpu_seconds, pids)) - before
    return {f"{c}/{s}": {"client": c, "server": s, "step_s": times[(c, s)],
                         "client_cpu_s": clients[(c, s)].cpu_s / reps,
                         "server_cpu_s": server_cpu[(c, s)] / reps}
            for c, s in names}


def grpc_pairs(binary: str, tmp: str, sizes: list[list[int]], reps: int, inflight: int,
               extra=None) -> dict:
    """The four gRPC pairs on one server set per kind (``sizes[i]``: server i's
    messages), and any ``extra(clients, servers)`` adds, in turns."""
    procs, clients = [], {}
    try:
        for _ in sizes:
            procs.append(("grpcio", *transport.start([transport.__file__, "--bare-server"],
                                                     tmp)))
            procs.append(("c++", *start_native_server(binary, tmp)))
        servers = {kind: [p.pid for k, p, _ in procs if k == kind] for kind in KINDS}
        ports = {kind: [port for k, _, port in procs if k == kind] for kind in KINDS}
        for server in KINDS:
            clients["grpcio", server] = InProcess(transport.BareClient(ports[server], sizes,
                                                                       inflight))
            clients["c++", server] = NativeClient(binary, ports[server], sizes, inflight)
        if extra is not None:
            extra(clients, servers)
        return pairs_in_turns(clients, servers, reps)
    finally:
        for client in clients.values():
            client.close()
        for _, proc, _ in procs:
            transport.stop(proc)


def main(argv=None) -> int:
    parser = transport.traffic_arguments(__doc__.split("\n\n")[0], reps=9)
    parser.add_argument("--messages", type=int, default=0,
                        help="also a step of this many small pushes and as many pulled "
                             "messages through one server, for the cost per message")
    parser.add_argument("--message-bytes", type=int, default=1000)
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--ring-worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--ring-ports", help=argparse.SUPPRESS)
    parser.add_argument("--ring-bytes", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.ring_worker is not None:
        return ring_worker(args.ring_worker, [int(p) for p in args.ring_ports.split(",")],
                           args.ring_bytes)
    counts = [int(n) for n in args.ps.split(",")]
    if (not counts or min(counts) < 1 or args.reps < 1 or args.mb <= 0 or args.inflight < 1
            or args.messages < 0 or args.message_bytes < 0):
        parser.error(f"--ps takes counts >= 1, --reps and --inflight >= 1, --mb > 0, "
                     f"--messages and --message-bytes >= 0. Received: --ps={args.ps} "
                     f"--reps={args.reps} --inflight={args.inflight} --mb={args.mb} "
                     f"--messages={args.messages} --message-bytes={args.message_bytes}")
    shapes = transport.model_shapes(args.mb, args.variables)
    model_bytes = sum(4 * r * c for r, c in shapes)
    runs, messages = [], None
    with tempfile.TemporaryDirectory() as tmp:
        binary = build(tmp)
        for num_ps in counts:
            sizes = transport.partition_sizes(shapes, num_ps)

            def others(clients, servers, num_ps=num_ps, sizes=sizes):
                clients["tcp", "tcp"] = InProcess(TcpPair(sizes))
                servers["tcp"] = []  # both ends in this process: the client's CPU
                ps_set = CheckedPSSet(shapes, args.inflight, num_ps, tmp)
                clients["prophet_tf", "ps"] = InProcess(ps_set)
                servers["ps"] = ps_set.pids
                if num_ps == 1:  # the ring's traffic does not depend on the PS count
                    clients["tf-ring", "tf-ring"] = TfRing(model_bytes)
                    servers["tf-ring"] = []  # both workers' CPU: the client's

            pairs = grpc_pairs(binary, tmp, sizes, args.reps, args.inflight, others)
            runs.append({"ps": num_ps, "partitions": sum(map(len, sizes)), "pairs": pairs})
            for name, pair in pairs.items():
                print(f"{num_ps} server(s), {name:>15}: "
                      f"{transport.summary(pair['step_s'], model_bytes)}; CPU-s per GB: client "
                      f"{transport.per_gb(pair['client_cpu_s'], model_bytes):.2f}, servers "
                      f"{transport.per_gb(pair['server_cpu_s'], model_bytes):.2f}")
        if args.messages:
            pairs = grpc_pairs(binary, tmp, [[args.message_bytes] * args.messages], args.reps,
                               args.inflight)
            messages = {"count": args.messages, "bytes": args.message_bytes, "pairs": pairs}
            for name, pair in pairs.items():
                per = 1e6 / (2 * args.messages)  # a push and a pulled message each
                print(f"{args.message_bytes}-byte messages, {name:>13}: CPU µs per message: "
                      f"client {pair['client_cpu_s'] * per:.0f}, server "
                      f"{pair['server_cpu_s'] * per:.0f}")
    if args.json:
        config = {k: v for k, v in vars(args).items()
                  if k != "json" and not k.startswith("ring")}
        config.update(model_bytes=model_bytes, cores=os.cpu_count(), commit=trees.commit(ROOT),
                      grpc_cpp=grpc_version(), grpcio=__import__("grpc").__version__)
        with open(args.json, "w") as f:
            json.dump({"config": config, "runs": runs, "messages": messages}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
