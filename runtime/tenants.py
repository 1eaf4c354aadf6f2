"""Tenants: who a client-facing caller is, named by the API key it presents.

An API key names a tenant. `--api-key-file` holds one `tenant:key` per line; a bare key (no
colon) is the tenant `default`, as is `--api-key` / $PDSERVE_API_KEY. Blank lines and `#`
comments are skipped. With no key configured every caller is `default` (an open router).

Invariants:
- A presented key is compared with every configured key, all of them and in constant
  time, over SHA-256 digests (equal lengths): how long a refusal takes tells nothing about
  which key came close, nor how long the keys are.
- Tenant names match `TENANT_NAME` ([A-Za-z0-9_.-], at most 64), so a name can be part of a
  node-side request id and a metric label; keys and tenants are unique in a file. An error
  names the file and line, never the key.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping

DEFAULT = "default"
TENANT_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def parse_key_file(text: str, source: str) -> dict[str, str]:
    """{tenant: key} of a key file's text; `source` names the file in errors."""
    keys: dict[str, str] = {}
    lines: dict[str, int] = {}  # key -> the line it was on, for the duplicate's error
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        tenant, colon, key = line.partition(":")
        tenant, key = (tenant.strip(), key.strip()) if colon else (DEFAULT, line)
        where = f"{source} line {number}"
        if not TENANT_NAME.fullmatch(tenant):
            raise ValueError(f"{where}: tenant name {tenant[:70]!r} must be 1 to 64 of "
                             "A-Z a-z 0-9 _ . - (write lines as `tenant:key`)")
        if not key:
            raise ValueError(f"{where}: tenant {tenant!r} has an empty key")
        if tenant in keys:
            raise ValueError(f"{where}: tenant {tenant!r} is named twice (give each tenant "
                             "one key)")
        if key in lines:
            raise ValueError(f"{where}: the same key as line {lines[key]} (each key names one "
                             "tenant)")
        keys[tenant], lines[key] = key, number
    if not keys:
        raise ValueError(f"{source} is empty: write one `tenant:key` (or bare key) per line")
    return keys


class KeyRing:
    """The configured keys, looked up by a presented key in constant time."""

    def __init__(self, keys: Mapping[str, str]) -> None:
        self.keys = dict(keys)
        self._digests = [(tenant, _digest(key)) for tenant, key in self.keys.items()]

    def tenant_of(self, presented: str | None) -> str | None:
        """The tenant whose key `presented` is, or None. Every key is compared: no early
        exit tells which one matched."""
        if presented is None:
            return None
        digest, found = _digest(presented), None
        for tenant, known in self._digests:
            if hmac.compare_digest(digest, known):
                found = tenant
        return found

    def __eq__(self, other) -> bool:
        return isinstance(other, KeyRing) and self.keys == other.keys

    def __repr__(self) -> str:  # never the keys themselves
        return f"KeyRing(tenants={sorted(self.keys)})"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()
