"""Token and TLS on real PS processes, `prophet-tf ps`'s refusal, and the launcher's token.

(Named apart from tests/unit/test_security.py: the suite imports test files by
basename, so two files of the same name would collide.)
"""
import json
import subprocess
import sys
import textwrap

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import cluster
from conftest import ROOT, run_ps
import ps_helpers
from prophet_tf.ps import client as ps_client
from prophet_tf.ps import health, security, sharding
from tls_certs import make_cert
from prophet_tf.ps.protocol import SERVICE_NAME
from prophet_tf.ps.v1 import ps_pb2

TOKEN = "integration-token_5Jx9qQ2vR7"
WRONG = "integration-token_5Jx9qQ2vR8"
LIMIT = 32
SHAPES = {0: ("dense/kernel", (6, 4)), 1: ("dense/bias", (4,))}
SPECS = [ps_pb2.VariableSpec(key=k, name=n, shape=s, dtype="float32", priority=k)
         for k, (n, s) in SHAPES.items()]
# Another model: a worker that got it registered first would make SPECS fail.
OTHER_SPECS = [ps_pb2.VariableSpec(key=0, name="dense/kernel", shape=[6, 5], dtype="float32",
                                   priority=0), SPECS[1]]
PARTITIONS = sharding.plan(SPECS, 1, LIMIT, spread=True)
BY_ID = {(p.key, p.partition): p for p in PARTITIONS}
SGD1 = json.dumps({"module": "keras.optimizers", "class_name": "SGD",
                   "config": {"name": "SGD", "learning_rate": 1.0}, "registered_name": None})
GOOD = security.ClientSecurity(security.Token(TOKEN, "test"))
NONE = security.ClientSecurity()
BAD = security.ClientSecurity(security.Token(WRONG, "test"))


def _env(**extra):
    return cluster.child_env(drop=("TF_CONFIG", "PROPHET_TF_SCHEDULER", security.TOKEN_ENV,
                                   security.TOKEN_FILE_ENV, security.TLS_CA_ENV,
                                   security.TLS_SERVER_NAME_ENV, security.TLS_CERT_ENV,
                                   security.TLS_KEY_ENV), **cluster.ONE_TF_THREAD, **extra)



def grads(seed):
    """Integer-valued float32 gradients: SGD(lr=1) updates are exact."""
    rng = np.random.default_rng(seed)
    return {k: rng.integers(-50, 50, size=s).astype(np.float32) for k, (_, s) in SHAPES.items()}


def pull_all(client, min_version):
    out = {k: np.zeros(s, np.float32) for k, (_, s) in SHAPES.items()}
    versions = set()
    for chunk in client.pull(PARTITIONS, min_version, timeout=30):
        ps_helpers.write_chunk(chunk, out, BY_ID)
        versions.add(chunk.version)
    return out, versions


@pytest.fixture(scope="module")
def guarded_ps(tmp_path_factory):
    """A W=1 PS bound to 0.0.0.0 (allowed: it has a token) that requires TOKEN."""
    directory = tmp_path_factory.mktemp("guarded")
    token_file = directory / "token"
    token_file.write_text(TOKEN + "\n")
    with run_ps(directory, "--num-workers", "1", "--max-partition-bytes", str(LIMIT),
                "--host", "0.0.0.0", "--token-file", str(token_file)) as ps:
        yield ps


@pytest.mark.timeout(180)
def test_health_needs_the_token(guarded_ps):
    assert "token from --token-file" in guarded_ps.log()
    for service in ("", SERVICE_NAME):
        request = health_pb2.HealthCheckRequest(service=service)
        with security.create_channel(guarded_ps.address, security=GOOD) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=30)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        for sec, fragment in ((NONE, "missing token"), (BAD, "wrong token")):
            with security.create_channel(guarded_ps.address, security=sec) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                for call in (lambda: stub.Check(request, timeout=30),
                             lambda: stub.Watch(request, timeout=30)):
                    error = ps_helpers.rpc_error(call)
                    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
                    assert fragment in error.details()
                    assert TOKEN not in error.details() and WRONG not in error.details()
    with ps_client.PSClient(guarded_ps.address, 0, 1, security=GOOD) as client:
        client.wait_ready(30)
    with ps_client.PSClient(guarded_ps.address, 0, 1, security=NONE) as client:
        with pytest.raises(health.HealthCheckRefused, match="UNAUTHENTICATED: missing token"):
            client.wait_ready(30)


