"""The prefix-cache salt a request runs under: which other requests' cached pages it may
share, on the router's prefix index and on every node's prefix cache.

A node's prefix cache answers "how much of this prompt was seen before" (it shows in
`usage.cached_prompt_tokens`, `route.prefix_matched_length` and in the time to the first
token), so a shared cache lets one caller test guesses of another's prompt. The salt seeds
the page-key chain (engine/prefix_cache.py, router/prefix_index.py): requests share cached
pages only under equal salts.

Invariants:
- By default every tenant has its own salt: `tenant` followed by NUL and the client's
  `cache_salt` (as in vLLM's API, it splits a tenant's cache further). Tenant names hold no
  NUL (runtime/tenants.py `TENANT_NAME`), so no client salt of one tenant spells another's.
- The tenant `default` without a client salt keeps the empty salt, the unsalted keys: an
  open cluster (no API keys) caches as it did before tenants.
- `--shared-prefix-cache` (the operator's choice) drops the tenant: the salt is the
  client's alone, and tenants sharing one see each other's cached prefixes.
- A request of a LoRA adapter ends its salt with NUL, `lora:` and the adapter's name: the
  same tokens have other KV under another adapter (the engine salts its pages so too).
"""

from __future__ import annotations

from pdserve.runtime.tenants import DEFAULT


def effective_salt(tenant: str, cache_salt: str = "", shared: bool = False, lora: str = "") -> str:
    """The salt the nodes match and publish the request's pages under."""
    if not isinstance(cache_salt, str):
        raise ValueError(f"cache_salt must be a string, got {cache_salt!r}")
    adapter = f"\x00lora:{lora}" if lora else ""
    if shared or (tenant == DEFAULT and not cache_salt):
        return cache_salt + adapter
    return f"{tenant}\x00{cache_salt}{adapter}"
