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


# -- Kubeflow TFJob ------------------------------------------------------------------------------
# TF_CONFIG values as the Kubeflow training-operator writes them (genTFConfigJSONStr in
# pkg/controller.v1/tensorflow/tensorflow.go, v1.9): json.Marshal of {cluster, task,
# environment}, the cluster keyed by the lower-cased replica type (map keys sorted), each
# task's address "<job>-<type>-<index>.<namespace>.svc:<port>" (the headless service of that
# replica; port 2222 unless the "tensorflow" container names a "tfjob-port").
# A TFJob "digits" in namespace "ml": Chief 1, Worker 2, PS 3, Evaluator 1.
_TFJOB_CLUSTER = (
    '{"chief":["digits-chief-0.ml.svc:2222"],"evaluator":["digits-evaluator-0.ml.svc:2222"],'
    '"ps":["digits-ps-0.ml.svc:2222","digits-ps-1.ml.svc:2222","digits-ps-2.ml.svc:2222"],'
    '"worker":["digits-worker-0.ml.svc:2222","digits-worker-1.ml.svc:2222"]}')
TFJOB = {(kind, i): '{"cluster":%s,"task":{"type":"%s","index":%d},"environment":"cloud"}'
         % (_TFJOB_CLUSTER, kind, i)
         for kind, n in (("chief", 1), ("worker", 2), ("ps", 3), ("evaluator", 1))
         for i in range(n)}
# tf-operator before v1.1 (until kubeflow/training-operator#1146, 2020) left the evaluator out
# of the cluster it gave every task, the evaluator's own included.
TFJOB_OLD_EVALUATOR = (
    '{"cluster":{"chief":["digits-chief-0.ml.svc:2222"],'
    '"ps":["digits-ps-0.ml.svc:2222","digits-ps-1.ml.svc:2222","digits-ps-2.ml.svc:2222"],'
    '"worker":["digits-worker-0.ml.svc:2222","digits-worker-1.ml.svc:2222"]},'
    '"task":{"type":"evaluator","index":0},"environment":"cloud"}')
# The operator's own expectation (pod_test.go, "Test ClusterSpec"): Worker 1, PS 1,
# Evaluator 1, CUSTOM_CLUSTER_DOMAIN=tf.training.io.
TFJOB_OPERATOR_TEST = (
    '{"cluster":{"evaluator":["test-tfjob-evaluator-0.ns3.svc.tf.training.io:2222"],'
    '"ps":["test-tfjob-ps-0.ns3.svc.tf.training.io:2222"],'
    '"worker":["test-tfjob-worker-0.ns3.svc.tf.training.io:2222"]},'
    '"task":{"type":"worker","index":0},"environment":"cloud"}')
# A TFJob with the older "Master" replica (kept by the operator as chief's synonym).
TFJOB_MASTER = (
    '{"cluster":{"master":["old-master-0.ml.svc:2222"],"ps":["old-ps-0.ml.svc:2222"],'
    '"worker":["old-worker-0.ml.svc:2222"]},"task":{"type":"%s","index":0},'
    '"environment":"cloud"}')


def test_tfjob_every_task_resolves(monkeypatch):
    workers = ("digits-chief-0.ml.svc:2222", "digits-worker-0.ml.svc:2222",
               "digits-worker-1.ml.svc:2222")
    ps = tuple(f"digits-ps-{i}.ml.svc:2222" for i in range(3))
    expected = {("chief", 0): ("worker", 0, workers[0]),
                ("worker", 0): ("worker", 1, workers[1]),
                ("worker", 1): ("worker", 2, workers[2]),
                ("ps", 0): ("ps", 0, ps[0]), ("ps", 1): ("ps", 1, ps[1]),
                ("ps", 2): ("ps", 2, ps[2]),
                ("evaluator", 0): ("evaluator", 0, "digits-evaluator-0.ml.svc:2222")}
    assert sorted(TFJOB) == sorted(expected)
    for task, tf_config in TFJOB.items():
        monkeypatch.setenv("TF_CONFIG", tf_config)
        cfg = cluster_lib.resolve()
        assert (cfg.task_type, cfg.task_index, cfg.address) == expected[task], task
        # The evaluator counts as no worker, for every task alike (the PS waits for 3).
        assert cfg.workers == workers and cfg.ps == ps, task
        assert cfg.evaluators == ("digits-evaluator-0.ml.svc:2222",), task
        assert cfg.is_worker == (task[0] in ("chief", "worker")), task
        assert cfg.is_evaluator == (task[0] == "evaluator"), task
        assert cluster_lib.resolve(cfg.to_tf_config()) == cfg


