"""Authentication and TLS for the PS transport: a shared token, optional TLS.

Token: every RPC to a PS task (ParameterServer and grpc.health.v1.Health)
carries ``authorization: Bearer <token>`` metadata when a token is
configured, and a PS with a token rejects any call without it with
UNAUTHENTICATED before the call reaches its servicer. The token comes from

- ``PROPHET_TF_TOKEN``: the token itself, or
- ``PROPHET_TF_TOKEN_FILE``: a file holding it (surrounding whitespace is
  dropped), or, for ``prophet-tf ps``, ``--token-file PATH``.

Both are metadata interceptors, so the token works on plaintext and TLS
channels alike. On plaintext it travels in the clear: use TLS too off a
trusted network.

TLS (gRPC's own): the PS serves it with ``--tls-cert``/``--tls-key`` (or
``PROPHET_TF_TLS_CERT``/``PROPHET_TF_TLS_KEY``); clients verify the PS against
the CA certificate of ``PROPHET_TF_TLS_CA`` and, for a certificate issued to a
name other than the address they dial, ``PROPHET_TF_TLS_SERVER_NAME``.

Configuration mistakes (an empty token, a missing or unreadable file, a
certificate that does not parse or does not match its key) raise
:class:`SecurityError` naming the variable, flag or path; the token itself is
never printed.

Imports only grpc and the standard library: the launcher uses this module and
stays free of TensorFlow.
"""
from __future__ import annotations

import collections
import dataclasses
import hmac
import ipaddress
import logging
import os
import ssl
import threading
import time
from typing import Mapping, Sequence

import grpc

from prophet_tf import environment

__all__ = ["TOKEN_ENV", "TOKEN_FILE_ENV", "TLS_CA_ENV", "TLS_SERVER_NAME_ENV", "TLS_CERT_ENV",
           "TLS_KEY_ENV", "METADATA_KEY", "SecurityError", "Token", "ClientTLS", "ServerTLS",
           "ClientSecurity", "load_token", "load_client_tls", "load_server_tls",
           "client_security", "create_channel", "TokenServerInterceptor", "is_loopback"]

logger = logging.getLogger(__name__)

TOKEN_ENV = environment.TOKEN
TOKEN_FILE_ENV = environment.TOKEN_FILE
TLS_CA_ENV = environment.TLS_CA
TLS_SERVER_NAME_ENV = environment.TLS_SERVER_NAME
TLS_CERT_ENV = environment.TLS_CERT
TLS_KEY_ENV = environment.TLS_KEY
METADATA_KEY = "authorization"
_SCHEME = "Bearer "
_MAX_FILE_BYTES = 1 << 20  # a token, a certificate chain or a key is far smaller


class SecurityError(ValueError):
    """A token or TLS setting is unusable; the message names its source."""


@dataclasses.dataclass(frozen=True)
class Token:
    """A shared token and where it came from (``source``, safe to print)."""

    value: str = dataclasses.field(repr=False)
    source: str

    def __str__(self) -> str:
        return f"token from {self.source}"


@dataclasses.dataclass(frozen=True)
class ClientTLS:
    """What a client needs to verify a PS: the CA certificate(s), PEM bytes."""

    ca_path: str
    ca: bytes = dataclasses.field(repr=False)
    server_name: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca)


@dataclasses.dataclass(frozen=True)
class ServerTLS:
    """A PS's certificate chain and private key, PEM bytes (already checked)."""

    cert_path: str
    key_path: str
    cert: bytes = dataclasses.field(repr=False)
    key: bytes = dataclasses.field(repr=False)

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.cert)])


@dataclasses.dataclass(frozen=True)
class ClientSecurity:
    """How a client reaches a PS: token (or None) and TLS (or None: plaintext)."""

    token: Token | None = None
    tls: ClientTLS | None = None


