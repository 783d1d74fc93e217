"""`prophet-tf doctor`: is this machine ready to train, and if not, what to do.

Each check prints one line, "OK", "WARN" or "FAIL", with what was found and,
unless OK, what to do. Exits 1 if any check failed, else 0 (warnings too).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Callable

from prophet_tf import lean_keras


@dataclasses.dataclass
class Check:
    name: str
    ok: bool
    detail: str
    warn: bool = False  # ok, but worth acting on

    def line(self) -> str:
        label = "FAIL" if not self.ok else "WARN" if self.warn else "OK  "
        return f"{label} {self.name}: {self.detail}"


def _version(module: str) -> str:
    from importlib import metadata
    try:
        return metadata.version(module)
    except metadata.PackageNotFoundError:
        return "not installed"


def check_versions() -> list[Check]:
    checks = []
    try:
        import tensorflow as tf
        import keras
        tf_ok = tf.__version__.startswith("2.21.")
        checks.append(Check("TensorFlow", tf_ok, tf.__version__ + (
            "" if tf_ok else " (tested: 2.21.x; pip install 'tensorflow-cpu>=2.21,<2.22', "
                             "or 'tensorflow[and-cuda]>=2.21,<2.22' on a GPU machine)")))
        keras_ok = keras.__version__.startswith("3.")
        checks.append(Check("Keras", keras_ok, keras.__version__ + (
            "" if keras_ok else " (prophet_tf needs Keras 3; pip install 'keras>=3.15,<3.16')")))
    except ImportError as e:
        from prophet_tf._build_info import INSTALL_HINT
        checks.append(Check("TensorFlow", False, f"cannot import ({e}). {INSTALL_HINT}"))
    for package, need in (("grpcio", "1.85.1"), ("protobuf", "7.35.1")):
        found = _version(package)
        ok = found != "not installed" and _at_least(found, need)
        checks.append(Check(package, ok, found + ("" if ok else f" (need >= {need}; "
                                                  f"pip install '{package}>={need}')")))
    return checks


def _at_least(found: str, need: str) -> bool:
    def parts(v):
        return tuple(int(p) for p in v.split(".")[:3] if p.isdigit())
    return parts(found) >= parts(need)


def check_ops() -> Check:
    try:
        from prophet_tf import _native
        return Check("op library", True, f"loaded {_native.load().path}")
    except ImportError as e:
        return Check("op library", False, str(e))


def check_device() -> Check:
    """The device `prophet_tf.Strategy()` computes on here (`prophet_tf.devices.resolve`),
    and where TensorFlow runs a MatMul placed on it."""
    name = "compute device"
    try:
        import tensorflow as tf

        from prophet_tf import devices
    except ImportError as e:
        return Check(name, False, f"cannot import TensorFlow ({e})")
    try:
        device = devices.resolve(None)
    except ValueError as e:
        return Check(name, False, str(e))
    from_env = os.environ.get(devices.DEVICE_ENV)
    gpus = tf.config.list_logical_devices("GPU")
    if from_env:
        why = f"from {devices.DEVICE_ENV}={from_env!r}"
    elif gpus:
        why = f"the first of {len(gpus)} visible GPU(s)"
    else:
        why = "no GPU visible" + ("" if tf.test.is_built_with_cuda() else
                                  ": this TensorFlow is built without CUDA")
    try:
        # Where the runtime put the result: with soft placement, a device that
        # cannot run the op would leave it on another.
        with tf.device(device):
            ran = devices.canonical(tf.matmul(tf.ones([2, 2]), tf.ones([2, 2])).device)
    except Exception as e:  # noqa: BLE001 - a broken device, reported as such.
        return Check(name, False, f"{device} ({why}), but a MatMul there failed: "
                     f"{type(e).__name__}: {e}")
    if ran != device:
        return Check(name, False, f"{device} ({why}), but TensorFlow ran a MatMul placed "
                     f"there on {ran}; set {devices.DEVICE_ENV} or Strategy(device=...) to a "
                     "device that works")
    return Check(name, True, f"{device} ({why}); a MatMul placed there ran there. Parameter "
                 f"reads and gradient pushes run on its host, {devices.host_of(device)}")


def _ps_addresses() -> list[str]:
    """The PS addresses of TF_CONFIG, or [] when it is unset or malformed."""
    from prophet_tf import cluster as cluster_lib
    if not os.environ.get("TF_CONFIG"):
        return []
    try:
        return list(cluster_lib.resolve().ps)
    except ValueError:
        return []


def check_cluster(timeout_s: float) -> list[Check]:
    from prophet_tf import cluster as cluster_lib
    if not os.environ.get("TF_CONFIG"):
        return [Check("TF_CONFIG", True, "not set (fine for `prophet-tf launch`, which sets it; "
                      "every task of a multi-host job needs it)")]
    try:
        config = cluster_lib.resolve()
    except ValueError as e:
        return [Check("TF_CONFIG", False, str(e))]
    checks = [Check("TF_CONFIG", True, f"{config.num_workers} worker(s), {config.num_ps} PS "
                    f"task(s); this task: {config.task_type} {config.task_index}")]
    for i, address in enumerate(config.ps):
        checks.append(_check_ps(i, address, timeout_s))
    return checks


def _check_ps(index: int, address: str, timeout_s: float) -> Check:
    """Waits up to `timeout_s` for SERVING, with this host's token and TLS settings."""
    from prophet_tf.ps import health, security
    name = f"PS {index} at {address}"
    try:
        health.wait_serving(address, timeout_s)
    except security.SecurityError as e:
        return Check(name, False, f"cannot check: {e}")
    except health.HealthCheckRefused as e:
        return Check(name, False, str(e).replace(f"PS at {address} ", "", 1))
    except health.NotServingError as e:
        last = e.last_answer
        if e.last_code is None and last != "no answer":  # it answered, with another status
            return Check(name, False, f"{last} after {timeout_s:g} s; the task is starting "
                         "or shutting down")
        lowered = last.lower()
        if any(word in lowered for word in ("ssl", "handshake", "tls", "certificate",
                                            "verification")):
            return Check(name, False, f"TLS handshake failed within {timeout_s:g} s ({last}); "
                         f"a PS started with --tls-cert needs {security.TLS_CA_ENV} here (and a "
                         f"plaintext PS needs it unset); if the certificate was issued to another "
                         f"name than the address, set {security.TLS_SERVER_NAME_ENV}")
        tls_hint = ""
        if "socket closed" in lowered and not os.environ.get(security.TLS_CA_ENV):
            tls_hint = (f"; if the PS serves TLS (--tls-cert), set {security.TLS_CA_ENV} here "
                        "to its CA certificate")
        return Check(name, False, f"not reachable within {timeout_s:g} s ({last}); start it "
                     "with `prophet-tf ps` (TF_CONFIG task type ps), and check the address, "
                     "the port and any firewall or security group between" + tls_hint)
    return Check(name, True, "SERVING")


