"""Token and TLS settings, the token interceptors and the health wait.

The interceptors and the health wait run against real in-process gRPC servers
on free loopback ports; certificates are made by the ``openssl`` command.
"""
import os
import pathlib
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from prophet_tf.ps import health as health_lib
from prophet_tf.ps import security
from tls_certs import make_cert

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOKEN = "s3cret-token_0123456789"

pytestmark = pytest.mark.timeout(60)



# -- settings ---------------------------------------------------------------------------------


def test_no_token_configured():
    assert security.load_token({}) is None


def test_token_from_env_and_file(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    inline = security.load_token({security.TOKEN_ENV: TOKEN})
    assert (inline.value, inline.source) == (TOKEN, "PROPHET_TF_TOKEN")
    from_file = security.load_token({security.TOKEN_FILE_ENV: str(path)})
    assert from_file.value == TOKEN and str(path) in from_file.source
    # --token-file wins over the environment.
    other = tmp_path / "other"
    other.write_text("flag-token")
    flag = security.load_token({security.TOKEN_ENV: TOKEN}, token_file=str(other))
    assert flag.value == "flag-token" and flag.source == f"--token-file {other}"
    assert TOKEN not in repr(inline) and TOKEN not in str(inline)


@pytest.mark.parametrize("env, fragments", [
    ({"PROPHET_TF_TOKEN": ""}, ["PROPHET_TF_TOKEN", "empty"]),
    ({"PROPHET_TF_TOKEN": "  \n"}, ["PROPHET_TF_TOKEN", "empty"]),
    ({"PROPHET_TF_TOKEN_FILE": ""}, ["PROPHET_TF_TOKEN_FILE", "empty"]),
    ({"PROPHET_TF_TOKEN": "two words"}, ["PROPHET_TF_TOKEN", "printable ASCII"]),
    ({"PROPHET_TF_TOKEN": "caf\u00e9"}, ["PROPHET_TF_TOKEN", "printable ASCII"]),
    ({"PROPHET_TF_TOKEN": TOKEN, "PROPHET_TF_TOKEN_FILE": "/x"}, ["Both", "only one"]),
])
def test_bad_token_settings_name_their_source(env, fragments):
    with pytest.raises(security.SecurityError) as info:
        security.load_token(env)
    for fragment in fragments:
        assert fragment in str(info.value)
    assert TOKEN not in str(info.value)   # never echoed


def test_bad_token_files_name_the_path(tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(security.SecurityError, match="empty") as info:
        security.load_token({security.TOKEN_FILE_ENV: str(empty)})
    assert str(empty) in str(info.value) and "PROPHET_TF_TOKEN_FILE" in str(info.value)
    missing = tmp_path / "missing"
    with pytest.raises(security.SecurityError, match="Cannot read") as info:
        security.load_token({security.TOKEN_FILE_ENV: str(missing)})
    assert str(missing) in str(info.value)
    with pytest.raises(security.SecurityError, match="--token-file") as info:
        security.load_token({}, token_file=str(missing))
    assert str(missing) in str(info.value)


def test_client_tls_settings(tmp_path):
    assert security.load_client_tls({}) is None
    cert, _ = make_cert(tmp_path)
    tls = security.load_client_tls({security.TLS_CA_ENV: str(cert),
                                    security.TLS_SERVER_NAME_ENV: "ps.test"})
    assert tls.ca == cert.read_bytes() and tls.server_name == "ps.test"
    assert isinstance(tls.credentials(), grpc.ChannelCredentials)


def test_bad_client_tls_settings(tmp_path):
    missing = tmp_path / "ca.pem"
    with pytest.raises(security.SecurityError, match="Cannot read") as info:
        security.load_client_tls({security.TLS_CA_ENV: str(missing)})
    assert str(missing) in str(info.value) and "PROPHET_TF_TLS_CA" in str(info.value)
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydA==\n-----END CERTIFICATE-----\n")
    with pytest.raises(security.SecurityError, match="not a PEM certificate") as info:
        security.load_client_tls({security.TLS_CA_ENV: str(garbage)})
    assert str(garbage) in str(info.value)
    with pytest.raises(security.SecurityError, match="PROPHET_TF_TLS_CA"):
        security.load_client_tls({security.TLS_SERVER_NAME_ENV: "ps.test"})


def test_server_tls_settings(tmp_path):
    cert, key = make_cert(tmp_path)
    assert security.load_server_tls(env={}) is None
    tls = security.load_server_tls(str(cert), str(key), env={})
    assert (tls.cert, tls.key) == (cert.read_bytes(), key.read_bytes())
    from_env = security.load_server_tls(env={security.TLS_CERT_ENV: str(cert),
                                             security.TLS_KEY_ENV: str(key)})
    assert from_env.cert_path == str(cert)
    assert "BEGIN" not in repr(tls)   # the key stays out of reprs and logs


def test_bad_server_tls_settings(tmp_path):
    cert, key = make_cert(tmp_path)
    other_cert, other_key = make_cert(tmp_path, "other", "DNS:other")
    with pytest.raises(security.SecurityError, match="both a certificate and its private key"):
        security.load_server_tls(str(cert), None, env={})
    missing = tmp_path / "nope.key"
    with pytest.raises(security.SecurityError, match="Cannot read") as info:
        security.load_server_tls(str(cert), str(missing), env={})
    assert str(missing) in str(info.value) and "--tls-key" in str(info.value)
    with pytest.raises(security.SecurityError, match="do not load") as info:
        security.load_server_tls(str(cert), str(other_key), env={})
    assert str(cert) in str(info.value) and str(other_key) in str(info.value)
    with pytest.raises(security.SecurityError, match="PROPHET_TF_TLS_CERT"):
        security.load_server_tls(env={security.TLS_CERT_ENV: str(tmp_path / "x.crt"),
                                      security.TLS_KEY_ENV: str(key)})
    encrypted = tmp_path / "encrypted.key"
    subprocess.run(["openssl", "pkey", "-in", str(other_key), "-aes256", "-passout", "pass:pw",
                    "-out", str(encrypted)], check=True, capture_output=True, timeout=30)
    with pytest.raises(security.SecurityError, match="encrypted"):
        security.load_server_tls(str(other_cert), str(encrypted), env={})


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.3.2.1", True), ("::1", True), ("[::1]", True),
    ("localhost", True), ("LocalHost", True), ("::ffff:127.0.0.1", True),
    ("0.0.0.0", False), ("[::]", False), ("::", False), ("", False), ("10.1.2.3", False),
    ("ps-0.example.com", False), ("128.0.0.1", False),
])
def test_is_loopback(host, loopback):
    assert security.is_loopback(host) is loopback


