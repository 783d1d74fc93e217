"""`prophet-tf doctor` against real PS tasks, a closed port and broken configurations."""
import json
import os
import socket
import subprocess
import sys

import pytest

from conftest import ROOT, run_ps


def doctor(tf_config=None, *args):
    env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    if tf_config is not None:
        env["TF_CONFIG"] = tf_config if isinstance(tf_config, str) else json.dumps(tf_config)
    proc = subprocess.run([sys.executable, "-m", "prophet_tf", "doctor", *args], env=env,
                          capture_output=True, text=True, timeout=120)
    lines = [line for line in proc.stdout.splitlines() if line[:4] in ("OK  ", "FAIL")]
    return proc.returncode, lines, proc.stdout + proc.stderr


def line(lines, name):
    found = [entry for entry in lines if entry[5:].startswith(name)]
    assert len(found) == 1, lines
    return found[0]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # Closed again when this returns: nothing listens.


@pytest.mark.timeout(150)
def test_all_ok_without_tf_config():
    code, lines, out = doctor()
    assert code == 0, out
    for name in ("TensorFlow", "Keras", "grpcio", "protobuf", "op library", "TF_CONFIG"):
        assert line(lines, name).startswith("OK"), out
    assert "_prophet_ops.so" in line(lines, "op library")


@pytest.mark.timeout(200)
def test_reports_each_ps_task_healthy_or_unreachable(tmp_path):
    dead = f"127.0.0.1:{closed_port()}"
    with run_ps(tmp_path, "--num-workers", "1", "--num-ps", "2") as ps:
        config = {"cluster": {"worker": ["127.0.0.1:1"], "ps": [ps.address, dead]},
                  "task": {"type": "worker", "index": 0}}
        code, lines, out = doctor(config, "--timeout", "2")
    assert code == 1, out
    assert line(lines, f"PS 0 at {ps.address}") == f"OK   PS 0 at {ps.address}: SERVING"
    unreachable = line(lines, f"PS 1 at {dead}")
    assert unreachable.startswith("FAIL") and "prophet-tf ps" in unreachable
    assert "1 problem(s) found" in out


@pytest.mark.timeout(150)
@pytest.mark.parametrize("tf_config, fragment", [
    ("{not json", "not valid JSON"),
    ({"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": 0}}, 'no "ps"'),
])
def test_malformed_tf_config_is_a_failure_naming_it(tf_config, fragment):
    code, lines, out = doctor(tf_config)
    assert code == 1, out
    failure = line(lines, "TF_CONFIG")
    assert failure.startswith("FAIL") and fragment in failure and "Received" in failure


@pytest.mark.timeout(60)
def test_bad_timeout_is_rejected():
    code, _, out = doctor(None, "--timeout", "0")
    assert code == 2 and "--timeout" in out
