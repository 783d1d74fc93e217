"""TF_CONFIG / dict / ClusterResolver resolution and its errors."""
import json

import pytest

from prophet_tf import cluster as cluster_lib

SPEC = {"worker": ["localhost:1001", "localhost:1002"], "ps": ["localhost:2001"]}


def test_dict_worker():
    cfg = cluster_lib.resolve({"cluster": SPEC, "task": {"type": "worker", "index": 1}})
    assert cfg.workers == ("localhost:1001", "localhost:1002")
    assert cfg.ps == ("localhost:2001",)
    assert (cfg.task_type, cfg.task_index, cfg.num_workers, cfg.num_ps) == ("worker", 1, 2, 1)
    assert cfg.address == "localhost:1002"


def test_tf_config_env_and_round_trip(monkeypatch):
    config = {"cluster": SPEC, "task": {"type": "ps", "index": 0}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))
    cfg = cluster_lib.resolve()
    assert cfg.task_type == "ps" and cfg.address == "localhost:2001"
    assert cluster_lib.resolve(cfg.to_tf_config()) == cfg


def test_chief_is_worker_zero():
    spec = {"chief": ["h:1"], "worker": ["h:2"], "ps": ["h:3"]}
    chief = cluster_lib.resolve({"cluster": spec, "task": {"type": "chief", "index": 0}})
    worker = cluster_lib.resolve({"cluster": spec, "task": {"type": "worker", "index": 0}})
    assert chief.workers == ("h:1", "h:2")
    assert (chief.task_type, chief.task_index) == ("worker", 0)
    assert (worker.task_type, worker.task_index) == ("worker", 1)


def test_cluster_resolver():
    import tensorflow as tf
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(SPEC), task_type="worker", task_id=0)
    cfg = cluster_lib.resolve(resolver)
    assert (cfg.task_type, cfg.task_index, cfg.num_ps) == ("worker", 0, 1)


@pytest.mark.parametrize("bad, fragment", [
    ("{not json", "not valid JSON"),
    ({"task": {"type": "worker", "index": 0}}, '"cluster" dict'),
    ({"cluster": {"ps": ["h:1"]}, "task": {"type": "ps", "index": 0}}, 'no "worker"'),
    ({"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": 0}}, 'no "ps"'),
    ({"cluster": SPEC}, 'no "task"'),
    ({"cluster": SPEC, "task": {"type": "worker", "index": 2}}, "index=2"),
    ({"cluster": SPEC, "task": {"type": "worker", "index": "0"}}, "index='0'"),
    ({"cluster": SPEC, "task": {"type": "master", "index": 0}}, "type='master'"),
    ({"cluster": {"worker": "h:1", "ps": ["h:2"]}, "task": {"type": "ps", "index": 0}}, "'h:1'"),
    ({"cluster": {"worker": ["h1"], "ps": ["h:2"]}, "task": {"type": "ps", "index": 0}}, "'h1'"),
    (42, "cluster=42"),
])
def test_malformed_raises_value_error_naming_input(bad, fragment):
    with pytest.raises(ValueError, match="Received") as info:
        cluster_lib.resolve(bad)
    assert fragment in str(info.value)


def test_unset_tf_config(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ValueError, match="TF_CONFIG"):
        cluster_lib.resolve()