@pytest.mark.timeout(180)
def test_token_guards_register_push_pull_and_changes_nothing(guarded_ps):
    good = ps_client.PSClient(guarded_ps.address, 0, 1, security=GOOD)
    outsiders = [(ps_client.PSClient(guarded_ps.address, 0, 1, security=NONE), "missing token"),
                 (ps_client.PSClient(guarded_ps.address, 0, 1, security=BAD), "wrong token")]
    try:
        good.wait_ready(60)
        # Outsiders try to declare another model first, with initial values.
        other_initial = {0: np.ones((6, 5), np.float32), 1: np.ones(4, np.float32)}
        for client, fragment in outsiders:
            error = ps_helpers.rpc_error(lambda: client.register(OTHER_SPECS, SGD1, other_initial,
                                                      max_partition_bytes=LIMIT, timeout=30))
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED
            assert fragment in error.details()
        # The right token still declares the first model: the outsiders' did not count.
        initial = {k: np.arange(np.prod(s), dtype=np.float32).reshape(s)
                   for k, (_, s) in SHAPES.items()}
        response = good.register(SPECS, SGD1, initial, max_partition_bytes=LIMIT, timeout=60)
        assert len(response.partitions) == len(PARTITIONS)
        values, versions = pull_all(good, 0)
        assert versions == {0}
        for k in SHAPES:
            np.testing.assert_array_equal(values[k], initial[k])

        # Pushes without the right token (step 0, as a real worker would) are refused...
        for client, fragment in outsiders:
            bad_push = ps_helpers.gradient_chunks(grads(666), PARTITIONS, 0)
            error = ps_helpers.rpc_error(lambda: client.push_future(bad_push, timeout=30).result())
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED
            assert fragment in error.details()
            error = ps_helpers.rpc_error(lambda: client.pull(PARTITIONS, 0, timeout=30))
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED
            assert fragment in error.details()
        # ...and changed nothing: the right push of step 0 is the first one counted,
        # and version 1 is initial - its gradient alone (W=1, SGD with lr=1).
        chunks = ps_helpers.gradient_chunks(grads(1), PARTITIONS, 0)
        assert ps_helpers.push(good, chunks, timeout=30) == 0
        values, versions = pull_all(good, 1)
        assert versions == {1}
        for k in SHAPES:
            np.testing.assert_array_equal(values[k], initial[k] - grads(1)[k])
    finally:
        good.close()
        for client, _ in outsiders:
            client.close()
    log = guarded_ps.log()
    assert "WARNING prophet_tf.ps.security: rejected /" in log   # throttled: one per 10 s
    assert TOKEN not in log and WRONG not in log


@pytest.mark.timeout(240)
def test_tls_with_a_self_signed_certificate(tmp_path, start_ps, monkeypatch):
    # Issued to a name, not to the address clients dial: they name it explicitly.
    cert, key = make_cert(tmp_path, "ps.test", "DNS:ps.test")
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    ps = start_ps("--num-workers", "1", "--max-partition-bytes", str(LIMIT),
                  "--tls-cert", str(cert), "--tls-key", str(key), "--token-file", str(token_file))
    assert "TLS" in ps.log()
    ca = security.load_client_tls({security.TLS_CA_ENV: str(cert),
                                   security.TLS_SERVER_NAME_ENV: "ps.test"})
    trusted = security.ClientSecurity(GOOD.token, ca)

    # The CA and the name from the environment, as a worker gets them.
    monkeypatch.setenv(security.TLS_CA_ENV, str(cert))
    monkeypatch.setenv(security.TLS_SERVER_NAME_ENV, "ps.test")
    monkeypatch.setenv(security.TOKEN_FILE_ENV, str(token_file))
    monkeypatch.delenv(security.TOKEN_ENV, raising=False)
    with ps_client.PSClient(ps.address, 0, 1) as client:
        client.wait_ready(60)
        response = client.register(SPECS, SGD1, max_partition_bytes=LIMIT, timeout=60)
        assert len(response.partitions) == len(PARTITIONS)

    # Plaintext against the TLS port: never SERVING, calls fail UNAVAILABLE.
    plain = security.ClientSecurity(GOOD.token, None)
    with pytest.raises(health.NotServingError) as info:
        health.wait_serving(ps.address, 2, security=plain)
    assert ps.address in str(info.value)
    with ps_client.PSClient(ps.address, 0, 1, security=plain) as client:
        error = ps_helpers.rpc_error(lambda: client.register(SPECS, SGD1, max_partition_bytes=LIMIT,
                                                  timeout=5))
        assert error.code() == grpc.StatusCode.UNAVAILABLE
    # Without the server name the certificate does not match 127.0.0.1.
    unnamed = security.ClientSecurity(GOOD.token, security.ClientTLS(ca.ca_path, ca.ca, None))
    with pytest.raises(health.NotServingError):
        health.wait_serving(ps.address, 2, security=unnamed)
    # Another CA is not trusted.
    other_cert, _ = make_cert(tmp_path, "other.test", "DNS:ps.test")
    untrusted = security.ClientSecurity(GOOD.token, security.ClientTLS(
        str(other_cert), other_cert.read_bytes(), "ps.test"))
    with pytest.raises(health.NotServingError):
        health.wait_serving(ps.address, 2, security=untrusted)
    # TLS does not replace the token.
    with pytest.raises(health.HealthCheckRefused, match="missing token"):
        health.wait_serving(ps.address, 10, security=security.ClientSecurity(None, ca))
    health.wait_serving(ps.address, 10, security=trusted)


