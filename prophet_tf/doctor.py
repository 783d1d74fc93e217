"""`prophet-tf doctor`: is this machine ready to train, and if not, what to do.

Each check prints one line, "OK" or "FAIL", with what was found and, on
failure, the fix. Exits 1 if any check failed, else 0.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Callable


@dataclasses.dataclass
class Check:
    name: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"{'OK  ' if self.ok else 'FAIL'} {self.name}: {self.detail}"


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
            "" if tf_ok else " (tested: 2.21.x; pip install 'tensorflow-cpu>=2.21,<2.22')")))
        keras_ok = keras.__version__.startswith("3.")
        checks.append(Check("Keras", keras_ok, keras.__version__ + (
            "" if keras_ok else " (prophet_tf needs Keras 3; pip install 'keras>=3.15,<3.16')")))
    except ImportError as e:
        checks.append(Check("TensorFlow", False, f"cannot import ({e}); "
                            "pip install 'tensorflow-cpu>=2.21,<2.22'"))
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
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    name = f"PS {index} at {address}"
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout_s, wait_for_ready=True)
        except grpc.RpcError as e:
            return Check(name, False, f"not reachable within {timeout_s:g} s ({e.code().name}); "
                         "start it with `prophet-tf ps` (TF_CONFIG task type ps), and check "
                         "the address, the port and any firewall or security group between")
    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return Check(name, serving, status + ("" if serving else
                                          "; the task is starting or shutting down"))


def check_security() -> Check:
    return Check("transport security", True,
                 "plaintext gRPC without a token (authentication and TLS are not "
                 "available yet): keep PS ports reachable by the job's hosts only")


def run(timeout_s: float = 3.0, out=None) -> int:
    out = out or sys.stdout
    sections: list[Callable[[], list[Check] | Check]] = [
        check_versions, check_ops, lambda: check_cluster(timeout_s), check_security]
    failed = 0
    for section in sections:
        result = section()
        for check in result if isinstance(result, list) else [result]:
            print(check.line(), file=out)
            failed += not check.ok
    print(f"{failed} problem(s) found" if failed else "all checks passed", file=out)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prophet-tf doctor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout", type=float, default=3.0,
                        help="seconds to wait for each PS task's health check")
    args = parser.parse_args(argv)
    if args.timeout <= 0:
        parser.error(f"--timeout must be positive. Received: {args.timeout}")
    return run(args.timeout)
