"""Who may call what on a pdserve node, enforced by one server interceptor that
`runtime.server.new_server` puts on every node.

- `pdserve.v1.Generation` (router, role-`both` node): with an API key (`--api-key`,
  `--api-key-file`, `$PDSERVE_API_KEY`) every call must carry `authorization: Bearer
  <key>`, else UNAUTHENTICATED. The router's OpenAI HTTP API checks the same keys. Each
  key names a tenant (runtime/tenants.py); `tenant_of` tells a service whose call it is.
- `pdserve.v1.Worker`: with a cluster key (runtime/cluster_key.py) every call must carry the
  token of a caller role, router or worker (else UNAUTHENTICATED), and each RPC admits only
  the roles in `WORKER_RPC_ROLES` (else PERMISSION_DENIED). With mutual TLS and
  `--tls-router-names`/`--tls-worker-names` the caller's certificate must also carry a name
  listed for its role: without a cluster key the listed name is what gives the role; with
  one it is a second check on the token's role.
- Health, reflection and the test-only Gates service stay open: probes hold no key.

Invariants: secrets are compared in constant time and never echoed in an error; a Worker
RPC nobody listed is refused, not open; with no API key, no cluster key and no name lists,
nothing is checked (an open cluster, as before; nodes say so at start). Settings are read
per call, so `configure` may come before or after the server is built.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

from pdserve.runtime import cluster_key, tenants, tls
from pdserve.runtime.errors import NodeError
from pdserve.runtime.bearer import bearer_of, presenting
from pdserve.runtime.options import option

ROUTER, WORKER = "router", "worker"
CALLER_ROLES = (ROUTER, WORKER)
GENERATION_SERVICE = "pdserve.v1.Generation"
WORKER_SERVICE = "pdserve.v1.Worker"
# Each Worker RPC, and the callers that need it. Routers drive requests and nodes; workers
# talk to each other only to set up and guard KV writes: a prefill node reads a decode
# node's transfer identity, a decode node fences a prefill node's writes. Agent metadata
# (GetTransferInfo) lets its holder read and write every registered page, so no router
# gets it.
WORKER_RPC_ROLES: dict[str, tuple[str, ...]] = {
    "PrepareReceive": (ROUTER,),
    "RemoteSend": (ROUTER,),
    "StartGeneration": (ROUTER,),
    "Abort": (ROUTER,),
    "DeliverWindow": (ROUTER,),
    "Drain": (ROUTER,),
    "GetLoad": (ROUTER, WORKER),
    "GetTransferInfo": (WORKER,),
    "FenceWrites": (WORKER,),
}
Refusal = tuple[grpc.StatusCode, str]


@dataclass(frozen=True)
class APIKeyConfig:
    api_key: str | None = option(
        None, "API key of the client-facing API (gRPC Generation, OpenAI HTTP), sent as "
              "`authorization: Bearer KEY`: a server requires it, a client sends it; other "
              "local users can read a flag in the process list, so prefer --api-key-file",
        type=str, metavar="KEY")
    api_key_file: str | None = option(
        None, "file holding the API keys, one `tenant:key` per line (a bare key is the "
              "tenant `default`; runtime/tenants.py); a client sends the one key of its file",
        type=str, metavar="PATH")

    def tenants(self) -> dict[str, str] | None:
        """{tenant: key} a server requires; None: no key, an open server."""
        if self.api_key and self.api_key_file:
            raise ValueError("give the API key once: --api-key (or $PDSERVE_API_KEY) or "
                             "--api-key-file, not both")
        if self.api_key_file:
            path = Path(self.api_key_file)
            if not path.is_file():
                raise ValueError(f"--api-key-file {self.api_key_file}: no such file")
            return tenants.parse_key_file(path.read_text(), f"--api-key-file {path}")
        return {tenants.DEFAULT: self.api_key} if self.api_key else None

    def load(self) -> str | None:
        """The one key a client sends: of a `tenant:key` line, the key part."""
        keys = self.tenants()
        if keys is not None and len(keys) > 1:
            raise ValueError(f"--api-key-file {self.api_key_file} holds the keys of "
                             f"{len(keys)} tenants; a client sends one: give it a file with "
                             "only its own line")
        return None if keys is None else next(iter(keys.values()))


@dataclass(frozen=True)
class Settings:
    role: str | None = None  # this process's caller role: the token its channels present
    api_keys: tenants.KeyRing | None = None  # what Generation callers present; None: open


_settings = Settings()


def configure(role: str | None, api_key: str | Mapping[str, str] | None = None) -> None:
    """Set once at start: this process's caller role and the API keys it requires, as
    {tenant: key} (one str: the tenant `default`'s)."""
    global _settings
    if role is not None and role not in CALLER_ROLES:
        raise ValueError(f"caller role must be one of {CALLER_ROLES}, got {role!r}")
    if isinstance(api_key, str):
        api_key = {tenants.DEFAULT: api_key}
    _settings = Settings(role, tenants.KeyRing(api_key) if api_key else None)


def current() -> Settings:
    return _settings


def outgoing_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """What `runtime.server.channel` installs: this process's role token, with a cluster
    key and a role; nothing otherwise."""
    key, role = cluster_key.current(), _settings.role
    return presenting(key.token(role)) if key.enabled and role else []


def tenant_of(metadata) -> str:
    """The tenant of a Generation call, by the API key it carries (`default` on a server
    with none). The interceptor refused a call with no valid key before it ran; one that
    got here without it anyway (a server built without the interceptor) is refused too."""
    keys = _settings.api_keys
    if keys is None:
        return tenants.DEFAULT
    tenant = keys.tenant_of(bearer_of(metadata))
    if tenant is None:
        raise NodeError("the API key sent is not this server's", grpc.StatusCode.UNAUTHENTICATED)
    return tenant


def check_api_key(method: str, metadata) -> Refusal | None:
    api_keys = _settings.api_keys
    if api_keys is None:
        return None
    presented = bearer_of(metadata)
    if presented is None:
        return (grpc.StatusCode.UNAUTHENTICATED,
                f"{method} needs the API key as `authorization: Bearer <key>` (pdserve "
                "generate --api-key-file, Client(api_key=...)); none was sent")
    if api_keys.tenant_of(presented) is None:
        return grpc.StatusCode.UNAUTHENTICATED, f"{method}: the API key sent is not this server's"
    return None


def check_worker_token(rpc: str, metadata) -> tuple[Refusal | None, str | None]:
    """(refusal, the caller's role by its token); both None without a cluster key."""
    key = cluster_key.current()
    if not key.enabled:
        return None, None
    token = bearer_of(metadata)
    if token is None:
        return (grpc.StatusCode.UNAUTHENTICATED,
                f"Worker/{rpc} needs this cluster's router or worker token "
                "(`authorization: Bearer`, from the cluster key); none was sent"), None
    role = key.role_of(token, CALLER_ROLES)
    if role is None:
        return (grpc.StatusCode.UNAUTHENTICATED,
                f"Worker/{rpc}: the token sent is no router's or worker's of this cluster "
                "(another cluster key?)"), None
    return _role_refusal(rpc, role, "its token"), role


def check_certificate(rpc: str, token_role: str | None, names: set[str],
                      allowed: dict[str, frozenset[str]]) -> Refusal | None:
    """The caller's certificate `names` against the allowed names per role (`allowed`)."""
    shown = sorted(names) or "(no certificate)"
    roles = [r for r in CALLER_ROLES if names & allowed.get(r, frozenset())]
    if not roles:
        return (grpc.StatusCode.PERMISSION_DENIED,
                f"Worker/{rpc}: certificate names {shown} are in neither --tls-router-names "
                "nor --tls-worker-names")
    if token_role is not None:
        if token_role in roles:
            return None
        return (grpc.StatusCode.PERMISSION_DENIED,
                f"Worker/{rpc}: the caller presents a {token_role} token, but its certificate "
                f"names {shown} are not in --tls-{token_role}-names")
    permitted = [r for r in roles if r in WORKER_RPC_ROLES.get(rpc, ())]
    return None if permitted else _role_refusal(rpc, roles[0], f"its certificate names {shown}")


def _unlisted(rpc: str) -> Refusal:
    return grpc.StatusCode.PERMISSION_DENIED, f"Worker/{rpc} is no RPC any caller may make"


def _role_refusal(rpc: str, role: str, evidence: str) -> Refusal | None:
    allowed = WORKER_RPC_ROLES.get(rpc)
    if allowed is None:
        return _unlisted(rpc)
    if role in allowed:
        return None
    return (grpc.StatusCode.PERMISSION_DENIED,
            f"Worker/{rpc} is for {' and '.join(allowed)} callers only; this caller is a "
            f"{role} (by {evidence})")


def certificate_names(context) -> set[str]:
    """The common and subject-alternative names of the caller's certificate (mutual TLS)."""
    found = context.auth_context() or {}
    return {v.decode() if isinstance(v, bytes) else v
            for key in ("x509_common_name", "x509_subject_alternative_name")
            for v in found.get(key, ())}


def caller_of(context) -> str:
    """Who is calling, for per-caller bounds: its certificate's name under mutual TLS, else
    its host (`ipv4:10.0.0.5`; a port is per connection, a host is not)."""
    names = certificate_names(context)
    if names:
        return f"tls:{min(names)}"
    peer = context.peer() or ""
    return peer.rsplit(":", 1)[0] if peer.startswith(("ipv4:", "ipv6:")) else peer


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Admits each call by the rules in the module docstring; a refused call gets a handler
    that aborts with the refusal, whatever its kind (unary or streaming)."""

    async def intercept_service(self, continuation, details):
        service, _, rpc = details.method.lstrip("/").rpartition("/")
        if service == GENERATION_SERVICE:
            refusal = check_api_key(f"{service}/{rpc}", details.invocation_metadata)
            handler = await continuation(details)
            return _refusing(handler, refusal) if refusal else handler
        if service != WORKER_SERVICE:
            return await continuation(details)
        refusal, role = check_worker_token(rpc, details.invocation_metadata)
        handler = await continuation(details)
        if refusal is not None:
            return _refusing(handler, refusal)
        allowed = tls.current().caller_names()
        if not allowed:
            return handler
        if rpc not in WORKER_RPC_ROLES:
            return _refusing(handler, _unlisted(rpc))
        if handler is None:
            return None
        return _checked(handler, lambda context: check_certificate(
            rpc, role, certificate_names(context), allowed))


def _kind(handler: grpc.RpcMethodHandler) -> str:
    return ("stream" if handler.request_streaming else "unary") + "_" + \
        ("stream" if handler.response_streaming else "unary")


def _refusing(handler: grpc.RpcMethodHandler | None, refusal: Refusal) -> grpc.RpcMethodHandler:
    """A handler that refuses before the request is read, whatever the RPC's kind (an RPC
    this server does not serve included: refused, not UNIMPLEMENTED). As a stream-request
    handler with no deserializer that never reads, grpc neither buffers nor parses the
    message, so an unauthenticated caller costs no memory for it and garbage bytes get
    UNAUTHENTICATED, not a parse error (docs/operations.md, Transport limits)."""
    async def refuse(requests, context):  # a coroutine: grpc awaits it, reads nothing
        await context.abort(*refusal)

    return grpc.stream_stream_rpc_method_handler(refuse)


def _checked(handler: grpc.RpcMethodHandler, check) -> grpc.RpcMethodHandler:
    """`handler` behind `check(context)`, which may refuse the call before it runs."""
    kind = _kind(handler)
    behavior = getattr(handler, kind)
    if inspect.isasyncgenfunction(behavior):  # grpc iterates these, awaits the others
        async def checked(request, context):
            refusal = check(context)
            if refusal is not None:
                await context.abort(*refusal)
            async for message in behavior(request, context):
                yield message
    else:
        async def checked(request, context):
            refusal = check(context)
            if refusal is not None:
                await context.abort(*refusal)
            return await behavior(request, context)
    return handler._replace(**{kind: checked})