def _exposed(addresses: list[str]) -> list[str]:
    """The addresses whose host is not a loopback address."""
    from prophet_tf import cluster as cluster_lib
    from prophet_tf.ps import security
    return [a for a in addresses if not security.is_loopback(cluster_lib.address_host(a))]


def check_token(ps_addresses: list[str]) -> Check:
    """Whether a token is set, and from where (never the token itself)."""
    from prophet_tf.ps import security
    try:
        token = security.load_token()
    except security.SecurityError as e:
        return Check("token", False, str(e))
    exposed = _exposed(ps_addresses)
    if token is None:
        if exposed:
            return Check("token", True, f"not set, and PS tasks are at non-loopback addresses "
                         f"({', '.join(exposed)}): whoever reaches them can register and push. "
                         f"Set {security.TOKEN_ENV} or {security.TOKEN_FILE_ENV} to the same "
                         "token on every task (a PS bound to a non-loopback address refuses to "
                         "start without one unless --insecure)", warn=True)
        return Check("token", True, "not set (fine on loopback: `prophet-tf launch` generates "
                     f"one for its tasks; a multi-host job sets {security.TOKEN_ENV} or "
                     f"{security.TOKEN_FILE_ENV} on every task)")
    path = os.environ.get(security.TOKEN_FILE_ENV)
    if token.source.startswith(security.TOKEN_FILE_ENV):
        mode = os.stat(path).st_mode
        if mode & 0o077:
            return Check("token", True, f"set from {token.source}, but the file is readable by "
                         f"others (mode {mode & 0o777:o}); chmod 600 {path}", warn=True)
    return Check("token", True, f"set from {token.source}")


def check_tls(ps_addresses: list[str]) -> Check:
    """The TLS files of this host: client CA and PS certificate/key, if set, load."""
    import ssl

    from prophet_tf.ps import security
    parts = []

    def load(loader):
        try:
            return loader(), True
        except security.SecurityError as e:
            parts.append(str(e))
            return None, False

    client, client_ok = load(security.load_client_tls)
    if client is not None:
        count = ssl.create_default_context(cadata=client.ca.decode("ascii")).cert_store_stats()
        parts.append(f"clients verify the PS with {security.TLS_CA_ENV}={client.ca_path} "
                     f"({count['x509']} certificate(s))" +
                     (f", server name {client.server_name}" if client.server_name else ""))
    server, server_ok = load(security.load_server_tls)
    ok = client_ok and server_ok
    if server is not None:
        parts.append(f"a PS here serves {server.cert_path} (key {server.key_path}; they load "
                     "and match)")
    if not ok:
        return Check("TLS", False, "; ".join(parts))
    if parts:
        return Check("TLS", True, "; ".join(parts))
    exposed = _exposed(ps_addresses)
    if exposed:
        return Check("TLS", True, f"off: traffic to {', '.join(exposed)}, the token included, "
                     "is plaintext. Off a trusted network, start each PS with --tls-cert/"
                     f"--tls-key and set {security.TLS_CA_ENV} on every task", warn=True)
    return Check("TLS", True, "off (plaintext gRPC; fine on loopback)")


def run(timeout_s: float = 3.0, out=None) -> int:
    out = out or sys.stdout
    addresses = _ps_addresses()
    sections: list[Callable[[], list[Check] | Check]] = [
        check_versions, check_ops, check_device, lambda: check_cluster(timeout_s),
        lambda: check_token(addresses), lambda: check_tls(addresses)]
    failed = warned = 0
    for section in sections:
        result = section()
        for check in result if isinstance(result, list) else [result]:
            print(check.line(), file=out)
            failed += not check.ok
            warned += check.ok and check.warn
    summary = f"{failed} problem(s) found" if failed else "all checks passed"
    print(summary + (f", {warned} warning(s)" if warned else ""), file=out)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prophet-tf doctor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout", type=float, default=3.0,
                        help="seconds to wait for each PS task's health check")
    args = parser.parse_args(argv)
    if args.timeout <= 0:
        parser.error(f"--timeout must be positive. Received: {args.timeout}")
    lean_keras.skip_keras_integrations()  # It imports TensorFlow to list devices only.
    return run(args.timeout)
