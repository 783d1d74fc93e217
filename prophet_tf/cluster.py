"""Who is in the cluster and who am I: TF_CONFIG, a dict, or a ClusterResolver.

Every malformed configuration raises ValueError naming what was received,
before anything waits on the network.
"""
from __future__ import annotations

import dataclasses
import json
import os
import socket
from typing import Any

TASK_TYPES = ("worker", "ps", "chief", "evaluator")


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """The resolved cluster: worker and PS addresses plus this process' task.

    A `chief` task, when the config has one, is treated as worker 0 (TF's
    convention), so `workers` lists chief first.
    """

    workers: tuple[str, ...]
    ps: tuple[str, ...]
    task_type: str
    task_index: int

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    @property
    def num_ps(self) -> int:
        return len(self.ps)

    @property
    def is_worker(self) -> bool:
        return self.task_type == "worker"

    @property
    def address(self) -> str:
        """This task's own host:port."""
        return (self.workers if self.is_worker else self.ps)[self.task_index]

    def to_tf_config(self) -> dict:
        """The TF_CONFIG dict that describes this cluster and task."""
        return {"cluster": {"worker": list(self.workers), "ps": list(self.ps)},
                "task": {"type": self.task_type, "index": self.task_index}}


def resolve(cluster: Any = None) -> ClusterConfig:
    """Resolves a cluster description into a ClusterConfig.

    Args:
      cluster: None to read the TF_CONFIG environment variable; a dict shaped
        like TF_CONFIG (`{"cluster": {"worker": [...], "ps": [...]},
        "task": {"type": ..., "index": ...}}`); a JSON string of such a dict;
        or a `tf.distribute.cluster_resolver.ClusterResolver`.

    Returns:
      The ClusterConfig.

    Raises:
      ValueError: the description is malformed; the message names what was
        received.
    """
    if cluster is None:
        raw = os.environ.get("TF_CONFIG")
        if not raw:
            raise ValueError("No cluster given and TF_CONFIG is not set. Pass "
                             "Strategy(cluster={...}) or set TF_CONFIG. Received: TF_CONFIG unset")
        return _from_dict(_parse_json(raw, "TF_CONFIG"), "TF_CONFIG")
    if isinstance(cluster, str):
        return _from_dict(_parse_json(cluster, "cluster"), "cluster")
    if isinstance(cluster, dict):
        return _from_dict(cluster, "cluster")
    if hasattr(cluster, "cluster_spec") and hasattr(cluster, "task_type"):
        return _from_resolver(cluster)
    raise ValueError("cluster must be None (read TF_CONFIG), a TF_CONFIG-shaped dict or "
                     f"JSON string, or a ClusterResolver. Received: cluster={cluster!r}")


def _parse_json(raw: str, source: str) -> dict:
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"{source} is not valid JSON ({e}). Received: {source}={raw!r}") from None
    return value


def _from_resolver(resolver) -> ClusterConfig:
    spec = resolver.cluster_spec().as_dict()
    task = {"type": resolver.task_type, "index": resolver.task_id}
    return _from_dict({"cluster": spec, "task": task}, "cluster_resolver")


def _from_dict(config: Any, source: str) -> ClusterConfig:
    if not isinstance(config, dict) or not isinstance(config.get("cluster"), dict):
        raise ValueError(f'{source} must be a dict with a "cluster" dict and a "task" dict. '
                         f"Received: {source}={config!r}")
    spec = config["cluster"]
    for name, addresses in spec.items():
        if isinstance(addresses, dict):  # TF allows {index: address} for sparse specs.
            addresses = [addresses[k] for k in sorted(addresses, key=int)]
        if not isinstance(addresses, (list, tuple)) or not all(
                isinstance(a, str) and a for a in addresses):
            raise ValueError(f'{source}["cluster"]["{name}"] must be a list of "host:port" '
                             f"strings. Received: {addresses!r}")
    workers = list(spec.get("chief", [])) + list(spec.get("worker", []))
    ps = list(spec.get("ps", []))
    if not workers:
        raise ValueError(f'{source}["cluster"] names no "worker" (or "chief") task. '
                         f"Received: cluster={spec!r}")
    if not ps:
        raise ValueError(f'{source}["cluster"] names no "ps" task; prophet_tf needs at least '
                         f"one parameter server. Received: cluster={spec!r}")
    for address in workers + ps:
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f'every task address must be "host:port". Received: {address!r} '
                             f"in {source}")

    task = config.get("task")
    if not isinstance(task, dict) or "type" not in task:
        raise ValueError(f'{source} has no "task" with a "type" and "index". '
                         f"Received: task={task!r}")
    task_type, index = task["type"], task.get("index", 0)
    if task_type not in spec or task_type not in TASK_TYPES:
        raise ValueError(f'{source}["task"]["type"] must be one of the cluster\'s task types '
                         f"{sorted(spec)}. Received: type={task_type!r}")
    if task_type == "evaluator":
        raise ValueError("prophet_tf has no evaluator task; evaluate on the workers. "
                         f"Received: type={task_type!r}")
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(spec[task_type]):
        raise ValueError(f'{source}["task"]["index"] must be an int in [0, '
                         f'{len(spec[task_type])}) for type "{task_type}". Received: index={index!r}')
    if task_type == "chief":
        task_type = "worker"
    elif task_type == "worker":
        index += len(spec.get("chief", []))
    return ClusterConfig(workers=tuple(workers), ps=tuple(ps), task_type=task_type,
                         task_index=index)


def free_port(host: str = "127.0.0.1") -> int:
    """A port of `host` that nothing listens on now (the OS picks it: bind to port 0).

    For addresses of tasks started on this machine (the launcher, the bench);
    another process may take it before the task binds it, which the task's
    bind then reports.
    """
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