def _ps_argv(*args):
    return [sys.executable, "-m", "prophet_tf", "ps", *args]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, tf_config, fragments", [
    (["--num-workers", "1", "--host", "0.0.0.0", "--port", "0"], None,
     ["refusing to serve on 0.0.0.0 without a token", "--insecure", "PROPHET_TF_TOKEN",
      "--token-file", "Received: host=0.0.0.0"]),
    (["--num-workers", "1", "--host", "::", "--port", "0"], None, ["refusing to serve on ::"]),
    ([], {"cluster": {"worker": ["127.0.0.1:1"], "ps": ["127.0.0.1:1"]},
          "task": {"type": "ps", "index": 0}},
     ["refusing to serve on [::]", "the default with TF_CONFIG", "--insecure"]),
])
def test_ps_refuses_a_public_bind_without_token(tmp_path, args, tf_config, fragments):
    env = _env(**({"TF_CONFIG": json.dumps(tf_config)} if tf_config else {}))
    port_file = tmp_path / "port"
    result = subprocess.run(_ps_argv(*args, "--port-file", str(port_file)), env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=50)
    assert result.returncode == 2, result.stdout + result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert not port_file.exists()


@pytest.mark.timeout(180)
def test_insecure_flag_allows_a_public_bind_with_a_warning(start_ps):
    ps = start_ps("--num-workers", "1", "--host", "0.0.0.0", "--insecure")
    assert "without a token (--insecure)" in ps.log()
    health.wait_serving(ps.address, 30, security=NONE)   # open to anyone


@pytest.mark.timeout(60)
def test_bad_security_settings_stop_the_ps_naming_them(tmp_path):
    cert, key = make_cert(tmp_path)
    _, other_key = make_cert(tmp_path, "other", "DNS:other")
    empty = tmp_path / "empty-token"
    empty.write_text("\n")
    missing = tmp_path / "missing.pem"
    cases = [
        (["--token-file", str(missing)], {}, [str(missing), "--token-file"]),
        (["--token-file", str(empty)], {}, [str(empty), "empty"]),
        ([], {security.TOKEN_ENV: ""}, ["PROPHET_TF_TOKEN", "empty"]),
        ([], {security.TOKEN_FILE_ENV: str(missing)}, ["PROPHET_TF_TOKEN_FILE", str(missing)]),
        (["--tls-cert", str(cert)], {}, ["both a certificate and its private key"]),
        (["--tls-cert", str(missing), "--tls-key", str(key)], {}, [str(missing), "--tls-cert"]),
        (["--tls-cert", str(cert), "--tls-key", str(other_key)], {},
         ["do not load", str(other_key)]),
        ([], {security.TLS_CERT_ENV: str(cert), security.TLS_KEY_ENV: str(missing)},
         ["PROPHET_TF_TLS_KEY", str(missing)]),
    ]
    for args, extra_env, fragments in cases:
        port_file = tmp_path / "port"
        result = subprocess.run(
            _ps_argv("--num-workers", "1", "--port", "0", "--port-file", str(port_file), *args),
            env=_env(**extra_env), cwd=ROOT, capture_output=True, text=True, timeout=30)
        assert result.returncode == 2, (args, result.stderr)
        for fragment in fragments:
            assert fragment in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr
        assert not port_file.exists()


