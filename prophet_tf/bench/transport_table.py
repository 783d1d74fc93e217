"""The docs' tables of the transport on loopback, rate and CPU: ``benchmarks/
bench_transport.py``'s push + apply + pull against bare gRPC (``prophet-tf
report``'s ``transport`` kind) and ``benchmarks/bench_grpc_floor.py``'s gRPC
from Python and C++ beside TCP and TensorFlow's ring (``grpc_floor``), and
the CPU of a small message (``grpc_messages``)."""
from __future__ import annotations

import statistics

__all__ = ["transport_table", "grpc_floor_table", "grpc_messages_table", "cpu_per_gb", "KINDS"]


def _rate(seconds: list[float], nbytes: int) -> str:
    """Median GB/s of model bytes and its spread."""
    rates = sorted(nbytes / s / 1e9 for s in seconds)
    return f"{statistics.median(rates):.2f} ({rates[0]:.2f}–{rates[-1]:.2f})"


def cpu_per_gb(cpu_s: float, model_bytes: int) -> float:
    """CPU-seconds per GB on the wire: a step moves the model both ways."""
    return cpu_s / (2 * model_bytes / 1e9)


def _per_gb(cpu_s: float, model_bytes: int) -> str:
    return f"{cpu_per_gb(cpu_s, model_bytes):.2f}"


def transport_table(result: dict) -> str:
    """Markdown lines: a row per PS process count, the PS path's and bare gRPC's
    GB/s (median and spread) and CPU-seconds per GB on the wire of each side;
    with a baseline (``--baseline-root``), its row first, with the same run's bare
    gRPC, and the commits in the last line."""
    config = result["config"]
    size = config["model_bytes"]
    lines = ["| PS processes | partitions | push+apply+pull GB/s | CPU-s/GB worker | "
             "CPU-s/GB PS | CPU-s/GB both | bare gRPC GB/s | bare CPU-s/GB client | "
             "bare CPU-s/GB servers | bare CPU-s/GB both |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for run in result["runs"]:
        b = run["bare"]
        bare = (f"{_rate(b['step_s'], size)} | {_per_gb(b['client_cpu_s'], size)} | "
                f"{_per_gb(b['server_cpu_s'], size)} | "
                f"{_per_gb(b['client_cpu_s'] + b['server_cpu_s'], size)}")
        sides = [(f"{run['ps']}, {config.get('baseline_commit')}", run["baseline"])
                 ] if "baseline" in run else []
        commit = f", {config.get('commit')}" if "baseline" in run else ""
        for label, p in sides + [(f"{run['ps']}{commit}", run["prophet"])]:
            lines.append(
                f"| {label} | {p['partitions']} | {_rate(p['step_s'], size)} | "
                f"{_per_gb(p['client_cpu_s'], size)} | {_per_gb(p['ps_cpu_s'], size)} | "
                f"{_per_gb(p['client_cpu_s'] + p['ps_cpu_s'], size)} | {bare} |")
    lines.append("")
    lines.append(f"A {size / 1e6:.0f} MB float32 model in {config['variables']} variables, one "
                 f"worker on loopback, SGD on the PS, {config['inflight']} pushes in flight; "
                 f"median (min–max) of {config['reps']} steps after a warm-up; "
                 f"{config['cores']} cores; memcpy of the model {_rate(result['memcpy_s'], size)} "
                 "GB/s." + (f" The PS processes of commits {config['baseline_commit']} and "
                            f"{config['commit']} took turns step by step."
                            if "baseline_commit" in config else ""))
    return "\n".join(lines) + "\n"


#: ``benchmarks/bench_grpc_floor.py``'s pairs whose CPU is one figure, both ends'.
_BOTH_ENDS = {"tcp": "TCP sockets, no gRPC", "tf-ring": "TensorFlow's ring (2 workers)"}


def grpc_floor_table(result: dict) -> str:
    """Markdown lines of ``benchmarks/bench_grpc_floor.py``: a row per server
    count and pair (client kind / server kind), GB/s of model bytes (median and
    spread) and CPU-seconds per GB on the wire of each side and both."""
    config = result["config"]
    size = config["model_bytes"]
    lines = ["| servers | client / server | GB/s | CPU-s/GB client | CPU-s/GB servers | "
             "CPU-s/GB both |", "|---|---|---|---|---|---|"]
    for run in result["runs"]:
        for pair in run["pairs"].values():
            both = _per_gb(pair["client_cpu_s"] + pair["server_cpu_s"], size)
            if pair["client"] in _BOTH_ENDS:
                name, split = _BOTH_ENDS[pair["client"]], "– | –"
            else:
                name = f"{pair['client']} / {pair['server']}"
                split = (f"{_per_gb(pair['client_cpu_s'], size)} | "
                         f"{_per_gb(pair['server_cpu_s'], size)}")
            lines.append(f"| {run['ps']} | {name} | {_rate(pair['step_s'], size)} | {split} | "
                         f"{both} |")
    lines.append("")
    lines.append(f"A {size / 1e6:.0f} MB float32 model cut in partitions over the servers, "
                 f"{config['inflight']} pushes in flight, on loopback; every pair took turns "
                 f"step by step; median (min–max) of {config['reps']} steps after a warm-up; "
                 f"{config['cores']} cores; gRPC C++ {config['grpc_cpp']}, grpcio "
                 f"{config['grpcio']}; commit {config['commit']}.")
    return "\n".join(lines) + "\n"


def grpc_messages_table(result: dict) -> str:
    """Markdown lines of ``benchmarks/bench_grpc_floor.py --messages``: per gRPC
    pair, the CPU of one small message (a push or a pulled message) at the
    client, at the server and both, and the wall time of one."""
    runs = result["messages"]
    per = 1e6 / (2 * runs["count"])  # µs per message: a push and a pulled message each
    lines = ["| client / server | CPU µs client | CPU µs server | CPU µs both | wall µs |",
             "|---|---|---|---|---|"]
    for pair in runs["pairs"].values():
        wall = sorted(pair["step_s"])
        lines.append(f"| {pair['client']} / {pair['server']} | {pair['client_cpu_s'] * per:.0f} | "
                     f"{pair['server_cpu_s'] * per:.0f} | "
                     f"{(pair['client_cpu_s'] + pair['server_cpu_s']) * per:.0f} | "
                     f"{wall[len(wall) // 2] * per:.0f} "
                     f"({wall[0] * per:.0f}–{wall[-1] * per:.0f}) |")
    config = result["config"]
    lines.append("")
    lines.append(f"Per message, in steps of {runs['count']} pushes of {runs['bytes']} bytes to one "
                 f"server ({config['inflight']} in flight) while its Pull stream brings "
                 f"{runs['count']} messages of that size back; CPU per step over the "
                 f"{2 * runs['count']} messages, wall the median (min–max) step's; "
                 f"{config['reps']} steps after a warm-up, the pairs in turns; gRPC C++ "
                 f"{config['grpc_cpp']}, grpcio {config['grpcio']}; commit {config['commit']}.")
    return "\n".join(lines) + "\n"


#: ``prophet-tf report``'s kinds of this module's tables.
KINDS = {"transport": transport_table, "grpc_floor": grpc_floor_table,
         "grpc_messages": grpc_messages_table}
