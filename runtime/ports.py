"""The ports a server command will listen on, checked when it starts, before it loads a
model: a clash (another pdserve still running, say) ends the command with one line naming
the port and its flag, not with a model load and then a bind traceback.

Each port is bound the way the servers bind it (SO_REUSEADDR, as gRPC and aiohttp do, so a
port a stopped node left in TIME_WAIT counts as free) and let go at once. A process that
takes a port between this check and the server's bind still fails there, with one line too
(`runtime.server.serve`, `runtime.http.start_http`).
"""

from __future__ import annotations

import socket


def in_use(host: str, port: int) -> str | None:
    """Why `host:port` cannot be listened on now (the system's words), or None."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        return f"cannot resolve {host!r}: {err.strerror}"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
            probe.listen(1)
        except OSError as err:
            return err.strerror or str(err)
    return None


def first_clash(binds: list[tuple[str, int | None, str]]) -> str | None:
    """One line naming the first of `binds` (host, port, the flag that set it) that cannot
    be listened on; ports 0 or None (picked when the server starts) are not checked."""
    for host, port, flag in binds:
        if port and (why := in_use(host, port)):
            hint = f"; is another pdserve running? Stop it or pick another port with {flag}" \
                if "in use" in why else ""
            return f"cannot listen on {host}:{port} ({flag}): {why}{hint}"
    return None
