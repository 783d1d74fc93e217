"""Prints one task's TF_CONFIG for a cluster given on the command line.

    export TF_CONFIG=$(python tf_config.py --ps 10.0.0.10:2222 \\
        --worker 10.0.0.11:2222,10.0.0.12:2222 --task worker:1)
"""
import argparse
import json
import sys


def tf_config(ps: list[str], workers: list[str], task_type: str, index: int) -> dict:
    """The TF_CONFIG dict of task `task_type`:`index`.

    Raises:
      ValueError: an empty list, an address without a port, or no such task.
    """
    for name, addresses in (("--ps", ps), ("--worker", workers)):
        if not addresses:
            raise ValueError(f"{name} needs at least one HOST:PORT. Received: {addresses}")
        for address in addresses:
            host, sep, port = address.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"{name} takes HOST:PORT addresses. Received: {address!r}")
    tasks = {"ps": ps, "worker": workers}
    if task_type not in tasks or not 0 <= index < len(tasks[task_type]):
        raise ValueError(f"--task must name a task of the cluster (ps:0..{len(ps) - 1}, "
                         f"worker:0..{len(workers) - 1}). Received: {task_type}:{index}")
    return {"cluster": {"ps": ps, "worker": workers},
            "task": {"type": task_type, "index": index}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ps", required=True, help="PS addresses, comma-separated HOST:PORT")
    parser.add_argument("--worker", required=True,
                        help="worker addresses, comma-separated HOST:PORT")
    parser.add_argument("--task", required=True, help="TYPE:INDEX, e.g. worker:0 or ps:0")
    args = parser.parse_args(argv)
    task_type, _, index = args.task.partition(":")
    try:
        if not index.isdigit():
            raise ValueError(f"--task takes TYPE:INDEX. Received: {args.task!r}")
        config = tf_config([a for a in args.ps.split(",") if a],
                           [a for a in args.worker.split(",") if a], task_type, int(index))
    except ValueError as e:
        print(f"tf_config.py: {e}", file=sys.stderr)
        return 2
    print(json.dumps(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
