"""The PS task's gRPC server, and ``prophet-tf ps`` / ``python -m prophet_tf.ps.server``.

Message size limit and request parsing: :mod:`prophet_tf.ps.protocol`.

Bind address: ``--host`` defaults to 127.0.0.1 when the flags describe the
task (a local cluster; nothing exposed), and to ``[::]`` (all interfaces) with
TF_CONFIG, whose workers are usually on other machines and whose host name may
not be a local interface address.

Security (:mod:`prophet_tf.ps.security`): with a token (``PROPHET_TF_TOKEN``,
``PROPHET_TF_TOKEN_FILE`` or ``--token-file``) every RPC, health checks
included, must carry it, or is rejected with UNAUTHENTICATED before it
reaches the servicer. ``--tls-cert``/``--tls-key`` serve TLS. A task bound to
a non-loopback address without a token refuses to start unless
``--insecure`` is given.

Thread pool: pulls wait in a server thread until their version exists, so the
pool is sized ``16 + 8 * num_workers``; a worker keeps a few pulls in flight
per PS task, which leaves threads for pushes.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from prophet_tf import codec
from prophet_tf import environment, lean_keras
from prophet_tf.ps import protocol, security, sharding
from prophet_tf.ps.protocol import MAX_MESSAGE_BYTES, SERVICE_NAME, server_options
from prophet_tf.ps.servicer import ParameterServerServicer
from prophet_tf.ps.trace import PSTrace
from prophet_tf.ps.v1 import ps_pb2

__all__ = ["create_server", "main"]

logger = logging.getLogger(__name__)

# After the job failed, how long the PS keeps answering (so every worker's
# heartbeat or pull learns why) before it exits 1.
_FAILURE_LINGER_S = 3.0


def _passthrough(data: bytes) -> bytes:
    return data


def create_server(address: str, servicer, *, max_message_bytes: int = MAX_MESSAGE_BYTES,
                  max_workers: int | None = None, token: security.Token | None = None,
                  tls: security.ServerTLS | None = None):
    """Builds (does not start) a gRPC server for ``servicer`` bound to ``address``.

    The standard ``grpc.health.v1.Health`` service reports SERVING for ``""``
    and for the ParameterServer service; it answers as soon as the server is
    started, when the servicer is ready to take Register.

    Args:
        address: ``host:port``; port 0 picks a free port.
        servicer: a :class:`prophet_tf.ps.servicer.ParameterServerServicer`.
        max_message_bytes: receive and send limit for one message.
        max_workers: gRPC thread pool size (default ``16 + 8 * num_workers``).
        token: when given, every call (health checks included) must carry it;
            others get UNAUTHENTICATED and never reach a servicer.
        tls: when given, the port serves TLS with this certificate and key.

    Returns:
        ``(server, port)``; ``server.health`` is the health servicer.

    Raises:
        RuntimeError: the address cannot be bound.
    """
    if max_workers is None:
        max_workers = 16 + 8 * servicer.num_workers
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers,
                                                    thread_name_prefix="prophet-tf-ps"),
                         options=server_options(max_message_bytes),
                         interceptors=[security.TokenServerInterceptor(token)] if token else None)
    handlers = {
        "Register": grpc.unary_unary_rpc_method_handler(
            servicer.Register,
            request_deserializer=protocol.tolerant_parser(ps_pb2.RegisterRequest),
            response_serializer=ps_pb2.RegisterResponse.SerializeToString),
        "Push": grpc.unary_unary_rpc_method_handler(
            servicer.Push, request_deserializer=protocol.parse_push_request,
            response_serializer=ps_pb2.PushResponse.SerializeToString),
        # Pull yields ParameterChunks bytes: answers serialized once per version.
        "Pull": grpc.unary_stream_rpc_method_handler(
            servicer.Pull, request_deserializer=protocol.tolerant_parser(ps_pb2.PullRequest),
            response_serializer=_passthrough),
        "Heartbeat": grpc.unary_unary_rpc_method_handler(
            servicer.Heartbeat,
            request_deserializer=protocol.tolerant_parser(ps_pb2.HeartbeatRequest),
            response_serializer=ps_pb2.HeartbeatResponse.SerializeToString),
        "Owed": grpc.unary_unary_rpc_method_handler(
            servicer.Owed, request_deserializer=protocol.tolerant_parser(ps_pb2.OwedRequest),
            response_serializer=ps_pb2.OwedResponse.SerializeToString),
        "Gather": grpc.unary_unary_rpc_method_handler(
            servicer.Gather,
            request_deserializer=protocol.tolerant_parser(ps_pb2.GatherRequest),
            response_serializer=ps_pb2.GatherResponse.SerializeToString),
        "Verdict": grpc.unary_unary_rpc_method_handler(
            servicer.Verdict,
            request_deserializer=protocol.tolerant_parser(ps_pb2.GatherRequest),
            response_serializer=ps_pb2.GatherResponse.SerializeToString),
        "ShareNorm": grpc.unary_unary_rpc_method_handler(
            servicer.ShareNorm,
            request_deserializer=protocol.tolerant_parser(ps_pb2.GatherRequest),
            response_serializer=ps_pb2.GatherResponse.SerializeToString),
        "ReadOptimizerState": grpc.unary_stream_rpc_method_handler(
            servicer.ReadOptimizerState,
            request_deserializer=protocol.tolerant_parser(ps_pb2.OptimizerStateRequest),
            response_serializer=ps_pb2.OptimizerSlot.SerializeToString),
        "SwapAverages": grpc.unary_unary_rpc_method_handler(
            servicer.SwapAverages,
            request_deserializer=protocol.tolerant_parser(ps_pb2.GatherRequest),
            response_serializer=ps_pb2.GatherResponse.SerializeToString),
        "WriteOptimizerState": grpc.stream_unary_rpc_method_handler(
            servicer.WriteOptimizerState,
            request_deserializer=protocol.tolerant_parser(ps_pb2.OptimizerSlot),
            response_serializer=ps_pb2.OptimizerStateWritten.SerializeToString),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    try:
        if tls is not None:
            port = server.add_secure_port(address, tls.credentials())
        else:
            port = server.add_insecure_port(address)
    except RuntimeError as e:
        raise RuntimeError(f"Cannot bind the PS to {address!r}: {e}") from None
    if port == 0:
        raise RuntimeError(f"Cannot bind the PS to {address!r}")
    for service in ("", SERVICE_NAME):
        health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    server.health = health_servicer
    return server, port


def _parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="prophet-tf ps",
        description="Run one parameter-server task. Describe it with --num-workers "
                    "(and --ps-index/--num-ps), or leave that out to read TF_CONFIG "
                    '(task type "ps").')
    parser.add_argument("--num-workers", type=int, default=None,
                        help="W, workers per step; when given, TF_CONFIG is ignored")
    parser.add_argument("--ps-index", type=int, default=None, help="this PS task (default 0)")
    parser.add_argument("--num-ps", type=int, default=None, help="PS tasks (default 1)")
    parser.add_argument("--host", default=None,
                        help="interface to bind (default 127.0.0.1 with flags, [::] with "
                             "TF_CONFIG)")
    parser.add_argument("--port", type=int, default=None,
                        help="port (0 = any free port; default: TF_CONFIG's, or 0)")
    parser.add_argument("--port-file", default=None,
                        help="write the bound port to this file once serving")
    parser.add_argument("--max-partition-bytes", type=int,
                        default=sharding.DEFAULT_MAX_PARTITION_BYTES,
                        help="split variables above this size (must match the workers)")
    parser.add_argument("--grace", type=float, default=5.0,
                        help="seconds in-flight RPCs get on SIGTERM/SIGINT")
    parser.add_argument("--worker-timeout", type=float, default=10.0, metavar="SECONDS",
                        help="a worker silent this long is lost: the job fails and this PS "
                             "exits 1 (workers send a heartbeat every second; default 10)")
    parser.add_argument("--worker-startup-timeout", type=float, default=300.0,
                        metavar="SECONDS",
                        help="once a worker has connected, every other one must within this "
                             "long, or the job fails (default 300)")
    parser.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                        help="save checkpoints here and restore the newest on start")
    parser.add_argument("--checkpoint-steps", type=int, default=None, metavar="N",
                        help="checkpoint every N steps (use the steps per epoch with Keras' "
                             "BackupAndRestore)")
    parser.add_argument("--checkpoint-secs", type=float, default=None, metavar="S",
                        help="checkpoint at most every S seconds (default 600 when no "
                             "--checkpoint-steps)")
    parser.add_argument("--checkpoint-keep", type=int, default=3, metavar="K",
                        help="keep the newest K checkpoints (default 3)")
    parser.add_argument("--token-file", default=None, metavar="PATH",
                        help="file holding the token every RPC must carry (default: "
                             f"${security.TOKEN_ENV} or ${security.TOKEN_FILE_ENV}; none: no "
                             "authentication)")
    parser.add_argument("--tls-cert", default=None, metavar="PEM",
                        help=f"serve TLS with this certificate chain (or ${security.TLS_CERT_ENV})")
    parser.add_argument("--tls-key", default=None, metavar="PEM",
                        help=f"the certificate's private key (or ${security.TLS_KEY_ENV})")
    parser.add_argument("--timeline", default=None, metavar="PATH",
                        help="on exit, write when each partition's sum completed, was "
                             "applied and answered (a Chrome trace; grows with the steps)")
    parser.add_argument("--insecure", action="store_true",
                        help="allow binding a non-loopback address without a token")
    return parser.parse_args(argv)


def _task_from_args(args):
    """(num_workers, ps_index, num_ps, host, port) from the flags or TF_CONFIG."""
    if args.num_workers is not None:
        task = (args.num_workers, args.ps_index or 0,
                args.num_ps if args.num_ps is not None else 1,
                args.host or "127.0.0.1", args.port if args.port is not None else 0)
    else:
        if args.ps_index is not None or args.num_ps is not None:
            raise ValueError("--ps-index/--num-ps go with --num-workers; with TF_CONFIG the "
                             "cluster spec says them. Received: "
                             f"--ps-index={args.ps_index}, --num-ps={args.num_ps}")
        if not os.environ.get("TF_CONFIG"):
            raise ValueError("Give --num-workers (and --ps-index/--num-ps) or set TF_CONFIG. "
                             "Received: no --num-workers, TF_CONFIG unset")
        from prophet_tf import cluster as cluster_lib

        config = cluster_lib.resolve()
        if config.task_type != "ps":
            raise ValueError('TF_CONFIG must describe a "ps" task for `prophet-tf ps`. '
                             f"Received: task type={config.task_type!r}, "
                             f"index={config.task_index}")
        own_port = int(config.ps[config.task_index].rpartition(":")[2])
        task = (config.num_workers, config.task_index, config.num_ps,
                args.host or "[::]", args.port if args.port is not None else own_port)
    num_workers, ps_index, num_ps, _, port = task
    if args.max_partition_bytes < 1:
        raise ValueError("--max-partition-bytes must be >= 1. "
                         f"Received: --max-partition-bytes={args.max_partition_bytes}")
    if num_workers < 1 or num_ps < 1 or not 0 <= ps_index < num_ps or not 0 <= port < 65536:
        raise ValueError("Need num_workers >= 1, num_ps >= 1, 0 <= ps_index < num_ps and a "
                         f"port in [0, 65535]. Received: num_workers={num_workers}, "
                         f"ps_index={ps_index}, num_ps={num_ps}, port={port}")
    return task


def _check_exposure(args, host: str, token: security.Token | None) -> None:
    """Refuses (ValueError) a non-loopback bind without a token unless --insecure."""
    if token is not None or security.is_loopback(host):
        return
    if args.insecure:
        logger.warning("serving on %s without a token (--insecure): anyone who reaches the "
                       "port can register a model and push gradients", host)
        return
    default = (" (the default with TF_CONFIG, whose workers are usually on other hosts)"
               if args.host is None else "")
    raise ValueError(
        f"refusing to serve on {host}{default} without a token: it is not a loopback address, "
        "so anyone who reaches the port could register a model and push gradients. Give "
        f"this PS and every worker the same token ({security.TOKEN_ENV}, "
        f"{security.TOKEN_FILE_ENV}, or --token-file PATH here), bind --host 127.0.0.1 for a "
        f"local cluster, or pass --insecure on a trusted network. Received: host={host}")


def _checkpoint_policy(args):
    """The --checkpoint-* flags as a policy (None without --checkpoint-dir)."""
    from prophet_tf.ps.checkpoint import CheckpointPolicy

    for flag in ("worker_timeout", "worker_startup_timeout"):
        if not getattr(args, flag) > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0. "
                             f"Received: {getattr(args, flag)}")
    if args.checkpoint_dir is None:
        given = [f for f in ("checkpoint_steps", "checkpoint_secs") if getattr(args, f)]
        if given:
            raise ValueError("--checkpoint-steps/--checkpoint-secs need --checkpoint-dir. "
                             f"Received: --{given[0].replace('_', '-')} without it")
        return None
    secs = args.checkpoint_secs
    if secs is None and args.checkpoint_steps is None:
        secs = 600.0
    try:
        return CheckpointPolicy(args.checkpoint_dir, every_steps=args.checkpoint_steps,
                                every_secs=secs, keep=args.checkpoint_keep)
    except ValueError as e:
        raise ValueError(f"bad --checkpoint-* flag: {e}") from None


def main(argv: list[str] | None = None) -> int:
    """Runs a PS task until SIGTERM/SIGINT; returns the exit code."""
    args = _parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=os.environ.get(environment.LOG_LEVEL, "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        num_workers, ps_index, num_ps, host, port = _task_from_args(args)
        token = security.load_token(token_file=args.token_file)
        tls = security.load_server_tls(args.tls_cert, args.tls_key)
        peers = security.peer_security(token, tls)
        _check_exposure(args, host, token)
    except ValueError as e:
        print(f"prophet-tf ps: {e}", file=sys.stderr)
        return 2
    try:
        checkpoint_policy = _checkpoint_policy(args)
    except ValueError as e:
        print(f"prophet-tf ps: {e}", file=sys.stderr)
        return 2
    if args.timeline and not os.path.isdir(os.path.dirname(os.path.abspath(args.timeline))):
        print(f"prophet-tf ps: --timeline must be in an existing directory (it is written "
              f"on exit). Received: --timeline {args.timeline}", file=sys.stderr)
        return 2
    codec.tune_allocator()
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())

    # The first Register imports Keras (registration.py), for its optimizers only:
    # not its scikit-learn or plotting integrations.
    lean_keras.skip_keras_integrations()

    failed = threading.Event()
    trace = PSTrace(ps_index) if args.timeline else None
    servicer = ParameterServerServicer(
        num_workers, ps_index, num_ps, max_partition_bytes=args.max_partition_bytes,
        max_chunk_bytes=protocol.MAX_CHUNK_BYTES,
        worker_timeout_s=args.worker_timeout,
        startup_timeout_s=args.worker_startup_timeout, checkpoint=checkpoint_policy,
        on_failure=lambda _message: failed.set(), trace=trace, peer_security=peers)
    try:
        server, bound = create_server(f"{host}:{port}", servicer, token=token, tls=tls)
    except RuntimeError as e:
        print(f"prophet-tf ps: {e}", file=sys.stderr)
        servicer.close()
        return 1
    server.start()
    logger.info("prophet-tf ps listening on %s:%d (ps %d of %d, %d workers; %s, %s)",
                host, bound, ps_index, num_ps, num_workers, "TLS" if tls else "plaintext",
                token or "no token")
    if args.port_file:
        tmp = f"{args.port_file}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(f"{bound}\n")
        os.replace(tmp, args.port_file)
    while not stop.wait(0.2):
        if failed.is_set():
            # Let the workers' heartbeats collect the reason, then exit 1.
            stop.wait(_FAILURE_LINGER_S)
            print(f"prophet-tf ps: {servicer.failure}", file=sys.stderr, flush=True)
            break
    logger.info("prophet-tf ps shutting down (grace %.1f s)", args.grace)
    server.health.enter_graceful_shutdown()
    server.stop(args.grace).wait()
    servicer.close()
    if trace:
        try:
            trace.write(args.timeline)
        except OSError as e:
            print(f"prophet-tf ps: could not write --timeline {args.timeline}: {e}",
                  file=sys.stderr)
            return 1
    return 1 if failed.is_set() else 0


if __name__ == "__main__":
    sys.exit(main())
