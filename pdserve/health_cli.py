"""`pdserve health`: exit 0 if a node's gRPC health service says SERVING.

It is what the container health checks run (deploy/: the Dockerfile's HEALTHCHECK, the
compose healthchecks, the Kubernetes exec probes), inside the node's own container and with
no arguments: it asks 127.0.0.1 on $PDSERVE_PORT. It takes the serving commands' TLS flags,
so their variables (PDSERVE_TLS_CA, PDSERVE_TLS_CERT, PDSERVE_TLS_KEY), which the container
already sets for its node, make it speak TLS to a TLS node and present the node's own
certificate to one that requires client certificates (mutual TLS). Kubernetes' built-in
grpc probe can do neither, hence exec probes there.

As on every channel a node opens (runtime.server.channel), the server's certificate is
checked against the address asked, never against an overridden name: a node's certificate
must also be valid for 127.0.0.1 (or localhost, with `--server localhost:PORT`) for its
health check to pass.
"""

from __future__ import annotations

import argparse
import os
import sys


def add_health_parser(sub) -> None:
    """The `health` subcommand, on `pdserve`'s subparsers."""
    from pdserve.runtime.options import add_options
    from pdserve.runtime.tls import TLSConfig

    p = sub.add_parser("health", help="exit 0 if a node's gRPC health service says SERVING "
                                      "(container health checks)")
    p.add_argument("--server", default=None, metavar="HOST:PORT",
                   help="node to ask (default: 127.0.0.1 and $PDSERVE_PORT, else 50051)")
    p.add_argument("--service", default="",
                   help="service name to check; empty = the whole node (default: empty)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds (default: %(default)s)")
    add_options(p.add_argument_group(
        "TLS (runtime/tls.py; in a container, its node's PDSERVE_TLS_* variables)",
        "--tls-ca turns TLS on; --tls-cert/--tls-key are presented to a node that requires "
        "client certificates"), TLSConfig)
    p.set_defaults(func=cmd_health)


def cmd_health(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from pdserve.credentials import configure_tls
    from pdserve.runtime import tls

    configure_tls(args)
    server = args.server or f"127.0.0.1:{os.environ.get('PDSERVE_PORT', '50051')}"
    credentials = tls.channel_credentials()
    try:
        with (grpc.secure_channel(server, credentials) if credentials is not None
              else grpc.insecure_channel(server)) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
    except grpc.RpcError as err:
        hint = _tls_hint(tls.current(), server) if err.code() in (
            grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) else ""
        print(f"{server}: {err.code().name}: {err.details()}{hint}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{server}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def _tls_hint(config, server: str) -> str:
    """What to check when no answer came: gRPC reports a TLS mismatch only as a connection
    that failed, the same as a node that is down."""
    host = server.rsplit(":", 1)[0]
    if not config.ca:
        return ("\n  (asked in plaintext: if the node serves TLS, set --tls-ca "
                "[PDSERVE_TLS_CA], and --tls-cert/--tls-key [PDSERVE_TLS_CERT, PDSERVE_TLS_KEY] "
                "if it requires client certificates)")
    if not config.cert:
        return (f"\n  (asked over TLS without a client certificate: if the node requires one, "
                f"set --tls-cert/--tls-key [PDSERVE_TLS_CERT, PDSERVE_TLS_KEY]; the node's "
                f"certificate must be signed by --tls-ca and valid for {host})")
    return (f"\n  (asked over mutual TLS: the node's certificate must be signed by --tls-ca "
            f"and valid for {host}, and --tls-cert signed by the CA the node trusts)")