def _read(path: str, what: str) -> bytes:
    """The bytes of ``path``; SecurityError naming ``what`` and the path otherwise."""
    try:
        with open(path, "rb") as f:
            data = f.read(_MAX_FILE_BYTES + 1)
    except OSError as e:
        raise SecurityError(f"Cannot read {what}: {e.strerror or e}. Received: {path!r}") from None
    if len(data) > _MAX_FILE_BYTES:
        raise SecurityError(f"{what} is larger than {_MAX_FILE_BYTES} bytes; is it the right "
                            f"file? Received: {path!r}")
    return data


def _checked_token(value: str, source: str) -> Token:
    value = value.strip()
    if not value:
        raise SecurityError(f"The token from {source} is empty; put the token there, or unset it "
                            "to run without one")
    # gRPC metadata values are printable ASCII; a space would blur "Bearer <token>".
    if not all(0x21 <= ord(c) <= 0x7E for c in value):
        raise SecurityError(f"The token from {source} has characters other than printable ASCII "
                            "without spaces; make one with `python -c \"import secrets; "
                            "print(secrets.token_urlsafe(32))\"`")
    return Token(value, source)


def load_token(env: Mapping[str, str] | None = None, token_file: str | None = None) -> Token | None:
    """The configured token, or None when there is none.

    Args:
        env: the environment to read (default ``os.environ``).
        token_file: a ``--token-file`` flag; it takes precedence over the
            environment.

    Raises:
        SecurityError: both variables are set, the token is empty or not
            printable ASCII, or the file cannot be read.
    """
    env = os.environ if env is None else env
    if token_file is not None:
        source = f"--token-file {token_file}"
        return _checked_token(_read(token_file, "the token file (--token-file)")
                              .decode("ascii", "replace"), source)
    inline, path = env.get(TOKEN_ENV), env.get(TOKEN_FILE_ENV)
    if inline is not None and path is not None:
        raise SecurityError(f"Both {TOKEN_ENV} and {TOKEN_FILE_ENV} are set; set only one. "
                            f"Received: {TOKEN_FILE_ENV}={path!r}, {TOKEN_ENV}=(hidden)")
    if inline is not None:
        return _checked_token(inline, TOKEN_ENV)
    if path is not None:
        if not path.strip():
            raise SecurityError(f"{TOKEN_FILE_ENV} is set but empty; set it to the path of the "
                                "token file, or unset it")
        return _checked_token(_read(path, f"the token file ({TOKEN_FILE_ENV})")
                              .decode("ascii", "replace"), f"{TOKEN_FILE_ENV} ({path})")
    return None


def _path(value: str | None, name: str) -> str | None:
    if value is None:
        return None
    if not value.strip():
        raise SecurityError(f"{name} is set but empty; set it to a PEM file's path, or unset it")
    return value


def load_client_tls(env: Mapping[str, str] | None = None) -> ClientTLS | None:
    """TLS settings for clients (``PROPHET_TF_TLS_CA``...), or None for plaintext.

    Raises:
        SecurityError: the CA file cannot be read or holds no valid
            certificate, or a server name is given without a CA.
    """
    env = os.environ if env is None else env
    ca_path = _path(env.get(TLS_CA_ENV), TLS_CA_ENV)
    server_name = env.get(TLS_SERVER_NAME_ENV) or None
    if ca_path is None:
        if server_name is not None:
            raise SecurityError(f"{TLS_SERVER_NAME_ENV} only applies with TLS; set {TLS_CA_ENV} "
                                f"to the CA certificate too. Received: {TLS_SERVER_NAME_ENV}="
                                f"{server_name!r}, {TLS_CA_ENV} unset")
        return None
    ca = _read(ca_path, f"the CA certificate ({TLS_CA_ENV})")
    try:  # gRPC would only find out at the first handshake, with a vaguer error.
        ssl.create_default_context(cadata=ca.decode("ascii"))
    except (ssl.SSLError, UnicodeDecodeError, ValueError) as e:
        raise SecurityError(f"The CA certificate ({TLS_CA_ENV}) is not a PEM certificate: {e}. "
                            f"Received: {ca_path!r}") from None
    return ClientTLS(ca_path, ca, server_name)