# -- the launcher -----------------------------------------------------------------------------

WORKER = textwrap.dedent(r'''
    import hashlib, json, os, sys
    import grpc
    import numpy as np
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from prophet_tf.ps import client as ps_client, sharding
    from prophet_tf.ps.v1 import ps_pb2

    config = json.loads(os.environ["TF_CONFIG"])
    address = config["cluster"]["ps"][0]
    token = os.environ.get("PROPHET_TF_TOKEN")
    if token:
        open(sys.argv[1], "w").write(token)   # for the test to look for in the output
    specs = [ps_pb2.VariableSpec(key=0, name="w", shape=[3], dtype="float32", priority=0)]
    sgd = json.dumps({"module": "keras.optimizers", "class_name": "SGD",
                      "config": {"name": "SGD", "learning_rate": 1.0}, "registered_name": None})
    with ps_client.PSClient(address, 0, 1) as client:   # token from the environment
        client.wait_ready(60)
        client.register(specs, sgd, {0: np.zeros(3, np.float32)}, timeout=60)
        parts = sharding.plan(specs, 1, sharding.DEFAULT_MAX_PARTITION_BYTES, spread=True)
        client.push_future([ps_client.Chunk(0, 0, 0, np.full(3, 2.0, np.float32))],
                           timeout=30).result()
        pulled = [c.array.tolist() for c in client.pull(parts, 1, timeout=30)]
    # A process without the token is turned away.
    with grpc.insecure_channel(address) as channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            outsider = "SERVING"
        except grpc.RpcError as e:
            outsider = e.code().name
    print("REPORT " + json.dumps({
        "token_len": len(token) if token else 0,
        "token_file": os.environ.get("PROPHET_TF_TOKEN_FILE"),
        "pulled": pulled, "outsider": outsider}), flush=True)
''')


def _launch(tmp_path, **extra_env):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    seen = tmp_path / "seen-token"
    result = subprocess.run(
        [sys.executable, "-m", "prophet_tf", "launch", "--workers", "1", "--ps", "1", "--",
         sys.executable, str(script), str(seen)],
        env=_env(**extra_env), cwd=ROOT, capture_output=True, text=True, timeout=150,
        stdin=subprocess.DEVNULL)
    reports = [json.loads(line.split("REPORT ", 1)[1]) for line in result.stdout.splitlines()
               if "REPORT " in line]
    return result, reports, seen


@pytest.mark.timeout(180)
def test_launcher_generates_a_token_for_its_tasks(tmp_path):
    result, reports, seen = _launch(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(reports) == 1, result.stdout
    report = reports[0]
    assert report["token_len"] == 43   # secrets.token_urlsafe(32)
    assert report["pulled"] == [[-2.0, -2.0, -2.0]]
    assert report["outsider"] == "UNAUTHENTICATED"
    token = seen.read_text()
    assert token not in result.stdout and token not in result.stderr
    # Each launch makes its own.
    again_dir = tmp_path / "again"
    again_dir.mkdir()
    again, _, seen_again = _launch(again_dir)
    assert again.returncode == 0, again.stdout + again.stderr
    assert seen_again.read_text() != token


@pytest.mark.timeout(180)
def test_launcher_passes_a_given_token_file_instead(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    result, reports, seen = _launch(tmp_path, PROPHET_TF_TOKEN_FILE=str(token_file))
    assert result.returncode == 0, result.stdout + result.stderr
    assert reports == [{"token_len": 0, "token_file": str(token_file),
                        "pulled": [[-2.0, -2.0, -2.0]], "outsider": "UNAUTHENTICATED"}]
    assert not seen.exists()   # no generated PROPHET_TF_TOKEN


@pytest.mark.timeout(60)
def test_launcher_rejects_an_empty_token_before_starting(tmp_path):
    result, reports, _ = _launch(tmp_path, PROPHET_TF_TOKEN="")
    assert result.returncode == 2
    assert "PROPHET_TF_TOKEN" in result.stderr and "empty" in result.stderr
    assert "Traceback" not in result.stderr
    assert "[ps" not in result.stdout and reports == []
