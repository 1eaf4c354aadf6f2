"""Who may call what on a pdserve node, enforced by one server interceptor that
`runtime.server.new_server` puts on every node.

- `pdserve.v1.Generation` (router, role-`both` node): with an API key (`--api-key`,
  `--api-key-file`, `$PDSERVE_API_KEY`) every call must carry `authorization: Bearer
  <key>`, else UNAUTHENTICATED. The router's OpenAI HTTP API checks the same key.
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

import hmac
import inspect
from dataclasses import dataclass
from pathlib import Path

import grpc

from pdserve.runtime import cluster_key, tls
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
        None, "file holding the API key (see --api-key)", type=str, metavar="PATH")

    def load(self) -> str | None:
        if self.api_key and self.api_key_file:
            raise ValueError("give the API key once: --api-key (or $PDSERVE_API_KEY) or "
                             "--api-key-file, not both")
        if self.api_key_file:
            path = Path(self.api_key_file)
            if not path.is_file():
                raise ValueError(f"--api-key-file {self.api_key_file}: no such file")
            key = path.read_text().strip()
            if not key:
                raise ValueError(f"--api-key-file {self.api_key_file} is empty")
            return key
        return self.api_key or None


@dataclass(frozen=True)
class Settings:
    role: str | None = None  # this process's caller role: the token its channels present
    api_key: str | None = None  # what Generation callers must present; None: open


_settings = Settings()


def configure(role: str | None, api_key: str | None = None) -> None:
    """Set once at start: this process's caller role and the API key it requires."""
    global _settings
    if role is not None and role not in CALLER_ROLES:
        raise ValueError(f"caller role must be one of {CALLER_ROLES}, got {role!r}")
    _settings = Settings(role, api_key)


def current() -> Settings:
    return _settings


def outgoing_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """What `runtime.server.channel` installs: this process's role token, with a cluster
    key and a role; nothing otherwise."""
    key, role = cluster_key.current(), _settings.role
    return presenting(key.token(role)) if key.enabled and role else []


def api_key_matches(presented: str | None, api_key: str) -> bool:
    return presented is not None and hmac.compare_digest(presented.encode(), api_key.encode())


def check_api_key(method: str, metadata) -> Refusal | None:
    api_key = _settings.api_key
    if api_key is None:
        return None
    presented = bearer_of(metadata)
    if presented is None:
        return (grpc.StatusCode.UNAUTHENTICATED,
                f"{method} needs the API key as `authorization: Bearer <key>` (pdserve "
                "generate --api-key-file, Client(api_key=...)); none was sent")
    if not api_key_matches(presented, api_key):
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
    async def refuse(request, context):  # a coroutine, so grpc awaits it for every kind
        await context.abort(*refusal)

    if handler is None:  # an RPC this server does not serve: refused, not UNIMPLEMENTED
        return grpc.unary_unary_rpc_method_handler(refuse)
    return handler._replace(**{_kind(handler): refuse})


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