def test_tfjob_evaluator_outside_the_cluster():
    cfg = cluster_lib.resolve(TFJOB_OLD_EVALUATOR)
    assert (cfg.task_type, cfg.task_index, cfg.is_evaluator, cfg.is_worker) == (
        "evaluator", 0, True, False)
    assert cfg.num_workers == 3 and cfg.num_ps == 3 and cfg.evaluators == ()
    assert cfg.address is None
    assert cluster_lib.resolve(cfg.to_tf_config()) == cfg


def test_tfjob_operator_test_value_and_master():
    cfg = cluster_lib.resolve(TFJOB_OPERATOR_TEST)
    assert cfg.workers == ("test-tfjob-worker-0.ns3.svc.tf.training.io:2222",)
    assert (cfg.task_type, cfg.task_index, cfg.num_ps) == ("worker", 0, 1)
    master = cluster_lib.resolve(TFJOB_MASTER % "master")
    worker = cluster_lib.resolve(TFJOB_MASTER % "worker")
    assert master.workers == ("old-master-0.ml.svc:2222", "old-worker-0.ml.svc:2222")
    assert (master.task_type, master.task_index) == ("worker", 0)
    assert (worker.task_type, worker.task_index) == ("worker", 1)


def test_tfjob_ps_command_counts_no_evaluator(monkeypatch):
    """`prophet-tf ps` in the PS pod: 3 workers (chief + 2), its index, TF_CONFIG's port."""
    from prophet_tf.ps import server
    monkeypatch.setenv("TF_CONFIG", TFJOB["ps", 1])
    assert server._task_from_args(server._parse_args([])) == (3, 1, 3, "[::]", 2222)


def test_dense_index_map_is_a_list():
    cfg = cluster_lib.resolve({"cluster": {"worker": {"1": "h:2", "0": "h:1"}, "ps": {0: "h:3"}},
                               "task": {"type": "worker", "index": 1}})
    assert cfg.workers == ("h:1", "h:2") and cfg.ps == ("h:3",) and cfg.address == "h:2"


# With enableDynamicWorker the operator gives each task a sparse cluster (SparseClusterSpec:
# the worker itself only, or, for a PS, itself and no worker).
SPARSE_WORKER = ('{"cluster":{"worker":{"1":"dyn-worker-1.ml.svc:2222"},'
                 '"ps":["dyn-ps-0.ml.svc:2222"]},"task":{"type":"worker","index":1}}')
SPARSE_PS = '{"cluster":{"worker":{},"ps":["dyn-ps-0.ml.svc:2222"]},"task":{"type":"ps","index":0}}'


@pytest.mark.parametrize("bad, fragment", [
    (SPARSE_WORKER, "enableDynamicWorker"),
    (SPARSE_PS, "enableDynamicWorker"),
    (TFJOB["evaluator", 0].replace('"index":0', '"index":1'), "index=1"),
    (TFJOB_OLD_EVALUATOR.replace('"index":0', '"index":-1'), "index=-1"),
    ({"cluster": {"chief": ["h:1"], "master": ["h:2"], "ps": ["h:3"]},
      "task": {"type": "chief", "index": 0}}, '"chief" and "master"'),
    ({"cluster": {**SPEC, "evaluator": ["nowhere"]}, "task": {"type": "evaluator", "index": 0}},
     "'nowhere'"),
])
def test_tfjob_shapes_prophet_tf_cannot_use(bad, fragment):
    with pytest.raises(ValueError, match="Received") as info:
        cluster_lib.resolve(bad)
    assert fragment in str(info.value)


def test_local_ps_are_the_ps_tasks_on_the_workers_host():
    spec = {"worker": ["10.0.0.1:1001", "10.0.0.2:1001", "10.0.0.3:1001"],
            "ps": ["10.0.0.2:2001", "10.0.0.9:2001", "10.0.0.2:2002"]}
    local = [cluster_lib.local_ps(cluster_lib.resolve(
        {"cluster": spec, "task": {"type": "worker", "index": i}})) for i in range(3)]
    assert local == [[], [0, 2], []]
