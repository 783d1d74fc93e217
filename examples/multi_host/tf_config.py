"""Prints the shell lines that set one task's TF_CONFIG, for a cluster given on the command line.

    eval "$(python tf_config.py --ps 10.0.0.10:2222 \\
        --worker 10.0.0.11:2222,10.0.0.12:2222 --task worker:1)"

prints ``export TF_CONFIG='...'`` for a shell to eval; with ``--json`` it
prints the TF_CONFIG alone (``TF_CONFIG=$(python tf_config.py --json ...)``).

With ``--workers-per-host N`` (one worker per GPU), each ``--worker``
address names a host running N workers, on PORT, PORT+1, ..., PORT+N-1,
numbered host by host (the first host's are workers 0..N-1), and a second
line sets CUDA_VISIBLE_DEVICES (the worker's position on its host; "" for a
PS task, which needs no GPU):

    eval "$(python tf_config.py --ps 10.0.0.11:2222,10.0.0.12:2222 \\
        --worker 10.0.0.11:2223,10.0.0.12:2223 --workers-per-host 2 --task worker:3)"
"""
import argparse
import json
import shlex
import sys

CUDA_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"


def _check_addresses(name: str, addresses: list[str]) -> None:
    if not addresses:
        raise ValueError(f"{name} needs at least one HOST:PORT. Received: {addresses}")
    for address in addresses:
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"{name} takes HOST:PORT addresses. Received: {address!r}")


def expand_workers(hosts: list[str], workers_per_host: int) -> list[str]:
    """Every worker's address: N per HOST:PORT of `hosts`, on PORT..PORT+N-1, host by host.

    Raises:
      ValueError: workers_per_host < 1, a malformed address, or a port past 65535.
    """
    if isinstance(workers_per_host, bool) or not isinstance(workers_per_host, int) or \
            workers_per_host < 1:
        raise ValueError("--workers-per-host must be an integer >= 1. "
                         f"Received: {workers_per_host!r}")
    _check_addresses("--worker", hosts)
    workers = []
    for address in hosts:
        host, _, port = address.rpartition(":")
        last = int(port) + workers_per_host - 1
        if last > 65535:
            raise ValueError(f"--workers-per-host {workers_per_host} needs ports {port}..{last} "
                             f"on {host}, past 65535. Received: {address!r}")
        workers += [f"{host}:{int(port) + j}" for j in range(workers_per_host)]
    return workers


def tf_config(ps: list[str], workers: list[str], task_type: str, index: int) -> dict:
    """The TF_CONFIG dict of task `task_type`:`index`.

    Raises:
      ValueError: an empty list, an address without a port, or no such task.
    """
    for name, addresses in (("--ps", ps), ("--worker", workers)):
        _check_addresses(name, addresses)
    tasks = {"ps": ps, "worker": workers}
    if task_type not in tasks or not 0 <= index < len(tasks[task_type]):
        raise ValueError(f"--task must name a task of the cluster (ps:0..{len(ps) - 1}, "
                         f"worker:0..{len(workers) - 1}). Received: {task_type}:{index}")
    return {"cluster": {"ps": ps, "worker": workers},
            "task": {"type": task_type, "index": index}}


def task_environment(ps: list[str], worker_hosts: list[str], workers_per_host: int,
                     task_type: str, index: int) -> dict[str, str]:
    """TF_CONFIG and CUDA_VISIBLE_DEVICES of a task when each worker host runs
    `workers_per_host` workers, one per GPU (see `expand_workers`).

    Raises:
      ValueError: as `expand_workers` and `tf_config`, or two tasks on one address.
    """
    workers = expand_workers(worker_hosts, workers_per_host)
    config = tf_config(ps, workers, task_type, index)
    everyone = ps + workers
    # A worker's extra ports can land on a task the user listed.
    duplicates = sorted({a for a in everyone if everyone.count(a) > 1})
    if duplicates:
        raise ValueError(f"two tasks cannot share an address (workers on host:PORT.."
                         f"PORT+{workers_per_host - 1}). Received: {duplicates}")
    # Worker i is the (i mod N)-th on its host: GPU i mod N there. A PS takes no GPU memory.
    device = str(index % workers_per_host) if task_type == "worker" else ""
    return {"TF_CONFIG": json.dumps(config), CUDA_DEVICES_ENV: device}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ps", required=True, help="PS addresses, comma-separated HOST:PORT")
    parser.add_argument("--worker", required=True,
                        help="worker addresses, comma-separated HOST:PORT (with "
                             "--workers-per-host: one per worker host, its first port)")
    parser.add_argument("--task", required=True, help="TYPE:INDEX, e.g. worker:0 or ps:0")
    parser.add_argument("--workers-per-host", type=int, default=None, metavar="N",
                        help="each --worker host runs N workers, one per GPU, on PORT..PORT+N-1;"
                             " also sets CUDA_VISIBLE_DEVICES")
    parser.add_argument("--json", action="store_true",
                        help="print the TF_CONFIG JSON alone instead of `export` lines "
                             "(not with --workers-per-host, which sets two variables)")
    args = parser.parse_args(argv)
    if args.json and args.workers_per_host is not None:
        parser.error("--json prints TF_CONFIG alone; --workers-per-host also sets "
                     "CUDA_VISIBLE_DEVICES, so it prints `export` lines. Received both")
    task_type, _, index = args.task.partition(":")
    ps = [a for a in args.ps.split(",") if a]
    workers = [a for a in args.worker.split(",") if a]
    try:
        if not index.isdigit():
            raise ValueError(f"--task takes TYPE:INDEX. Received: {args.task!r}")
        if args.workers_per_host is None:
            env = {"TF_CONFIG": json.dumps(tf_config(ps, workers, task_type, int(index)))}
            if args.json:
                print(env["TF_CONFIG"])
                return 0
        else:
            env = task_environment(ps, workers, args.workers_per_host, task_type, int(index))
    except ValueError as e:
        print(f"tf_config.py: {e}", file=sys.stderr)
        return 2
    # Lines for `eval "$(...)"`, the same with or without --workers-per-host.
    for name, value in env.items():
        print(f"export {name}={shlex.quote(value)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
