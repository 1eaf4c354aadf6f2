"""gRPC server plumbing shared by every node: uvloop, health, reflection, clean shutdown.

Every pdserve node (router, prefill, decode, both) runs one `grpc.aio` server on uvloop
with the standard health service (`grpc.health.v1.Health`) and server reflection. On
SIGTERM or SIGINT the health status turns NOT_SERVING, the node drains (its roles refuse
new work while in-flight requests finish, bounded), the server stops taking calls and gives
what is left `grace_s`, then the node's own cleanup runs. Endpoints and channels use TLS
when `runtime.tls` is configured (`--tls-*` flags). Every server admits calls through
`runtime.auth` (API key, cluster key, certificate names), and every channel presents this
process's cluster token when it has one: nodes open channels only through `channel()`.

The first line a node prints on stdout is `pdserve <role> listening on HOST:PORT`, with the
port actually bound, so `--port 0` works for tests and `pdserve up`, then in brackets
what an operator should know of its start (a worker: whether its C kernels run).
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve import process_gc
from pdserve.runtime import auth, tls
from pdserve.runtime.options import option

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


@dataclass
class ServerConfig:
    """Where a node listens and how it stops (every node: router and workers)."""

    host: str = option("0.0.0.0", "address to bind")
    port: int = option(50051, "gRPC port; 0 picks a free one")
    drain_timeout_s: float = option(
        30.0, "on SIGTERM, how long in-flight requests may take to finish while no new work "
              "is accepted")


def new_server() -> grpc.aio.Server:
    """A server whose port no second process can share while it lives (no SO_REUSEPORT,
    which gRPC turns on by default): whoever answers at a node's address is that node, or
    took the port after it died (decode/fence.py relies on it).

    No BDP probing: it widens each stream's receive window to megabytes, which a call
    refused before it is read (runtime/auth.py) still fills; the fixed 64 KB window bounds
    what an unauthenticated caller costs. The messages a node takes are small (the KV moves
    over NIXL), so the fixed window costs them nothing."""
    return grpc.aio.server(options=GRPC_OPTIONS + [("grpc.so_reuseport", 0),
                                                   ("grpc.http2.bdp_probe", 0)],
                           interceptors=[auth.AuthInterceptor()])


def channel(address: str, own_connections: bool = False) -> grpc.aio.Channel:
    """A client channel with the same message limits as the servers (TLS when
    `runtime.tls` is configured), presenting this process's cluster token on every call
    when it has one (`runtime.auth`). `own_connections`: do not share connections (and their
    reconnect backoff) with other channels to the same address."""
    options = GRPC_OPTIONS + ([("grpc.use_local_subchannel_pool", 1)] if own_connections else [])
    interceptors = auth.outgoing_interceptors() or None
    credentials = tls.channel_credentials()
    if credentials is not None:
        return grpc.aio.secure_channel(address, credentials, options=options,
                                       interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)


async def wait_idle(idle: Callable[[], bool], timeout_s: float, poll_s: float = 0.05) -> bool:
    """Wait until `idle()` or `timeout_s` passes; whether it became idle (drain)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not idle():
        if asyncio.get_running_loop().time() >= deadline:
            return False
        await asyncio.sleep(poll_s)
    return True


async def serve(
    server: grpc.aio.Server,
    *,
    role: str,
    host: str,
    port: int,
    service_names: Iterable[str],
    on_stop: Callable[[], Awaitable[None]] | None = None,
    grace_s: float = 5.0,
    drain: Callable[[], Awaitable[None]] | None = None,
    on_start: Callable[[int], Awaitable[None]] | None = None,
    stop: asyncio.Event | None = None,
    note: str = "",
) -> None:
    """Start `server` (its servicers already added) and run it until SIGTERM/SIGINT, or
    until `stop` is set (a Drain RPC). `on_start(port)` runs once the server serves, before
    the "listening" line (discovery registration). `drain` starts as soon as the stop is
    asked for: its first step (before its first await) refuses new work, so by the time
    health says NOT_SERVING nothing new is taken; then it waits (bounded) for in-flight
    requests to finish before the server stops."""
    names = list(service_names)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME],
        server,
    )
    credentials = tls.server_credentials()
    try:  # a clash is found before the model loads (runtime/ports.py), unless a race wins
        bound = server.add_secure_port(f"{host}:{port}", credentials) if credentials is not None \
            else server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:  # grpcio raises where it once returned 0
        bound = 0
    if bound == 0:
        raise SystemExit(f"pdserve {role}: cannot bind {host}:{port}")
    await server.start()
    for name in ["", *names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    if on_start is not None:
        await on_start(bound)
    process_gc.serving()
    print(f"pdserve {role} listening on {host}:{bound}" + (f" ({note})" if note else ""), flush=True)

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    drained = asyncio.ensure_future(drain()) if drain is not None else None
    await asyncio.sleep(0)  # the drain's first step runs now: no new work from here on
    for name in ["", *names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    if drained is not None:
        await drained
    await server.stop(grace_s)
    if on_stop is not None:
        await on_stop()
    print(f"pdserve {role} stopped", file=sys.stderr, flush=True)


def run(main: Awaitable[None]) -> None:
    """Run a server coroutine on uvloop."""
    import uvloop

    uvloop.run(main)
