"""Who is in the cluster and who am I: TF_CONFIG, a dict, or a ClusterResolver.

The task types are TensorFlow's, as a Kubeflow TFJob writes them: `chief`
(`master` in TFJobs of old) is worker 0, `worker` i is worker i+1 when there
is a chief, `ps` are the parameter servers, and `evaluator` is a task outside
training (the cluster may list it or not; it never counts as a worker). Keys
TF_CONFIG may carry besides `cluster` and `task` (a TFJob's
`"environment": "cloud"`) are ignored.

Every malformed configuration raises ValueError naming what was received,
before anything waits on the network.
"""
from __future__ import annotations

import dataclasses
import json
import os
import socket
from typing import Any

TASK_TYPES = ("worker", "ps", "chief", "master", "evaluator")
# Names of worker 0 when it has a job of its own; `master` is the TFJob's older name.
CHIEF_TYPES = ("chief", "master")


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """The resolved cluster: worker and PS addresses plus this process' task.

    A `chief` task, when the config has one, is treated as worker 0 (TF's
    convention), so `workers` lists chief first. An `evaluator` task keeps its
    type: it trains nothing (`prophet_tf.evaluate_checkpoints` is its job).
    """

    workers: tuple[str, ...]
    ps: tuple[str, ...]
    task_type: str
    task_index: int
    # The cluster's evaluator tasks, when it lists them (TFJobs since 2020 do).
    evaluators: tuple[str, ...] = ()

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
    def is_evaluator(self) -> bool:
        return self.task_type == "evaluator"

    @property
    def address(self) -> str | None:
        """This task's own host:port; None for an evaluator the cluster does not list."""
        tasks = {"worker": self.workers, "ps": self.ps,
                 "evaluator": self.evaluators}[self.task_type]
        return tasks[self.task_index] if self.task_index < len(tasks) else None

    def to_tf_config(self) -> dict:
        """The TF_CONFIG dict that describes this cluster and task."""
        cluster = {"worker": list(self.workers), "ps": list(self.ps)}
        if self.evaluators:
            cluster["evaluator"] = list(self.evaluators)
        return {"cluster": cluster, "task": {"type": self.task_type, "index": self.task_index}}


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


def _task_list(name: str, addresses: Any, source: str) -> list[str]:
    """One job's addresses as a list; TF's {index: address} form only when it lists them all."""
    if isinstance(addresses, dict):
        # A sparse spec names only some tasks (a TFJob with enableDynamicWorker gives each
        # worker itself alone): the number of workers, which every step waits for, is unknown.
        indices = [int(k) if isinstance(k, (int, str)) and str(k).isdigit() else None
                   for k in addresses]
        if not addresses or sorted(indices, key=lambda i: -1 if i is None else i) != list(
                range(len(addresses))):
            raise ValueError(
                f'{source}["cluster"]["{name}"] is an {{index: address}} map that does not list '
                "tasks 0..n-1 (a sparse cluster, what a TFJob with enableDynamicWorker: true "
                "writes); prophet_tf needs every worker and PS task listed, to know how many "
                f"there are. Received: {addresses!r}")
        by_index = dict(zip(indices, addresses.values()))
        addresses = [by_index[i] for i in range(len(addresses))]
    if not isinstance(addresses, (list, tuple)) or not all(
            isinstance(a, str) and a for a in addresses):
        raise ValueError(f'{source}["cluster"]["{name}"] must be a list of "host:port" '
                         f"strings. Received: {addresses!r}")
    return list(addresses)


def _from_dict(config: Any, source: str) -> ClusterConfig:
    if not isinstance(config, dict) or not isinstance(config.get("cluster"), dict):
        raise ValueError(f'{source} must be a dict with a "cluster" dict and a "task" dict. '
                         f"Received: {source}={config!r}")
    spec = {name: _task_list(name, addresses, source)
            for name, addresses in config["cluster"].items()}
    chiefs = [name for name in CHIEF_TYPES if name in spec]
    if len(chiefs) > 1:
        raise ValueError(f'{source}["cluster"] names both "chief" and "master": one task is '
                         f"worker 0. Received: cluster={config['cluster']!r}")
    chief = spec.get(chiefs[0], []) if chiefs else []
    workers = chief + spec.get("worker", [])
    ps = spec.get("ps", [])
    evaluators = spec.get("evaluator", [])
    if not workers:
        raise ValueError(f'{source}["cluster"] names no "worker" (or "chief") task. '
                         f"Received: cluster={config['cluster']!r}")
    if not ps:
        raise ValueError(f'{source}["cluster"] names no "ps" task; prophet_tf needs at least '
                         f"one parameter server. Received: cluster={config['cluster']!r}")
    for address in workers + ps + evaluators:
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f'every task address must be "host:port". Received: {address!r} '
                             f"in {source}")

    task = config.get("task")
    if not isinstance(task, dict) or "type" not in task:
        raise ValueError(f'{source} has no "task" with a "type" and "index". '
                         f"Received: task={task!r}")
    task_type, index = task["type"], task.get("index", 0)
    # An evaluator is outside the training cluster: TFJobs before 2020 did not list it.
    listed = task_type == "evaluator" or task_type in spec
    if not listed or task_type not in TASK_TYPES:
        raise ValueError(f'{source}["task"]["type"] must be one of the cluster\'s task types '
                         f"{sorted(spec)} or \"evaluator\". Received: type={task_type!r}")
    count = len(spec[task_type]) if task_type in spec else None
    if not isinstance(index, int) or isinstance(index, bool) or index < 0 or (
            count is not None and index >= count):
        bound = f"[0, {count})" if count is not None else ">= 0"
        raise ValueError(f'{source}["task"]["index"] must be an int in {bound} for type '
                         f'"{task_type}". Received: index={index!r}')
    if task_type in CHIEF_TYPES:
        task_type = "worker"
    elif task_type == "worker":
        index += len(chief)
    return ClusterConfig(workers=tuple(workers), ps=tuple(ps), task_type=task_type,
                         task_index=index, evaluators=tuple(evaluators))


def address_host(address: str) -> str:
    """The host of a task's "host:port" address."""
    return address.rpartition(":")[0]


def local_ps(config: "ClusterConfig") -> list[int]:
    """The PS tasks on this worker's host (by address), in task order."""
    host = address_host(config.workers[config.task_index])
    return [i for i, a in enumerate(config.ps) if address_host(a) == host]


def free_port(host: str = "127.0.0.1") -> int:
    """A port of `host` that nothing listens on now (the OS picks it: bind to port 0).

    For addresses of tasks started on this machine (the launcher, the bench);
    another process may take it before the task binds it, which the task's
    bind then reports.
    """
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
