"""A malformed cluster configuration fails at once, naming what was received.

Both entry points that read TF_CONFIG are checked: a worker's
``prophet_tf.Strategy()`` and ``prophet-tf ps``. Neither may connect to or
wait for anything first.
"""
import json
import os
import pathlib
import subprocess
import sys

import pytest

import prophet_tf
import prophet_tf.engine
import prophet_tf.strategy  # noqa: F401

ROOT = pathlib.Path(__file__).resolve().parents[2]

MALFORMED = [
    pytest.param("{not json", "not valid JSON", id="unparsable"),
    pytest.param(json.dumps({"cluster": {"worker": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"]}}),
                 'no "task"', id="missing-task"),
    pytest.param(json.dumps({"cluster": {"worker": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"]},
                             "task": {"type": "worker", "index": 3}}), "index=3",
                 id="index-out-of-range"),
    pytest.param(json.dumps({"cluster": {"worker": ["127.0.0.1:1"]},
                             "task": {"type": "worker", "index": 0}}), 'no "ps"', id="no-ps"),
    pytest.param(json.dumps({"cluster": [["127.0.0.1:1"]],
                             "task": {"type": "worker", "index": 0}}), '"cluster" dict',
                 id="cluster-not-a-dict"),
    pytest.param(json.dumps({"cluster": {"worker": "127.0.0.1:1", "ps": ["127.0.0.1:2"]},
                             "task": {"type": "worker", "index": 0}}), "'127.0.0.1:1'",
                 id="worker-not-a-list"),
]


@pytest.fixture
def no_engine(monkeypatch):
    """Fails a Strategy that gets as far as starting its engine (which dials
    and waits for the PS tasks): a config it refuses must stop it before."""
    def dial(*args, **kwargs):
        raise AssertionError("the engine was started: it would wait on a PS")
    monkeypatch.setattr(prophet_tf.engine, "Engine", dial)


@pytest.mark.parametrize("tf_config, fragment", MALFORMED)
def test_strategy_rejects_malformed_tf_config_at_once(monkeypatch, no_engine, tf_config,
                                                       fragment):
    monkeypatch.setenv("TF_CONFIG", tf_config)
    with pytest.raises(ValueError, match="Received") as info:
        prophet_tf.Strategy()
    assert fragment in str(info.value)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tf_config, fragment", MALFORMED[:3])
def test_ps_command_rejects_malformed_tf_config_with_exit_2(tf_config, fragment):
    env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CONFIG=tf_config)
    result = subprocess.run([sys.executable, "-m", "prophet_tf", "ps"], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=100)
    assert result.returncode == 2, result.stderr
    assert fragment in result.stderr and "Received" in result.stderr


def test_strategy_refuses_an_evaluator_and_says_what_it_does_instead(monkeypatch, no_engine):
    """A TFJob's Evaluator task resolves (it is no malformed config), but trains nothing."""
    monkeypatch.setenv("TF_CONFIG", json.dumps({
        "cluster": {"chief": ["job-chief-0.ns.svc:2222"], "worker": ["job-worker-0.ns.svc:2222"],
                    "ps": ["job-ps-0.ns.svc:2222"], "evaluator": ["job-evaluator-0.ns.svc:2222"]},
        "task": {"type": "evaluator", "index": 0}, "environment": "cloud"}))
    with pytest.raises(ValueError, match="Received: task type='evaluator'") as info:
        prophet_tf.Strategy()
    assert "prophet_tf.evaluate_checkpoints" in str(info.value)
    assert "does not join training" in str(info.value)
