"""Who calls the router's HTTP API, and how its errors are written.

- A caller's key comes as `Authorization: Bearer <key>` (OpenAI's clients) or `x-api-key:
  <key>` (Anthropic's); it names the caller's tenant (runtime/tenants.py). Without keys
  configured every caller is the tenant `default`; probes and scrapers (/health, /metrics,
  /version) need none. A missing or wrong key is a 401 that never echoes the key.
- An error is OpenAI's `{"error": {...}}`, or Anthropic's to an Anthropic caller (on its
  /v1/messages routes, or sending its `anthropic-version` header; router/anthropic_api.py),
  with the same status.
"""

from __future__ import annotations

from aiohttp import web

from pdserve.runtime import tenants

from . import anthropic_api
from .openai_protocol import OpenAIError

OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})


def tenant_of(request: web.Request, api_keys: tenants.KeyRing | None) -> str:
    """The caller's tenant, by its key; a 401 OpenAIError without a valid one."""
    if api_keys is None or request.path in OPEN_PATHS:
        return tenants.DEFAULT
    scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
    if "x-api-key" in request.headers:
        scheme, presented = "bearer", request.headers["x-api-key"]
    if scheme.lower() != "bearer" or not presented.strip():
        raise OpenAIError(401, "You didn't provide an API key: send it as `Authorization: Bearer <key>` "
                               "(or `x-api-key: <key>`).", code="missing_api_key")
    tenant = api_keys.tenant_of(presented.strip())
    if tenant is None:
        raise OpenAIError(401, "Incorrect API key provided.", code="invalid_api_key")
    return tenant


def speaks_anthropic(request: web.Request) -> bool:
    return request.path.startswith("/v1/messages") or "anthropic-version" in request.headers


def error_body(request: web.Request, err: OpenAIError) -> dict:
    return anthropic_api.error_body(err) if speaks_anthropic(request) else err.body()