# -- interceptors against a real in-process server --------------------------------------------


class _Server:
    """An in-process server with one method of each kind, counting the calls that reach it."""

    def __init__(self, token=None):
        self.calls = 0
        self._lock = threading.Lock()

        def count():
            with self._lock:
                self.calls += 1

        def uu(request, context):
            count()
            return dict(context.invocation_metadata()).get("x-extra", "").encode() + request

        def us(request, context):
            count()
            yield request
            yield request

        def su(requests, context):
            count()
            return b"".join(requests)

        def ss(requests, context):
            count()
            yield from requests

        interceptors = [security.TokenServerInterceptor(token)] if token else None
        self.server = grpc.server(futures.ThreadPoolExecutor(4), interceptors=interceptors)
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.T", {
            "UU": grpc.unary_unary_rpc_method_handler(uu),
            "US": grpc.unary_stream_rpc_method_handler(us),
            "SU": grpc.stream_unary_rpc_method_handler(su),
            "SS": grpc.stream_stream_rpc_method_handler(ss)}),))
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{self.port}"
        self.server.start()

    def close(self):
        self.server.stop(None)


@pytest.fixture
def guarded():
    server = _Server(security.Token(TOKEN, "test"))
    yield server
    server.close()


def _all_kinds(channel):
    """Each kind of call, plus future/with_call, as (name, thunk)."""
    return [
        ("unary", lambda: channel.unary_unary("/t.T/UU")(b"x", timeout=10)),
        ("future", lambda: channel.unary_unary("/t.T/UU").future(b"x", timeout=10).result()),
        ("with_call", lambda: channel.unary_unary("/t.T/UU").with_call(b"x", timeout=10)[0]),
        ("unary-stream", lambda: list(channel.unary_stream("/t.T/US")(b"x", timeout=10))),
        ("stream-unary", lambda: channel.stream_unary("/t.T/SU")(iter([b"a", b"b"]), timeout=10)),
        ("stream-stream",
         lambda: list(channel.stream_stream("/t.T/SS")(iter([b"a", b"b"]), timeout=10))),
        ("health", lambda: health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=10).status),
        ("health watch", lambda: next(iter(health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(), timeout=10))).status),
    ]


