"""`prophet-tf doctor` against real PS tasks, a closed port and broken configurations."""
import json

import pytest

from cluster import child_env, free_port, run_prophet, run_ps
from prophet_tf.tools import doctor as doctor_lib
from prophet_tf.ps import security
from tls_certs import make_cert

SECURITY_ENV = (security.TOKEN_ENV, security.TOKEN_FILE_ENV, security.TLS_CA_ENV,
                security.TLS_SERVER_NAME_ENV, security.TLS_CERT_ENV, security.TLS_KEY_ENV)
DEVICE_ENV = "PROPHET_TF_DEVICE"


def doctor(tf_config=None, *args, env_extra=None):
    env = child_env(drop=("TF_CONFIG", DEVICE_ENV, *SECURITY_ENV), **(env_extra or {}))
    if tf_config is not None:
        env["TF_CONFIG"] = tf_config if isinstance(tf_config, str) else json.dumps(tf_config)
    proc = run_prophet("doctor", *args, env=env, timeout=120)
    lines = [line for line in proc.stdout.splitlines() if line[:4] in ("OK  ", "WARN", "FAIL")]
    return proc.returncode, lines, proc.stdout + proc.stderr


def line(lines, name):
    found = [entry for entry in lines if entry[5:].startswith(name)]
    assert len(found) == 1, lines
    return found[0]


@pytest.mark.timeout(150)
def test_all_ok_without_tf_config():
    code, lines, out = doctor()
    assert code == 0, out
    for name in ("TensorFlow", "Keras", "grpcio", "protobuf", "op library", "compute device",
                 "TF_CONFIG", "token", "TLS"):
        assert line(lines, name).startswith("OK"), out
    assert line(lines, "token") == ("OK   token: not set (fine on loopback: `prophet-tf launch` "
                                    "generates one for its tasks; a multi-host job sets "
                                    "PROPHET_TF_TOKEN or PROPHET_TF_TOKEN_FILE on every task)")
    assert line(lines, "TLS") == "OK   TLS: off (plaintext gRPC; fine on loopback)"
    assert "_prophet_ops.so" in line(lines, "op library")


@pytest.mark.timeout(150)
def test_compute_device_is_the_strategys_default_and_tensorflow_ran_a_matmul_there():
    from prophet_tf import devices  # imports TensorFlow: this process sees the same devices
    expected = devices.default_device()
    code, lines, out = doctor()
    assert code == 0, out
    device = line(lines, "compute device")
    assert device.startswith(f"OK   compute device: {expected} ("), device
    assert "a MatMul placed there ran there" in device, device
    assert f"on its host, {devices.host_of(expected)}" in device, device
    if "GPU" not in expected:
        assert "(no GPU visible" in device, device


@pytest.mark.timeout(300)
def test_compute_device_from_prophet_tf_device_and_its_errors():
    code, lines, out = doctor(env_extra={DEVICE_ENV: "/device:CPU:0"})
    assert code == 0, out
    assert line(lines, "compute device").startswith(
        "OK   compute device: /job:localhost/replica:0/task:0/device:CPU:0 "
        "(from PROPHET_TF_DEVICE='/device:CPU:0'"), out
    for value, fragment in (("/cpu:63", "does not exist"),
                            ("cpu:zero", "not a TensorFlow device string")):
        code, lines, out = doctor(env_extra={DEVICE_ENV: value})
        assert code == 1, out
        failure = line(lines, "compute device")
        assert failure.startswith("FAIL") and fragment in failure, failure
        assert failure.endswith(f"Received: PROPHET_TF_DEVICE={value!r}"), failure
    assert "1 problem(s) found" in out


@pytest.mark.timeout(200)
def test_reports_each_ps_task_healthy_or_unreachable(tmp_path):
    dead = f"127.0.0.1:{free_port()}"  # Nothing listens there.
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


TOKEN = "doctor-token_Zq81bN3kLw"