def _no_password():
    raise SecurityError("the private key is encrypted; give the PS an unencrypted key file "
                        "(e.g. `openssl pkey -in KEY -out KEY.plain`) readable only by it")


def load_server_tls(cert_path: str | None = None, key_path: str | None = None,
                    env: Mapping[str, str] | None = None) -> ServerTLS | None:
    """A PS's TLS certificate and key, from the flags or the environment; None: plaintext.

    Raises:
        SecurityError: only one of certificate and key is given, a file
            cannot be read, or they do not parse or do not belong together.
    """
    env = os.environ if env is None else env
    cert_name, key_name = "--tls-cert", "--tls-key"
    if cert_path is None:
        cert_path, cert_name = _path(env.get(TLS_CERT_ENV), TLS_CERT_ENV), TLS_CERT_ENV
    if key_path is None:
        key_path, key_name = _path(env.get(TLS_KEY_ENV), TLS_KEY_ENV), TLS_KEY_ENV
    if cert_path is None and key_path is None:
        return None
    if cert_path is None or key_path is None:
        raise SecurityError(f"TLS needs both a certificate and its private key "
                            f"(--tls-cert/--tls-key or {TLS_CERT_ENV}/{TLS_KEY_ENV}). Received: "
                            f"certificate={cert_path!r}, key={key_path!r}")
    cert = _read(cert_path, f"the TLS certificate ({cert_name})")
    key = _read(key_path, f"the TLS private key ({key_name})")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert_path, key_path, password=_no_password)
    except ssl.SSLError as e:
        raise SecurityError(f"The TLS certificate and key do not load ({e.reason or e}): both "
                            "must be PEM, and the key must be the certificate's. Received: "
                            f"{cert_name}={cert_path!r}, {key_name}={key_path!r}") from None
    except OSError as e:
        raise SecurityError(f"Cannot read the TLS certificate or key: {e}. Received: "
                            f"{cert_name}={cert_path!r}, {key_name}={key_path!r}") from None
    return ServerTLS(cert_path, key_path, cert, key)


def client_security(env: Mapping[str, str] | None = None) -> ClientSecurity:
    """The token and client TLS settings of ``env`` (default ``os.environ``).

    Raises:
        SecurityError: see :func:`load_token` and :func:`load_client_tls`.
    """
    return ClientSecurity(load_token(env), load_client_tls(env))


def peer_security(token: Token | None, server_tls: ServerTLS | None,
                  env: Mapping[str, str] | None = None) -> ClientSecurity:
    """How a PS task reaches another (PS task 0, ``norm_sharing.py``): its own token; with
    TLS, the CA of ``PROPHET_TF_TLS_CA`` when set, else its own certificate (every PS
    task serving the same one, as the launcher's).

    Raises:
        SecurityError: see :func:`load_client_tls`.
    """
    tls = load_client_tls(env) if server_tls is not None else None
    if server_tls is not None and tls is None:
        tls = ClientTLS(server_tls.cert_path, server_tls.cert)
    return ClientSecurity(token, tls)


# -- client side ----------------------------------------------------------------------------


class _CallDetails(collections.namedtuple(
        "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready",
                         "compression")), grpc.ClientCallDetails):
    pass