def test_right_token_reaches_every_kind_of_method(guarded):
    good = security.ClientSecurity(security.Token(TOKEN, "test"))
    with security.create_channel(guarded.address, security=good) as channel:
        results = {name: call() for name, call in _all_kinds(channel)}
    assert results == {"unary": b"x", "future": b"x", "with_call": b"x",
                       "unary-stream": [b"x", b"x"], "stream-unary": b"ab",
                       "stream-stream": [b"a", b"b"],
                       "health": health_pb2.HealthCheckResponse.SERVING,
                       "health watch": health_pb2.HealthCheckResponse.SERVING}
    assert guarded.calls == 6


@pytest.mark.parametrize("client_token, fragment", [
    (None, "missing token"),
    ("not-the-token", "wrong token"),
    (TOKEN + "x", "wrong token"),
    (TOKEN[:-1], "wrong token"),
])
def test_missing_or_wrong_token_is_unauthenticated_and_reaches_nothing(
        guarded, client_token, fragment):
    sec = security.ClientSecurity(security.Token(client_token, "test") if client_token else None)
    with security.create_channel(guarded.address, security=sec) as channel:
        for name, call in _all_kinds(channel):
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
            assert fragment in info.value.details(), (name, info.value.details())
            assert TOKEN not in info.value.details()
            if client_token:
                assert client_token not in info.value.details()
        # An unknown method is refused the same way: nothing is revealed before the token.
        with pytest.raises(grpc.RpcError) as info:
            channel.unary_unary("/t.T/Nope")(b"x", timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert guarded.calls == 0


@pytest.mark.parametrize("metadata, fragment", [
    ([("authorization", TOKEN)], "expected 'Bearer <token>'"),
    ([("authorization", "Bearer " + TOKEN)] * 2, "send exactly one"),
    ([("authorization", "bearer " + TOKEN)], "expected 'Bearer <token>'"),
])
def test_malformed_authorization_metadata(guarded, metadata, fragment):
    with grpc.insecure_channel(guarded.address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            channel.unary_unary("/t.T/UU")(b"x", timeout=10, metadata=metadata)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert fragment in info.value.details()
    assert guarded.calls == 0


def test_client_interceptor_keeps_other_metadata_and_replaces_a_stale_token(guarded):
    good = security.ClientSecurity(security.Token(TOKEN, "test"))
    with security.create_channel(guarded.address, security=good) as channel:
        reply = channel.unary_unary("/t.T/UU")(
            b"!", timeout=10, metadata=[("x-extra", "kept"), ("authorization", "Bearer old")])
    assert reply == b"kept!"


def test_rejections_are_logged_without_the_token_and_throttled(guarded, caplog):
    with caplog.at_level("WARNING", logger="prophet_tf.ps.security"):
        with security.create_channel(guarded.address,
                                     security=security.ClientSecurity()) as channel:
            for _ in range(5):
                with pytest.raises(grpc.RpcError):
                    channel.unary_unary("/t.T/UU")(b"x", timeout=10)
    rejected = [r.getMessage() for r in caplog.records if "rejected" in r.getMessage()]
    assert len(rejected) == 1, rejected   # one per 10 s
    assert "/t.T/UU" in rejected[0] and "missing token" in rejected[0]
    assert TOKEN not in caplog.text


def test_no_token_configured_leaves_the_server_open():
    server = _Server()
    try:
        with security.create_channel(server.address,
                                     security=security.ClientSecurity()) as channel:
            assert channel.unary_unary("/t.T/UU")(b"x", timeout=10) == b"x"
    finally:
        server.close()


# -- health wait ------------------------------------------------------------------------------


def _closed_address() -> str:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_wait_serving_returns_on_serving(guarded):
    health_lib.wait_serving(guarded.address, 10, security=security.ClientSecurity(
        security.Token(TOKEN, "test")))


def test_wait_serving_times_out_naming_address_and_last_answer():
    # Attempts are 0.05 s apart: by 0.5 s the wait must have given up, so it
    # checks at most 12 times (the last at the limit); one that ignores its
    # limit fails on the 13th.
    address = _closed_address()
    checks = []

    def alive():
        checks.append(None)
        assert len(checks) <= 12, "still waiting past its limit"

    start = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        health_lib.wait_serving(address, 0.5, alive=alive, security=security.ClientSecurity())
    assert time.monotonic() - start >= 0.5 and len(checks) >= 2
    assert isinstance(info.value, health_lib.NotServingError)
    assert address in str(info.value) and "UNAVAILABLE" in str(info.value)
    assert info.value.last_code == grpc.StatusCode.UNAVAILABLE


def test_wait_serving_reports_not_serving_status():
    server = _Server()
    server.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    try:
        with pytest.raises(health_lib.NotServingError, match="Last answer: NOT_SERVING"):
            health_lib.wait_serving(server.address, 0.5, security=security.ClientSecurity())
        # Becoming SERVING later ends the wait.
        threading.Timer(0.3, server.health.set,
                        ("", health_pb2.HealthCheckResponse.SERVING)).start()
        health_lib.wait_serving(server.address, 10, security=security.ClientSecurity())
    finally:
        server.close()


def test_wait_serving_without_the_token_fails_at_once(guarded):
    attempts = []
    with pytest.raises(health_lib.HealthCheckRefused) as info:
        health_lib.wait_serving(guarded.address, 30, alive=lambda: attempts.append(None),
                                security=security.ClientSecurity())
    assert len(attempts) == 1   # no point waiting for it to change: no second attempt
    assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert "missing token" in str(info.value) and "PROPHET_TF_TOKEN" in str(info.value)


def test_wait_serving_reads_the_token_from_the_environment(guarded, monkeypatch):
    monkeypatch.setenv(security.TOKEN_ENV, TOKEN)
    monkeypatch.delenv(security.TOKEN_FILE_ENV, raising=False)
    health_lib.wait_serving(guarded.address, 10)
    monkeypatch.setenv(security.TOKEN_ENV, "")
    with pytest.raises(security.SecurityError, match="PROPHET_TF_TOKEN"):
        health_lib.wait_serving(guarded.address, 10)


def test_wait_serving_stops_when_alive_raises():
    calls = []

    def alive():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("task died")

    with pytest.raises(RuntimeError, match="task died"):
        health_lib.wait_serving(_closed_address(), 30, alive=alive,
                                security=security.ClientSecurity())
    assert len(calls) == 3


def test_launcher_and_health_wait_import_no_tensorflow():
    code = ("import sys\n"
            "import prophet_tf.tools.launch\n"
            "from prophet_tf.ps import health, security\n"
            "try:\n"
            f"    health.wait_serving({_closed_address()!r}, 0.3)\n"
            "except TimeoutError:\n"
            "    pass\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('tensorflow', 'keras', 'tf_keras')))\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for name in (security.TOKEN_ENV, security.TOKEN_FILE_ENV, security.TLS_CA_ENV):
        env.pop(name, None)
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