@pytest.mark.timeout(300)
def test_token_and_tls_lines_and_a_guarded_tls_ps(tmp_path):
    cert, key = make_cert(tmp_path, "ps.test", "DNS:ps.test")
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    with run_ps(tmp_path, "--num-workers", "1", "--tls-cert", str(cert), "--tls-key", str(key),
                "--token-file", str(token_file)) as ps:
        config = {"cluster": {"worker": ["127.0.0.1:1"], "ps": [ps.address]},
                  "task": {"type": "worker", "index": 0}}
        everything = {security.TOKEN_FILE_ENV: str(token_file), security.TLS_CA_ENV: str(cert),
                      security.TLS_SERVER_NAME_ENV: "ps.test"}
        code, lines, out = doctor(config, "--timeout", "20", env_extra=everything)
        assert code == 0, out
        assert line(lines, "token") == f"OK   token: set from PROPHET_TF_TOKEN_FILE ({token_file})"
        assert line(lines, "TLS") == (f"OK   TLS: clients verify the PS with PROPHET_TF_TLS_CA="
                                      f"{cert} (1 certificate(s)), server name ps.test")
        assert line(lines, f"PS 0 at {ps.address}") == f"OK   PS 0 at {ps.address}: SERVING"
        assert TOKEN not in out

        # Without the token: the PS turns the health check away.
        without_token = dict(everything)
        del without_token[security.TOKEN_FILE_ENV]
        code, lines, out = doctor(config, "--timeout", "20", env_extra=without_token)
        assert code == 1, out
        refused = line(lines, f"PS 0 at {ps.address}")
        assert refused.startswith("FAIL") and "UNAUTHENTICATED" in refused
        assert "missing token" in refused and "PROPHET_TF_TOKEN" in refused

        # Without the CA: plaintext against TLS, and what to set.
        code, lines, out = doctor(config, "--timeout", "2",
                                  env_extra={security.TOKEN_ENV: TOKEN})
        assert code == 1, out
        unreachable = line(lines, f"PS 0 at {ps.address}")
        assert unreachable.startswith("FAIL") and "PROPHET_TF_TLS_CA" in unreachable
        assert TOKEN not in out


@pytest.fixture
def clean_env(monkeypatch):
    for name in SECURITY_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


EXPOSED = ["10.0.0.5:2222", "127.0.0.1:2223"]   # only named, never dialed


@pytest.mark.timeout(30)
def test_token_line_warns_for_non_loopback_ps_without_token(clean_env):
    check = doctor_lib.check_token(EXPOSED)
    assert check.ok and check.warn
    assert check.line().startswith("WARN token: not set") and "10.0.0.5:2222" in check.line()
    assert "127.0.0.1:2223" not in check.line()
    assert "PROPHET_TF_TOKEN" in check.line() and "--insecure" in check.line()
    assert not doctor_lib.check_token(["127.0.0.1:2222", "localhost:1"]).warn
    clean_env.setenv(security.TOKEN_ENV, TOKEN)
    check = doctor_lib.check_token(EXPOSED)
    assert check.line() == "OK   token: set from PROPHET_TF_TOKEN"


@pytest.mark.timeout(30)
def test_token_line_fails_on_a_bad_setting_and_warns_on_a_shared_file(clean_env, tmp_path):
    clean_env.setenv(security.TOKEN_ENV, "")
    check = doctor_lib.check_token([])
    assert not check.ok and "PROPHET_TF_TOKEN" in check.line() and "empty" in check.line()
    clean_env.delenv(security.TOKEN_ENV)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o644)
    clean_env.setenv(security.TOKEN_FILE_ENV, str(token_file))
    check = doctor_lib.check_token([])
    assert check.warn and f"chmod 600 {token_file}" in check.line()
    assert TOKEN not in check.line()
    clean_env.setenv(security.TOKEN_FILE_ENV, str(tmp_path / "missing"))
    check = doctor_lib.check_token([])
    assert not check.ok and str(tmp_path / "missing") in check.line()


@pytest.mark.timeout(60)
def test_tls_line(clean_env, tmp_path):
    check = doctor_lib.check_tls(EXPOSED)
    assert check.warn and "plaintext" in check.line() and "--tls-cert" in check.line()
    cert, key = make_cert(tmp_path)
    _, other_key = make_cert(tmp_path, "other", "DNS:other")
    clean_env.setenv(security.TLS_CERT_ENV, str(cert))
    clean_env.setenv(security.TLS_KEY_ENV, str(key))
    check = doctor_lib.check_tls(EXPOSED)
    assert check.ok and not check.warn and "they load and match" in check.line()
    clean_env.setenv(security.TLS_KEY_ENV, str(other_key))
    check = doctor_lib.check_tls(EXPOSED)
    assert not check.ok and "do not load" in check.line() and str(other_key) in check.line()
    clean_env.delenv(security.TLS_CERT_ENV)
    clean_env.delenv(security.TLS_KEY_ENV)
    clean_env.setenv(security.TLS_CA_ENV, str(tmp_path / "no-ca.pem"))
    check = doctor_lib.check_tls([])
    assert not check.ok and str(tmp_path / "no-ca.pem") in check.line()
    assert "PROPHET_TF_TLS_CA" in check.line()
