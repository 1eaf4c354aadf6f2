"""Optional TLS for every gRPC endpoint and every channel a node opens.

One `TLSConfig` per process, set once at start from the `--tls-*` flags (`configure`);
`server_credentials()` and `channel_credentials()` read it, so the code that binds ports
and opens channels (`runtime.server`) needs no TLS arguments threaded through it.
- `cert`/`key`: this node's certificate; served on its endpoint, and presented to the
  nodes it calls when they require client certificates (mutual TLS).
- `ca`: the CA that signed the certificates of the nodes this process calls.
- `require_client_cert`: the server only accepts callers whose certificate `ca` signed
  (workers use it so that only the router and their peers may call them).
- `router_names`/`worker_names`: with mutual TLS, the certificate names (CN or SAN) a
  Worker caller must have to act as a router or a worker; any other CA-signed certificate
  is refused (runtime/auth.py). Without them, any certificate `ca` signed may make every call.
The HTTP port (runtime/http.py) serves HTTPS with the same certificate
(`http_ssl_context`). Without a config everything is plaintext, as before.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

from pdserve.runtime.options import option


@dataclass(frozen=True)
class TLSConfig:
    cert: str | None = option(
        None, "this node's certificate: served on its endpoint and presented to the nodes it "
              "calls (mutual TLS)", flag="--tls-cert", type=str, metavar="PEM")
    key: str | None = option(None, "private key of --tls-cert", flag="--tls-key", type=str,
                             metavar="PEM")
    ca: str | None = option(
        None, "CA that signed the certificates of the nodes this process calls; setting it "
              "turns on TLS for outgoing channels", flag="--tls-ca", type=str, metavar="PEM")
    require_client_cert: bool = option(
        False, "accept only callers with a certificate signed by --tls-ca (workers: only the "
               "router and peer workers may call)", flag="--tls-require-client-cert")
    router_names: list[str] = option(
        help="with --tls-require-client-cert: certificate names (CN or SAN) that may call "
             "this node's Worker RPCs as a router (repeat or comma-separate); with "
             "--tls-worker-names, every other certificate is refused",
        flag="--tls-router-names", metavar="NAME", default_factory=list)
    worker_names: list[str] = option(
        help="certificate names that may call Worker RPCs as a peer worker (see "
             "--tls-router-names)", flag="--tls-worker-names", metavar="NAME",
        default_factory=list)

    def validate(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.require_client_cert and not (self.ca and self.cert):
            raise ValueError("--tls-require-client-cert needs --tls-ca and --tls-cert/--tls-key")
        if bool(self.router_names) != bool(self.worker_names):
            raise ValueError("--tls-router-names and --tls-worker-names go together (a node "
                             "takes calls from routers and from peer workers)")
        if self.router_names and not self.require_client_cert:
            raise ValueError("--tls-router-names/--tls-worker-names need "
                             "--tls-require-client-cert (the names are the caller's certificate's)")
        for path in (self.cert, self.key, self.ca):
            if path and not Path(path).is_file():
                raise ValueError(f"TLS file not found: {path}")

    def caller_names(self) -> dict[str, frozenset[str]]:
        """The allowed certificate names per caller role; empty when not restricted."""
        if not self.router_names:
            return {}
        return {role: frozenset(n for v in values for n in v.split(",") if n)
                for role, values in (("router", self.router_names),
                                     ("worker", self.worker_names))}


_config = TLSConfig()


def configure(config: TLSConfig) -> None:
    global _config
    config.validate()
    _config = config


def current() -> TLSConfig:
    return _config


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


def server_credentials() -> grpc.ServerCredentials | None:
    """Credentials for this node's endpoint, or None to serve plaintext."""
    c = _config
    if not c.cert:
        return None
    return grpc.ssl_server_credentials(
        [(_read(c.key), _read(c.cert))],
        root_certificates=_read(c.ca) if c.require_client_cert else None,
        require_client_auth=c.require_client_cert)


def channel_credentials() -> grpc.ChannelCredentials | None:
    """Credentials for channels this node opens, or None for plaintext (no --tls-ca)."""
    c = _config
    if not c.ca:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=_read(c.ca), private_key=_read(c.key), certificate_chain=_read(c.cert))


def http_client_ssl_context() -> ssl.SSLContext:
    """For HTTPS this node asks (another router's port, router/peers.py): the server's
    certificate checked against --tls-ca (the system's roots without one), this node's own
    presented when it has one."""
    c = _config
    context = ssl.create_default_context(cafile=c.ca or None)
    if c.cert:
        context.load_cert_chain(c.cert, c.key)
    return context


def http_ssl_context() -> ssl.SSLContext | None:
    """The HTTP port's TLS (runtime/http.py): this node's certificate, or None without one.
    It asks for client certificates exactly when the gRPC port does
    (`--tls-require-client-cert`): a node closed to callers without a CA-signed certificate
    opens no second door. A router's clients are usually people with an API key, so a
    router normally serves server-authenticated TLS and checks the key."""
    c = _config
    if not c.cert:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(c.cert, c.key)
    if c.require_client_cert:
        context.load_verify_locations(c.ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context