class _TokenClientInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                              grpc.StreamUnaryClientInterceptor,
                              grpc.StreamStreamClientInterceptor):
    """Adds ``authorization: Bearer <token>`` to every call (plain, future, with_call)."""

    def __init__(self, token: Token):
        self._entry = (METADATA_KEY, _SCHEME + token.value)

    def _details(self, details):
        metadata = [m for m in (details.metadata or ()) if m[0] != METADATA_KEY]
        metadata.append(self._entry)
        return _CallDetails(details.method, details.timeout, metadata, details.credentials,
                            details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


def create_channel(address: str, options: Sequence = (), *,
                   security: ClientSecurity | None = None) -> grpc.Channel:
    """A channel to a PS task: TLS or plaintext, with the token on every call.

    Args:
        address: ``host:port``.
        options: gRPC channel options.
        security: default :func:`client_security` of ``os.environ``.

    Raises:
        SecurityError: the environment's settings are unusable.
    """
    security = client_security() if security is None else security
    options = list(options)
    if security.tls is not None:
        if security.tls.server_name:
            options.append(("grpc.ssl_target_name_override", security.tls.server_name))
        channel = grpc.secure_channel(address, security.tls.credentials(), options=options)
    else:
        channel = grpc.insecure_channel(address, options=options)
    if security.token is not None:
        channel = grpc.intercept_channel(channel, _TokenClientInterceptor(security.token))
    return channel


# -- server side ----------------------------------------------------------------------------


class TokenServerInterceptor(grpc.ServerInterceptor):
    """Rejects every call without the right token with UNAUTHENTICATED.

    The rejection replaces the method's handler, so the servicer never sees
    the call and its request is not even deserialized. Rejections are logged
    at WARNING at most once per ``log_interval_s`` (a misconfigured or hostile
    client must not flood the log), with how many were not logged.
    """

    def __init__(self, token: Token, log_interval_s: float = 10.0):
        self._expected = (_SCHEME + token.value).encode("ascii")
        self._log_interval_s = log_interval_s
        self._log_lock = threading.Lock()
        self._last_log = -float("inf")
        self._unlogged = 0

    def _problem(self, metadata) -> str | None:
        values = [value for key, value in (metadata or ()) if key == METADATA_KEY]
        if not values:
            return (f"missing token: this PS requires one ('{METADATA_KEY}: Bearer <token>' "
                    f"metadata); set {TOKEN_ENV} or {TOKEN_FILE_ENV} on this client to the "
                    "PS's token")
        if len(values) > 1:
            return f"{len(values)} '{METADATA_KEY}' entries; send exactly one"
        value = values[0]
        if isinstance(value, str):
            value = value.encode("utf-8", "surrogateescape")
        if not value.startswith(_SCHEME.encode()):
            return f"malformed '{METADATA_KEY}' metadata: expected 'Bearer <token>'"
        if not hmac.compare_digest(value, self._expected):
            return (f"wrong token: it differs from this PS's; give this client the PS's "
                    f"{TOKEN_ENV} or {TOKEN_FILE_ENV}")
        return None

    def _log(self, method: str, peer: str, problem: str) -> None:
        with self._log_lock:
            now = time.monotonic()
            if now - self._last_log < self._log_interval_s:
                self._unlogged += 1
                return
            unlogged, self._unlogged, self._last_log = self._unlogged, 0, now
        logger.warning("rejected %s from %s: %s%s", method, peer, problem.split(":")[0],
                       f" ({unlogged} more rejections not logged)" if unlogged else "")

    def intercept_service(self, continuation, handler_call_details):
        problem = self._problem(handler_call_details.invocation_metadata)
        if problem is None:
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        method = handler_call_details.method

        def reject(_request, context):
            self._log(method, context.peer(), problem)
            context.abort(grpc.StatusCode.UNAUTHENTICATED, problem)

        # A handler of the method's own kind, taking the request as raw bytes.
        if handler is not None and handler.request_streaming:
            if handler.response_streaming:
                return grpc.stream_stream_rpc_method_handler(reject)
            return grpc.stream_unary_rpc_method_handler(reject)
        if handler is not None and handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(reject)
        return grpc.unary_unary_rpc_method_handler(reject)


# -- binding --------------------------------------------------------------------------------


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address to bind, brackets allowed) is loopback only.

    127.0.0.0/8, ::1 (also as ::ffff:127.x.y.z) and ``localhost`` are; every
    other name, the wildcard addresses and interface addresses are not.
    """
    host = host.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host.lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)
