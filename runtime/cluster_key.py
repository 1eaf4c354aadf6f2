"""The cluster key: one secret shared by a cluster's workers and routers.

One `ClusterKey` per process, set once at start from `--cluster-key-file` or the
`PDSERVE_CLUSTER_KEY` environment variable (`configure`), like `runtime.tls`. Two uses:
- **Capabilities** (`sign`, `verify`): a decode node signs each KV window it hands out
  (lease, slots, duration, writer); a prefill node writes only windows whose signature
  checks, so nobody without the key can aim a one-sided write at a page.
- **Caller tokens** (`token(role)`): a process presents `token("router")` or
  `token("worker")` as a bearer token on every Worker call; the callee checks it in
  constant time and lets each RPC in only from the role that needs it (runtime/auth.py).
Invariants: the raw key never leaves the process; signatures are HMAC-SHA256 over a
length-prefixed encoding of the fields, so no two field lists encode alike; comparisons
use `hmac.compare_digest`. Without a key, nothing is signed or checked (an open cluster,
as before), and nodes say so at start.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass
from pathlib import Path

from pdserve.runtime.options import option

ENV = "PDSERVE_CLUSTER_KEY"
MIN_KEY_BYTES = 16


@dataclass(frozen=True)
class ClusterKeyConfig:
    key_file: str | None = option(
        None, f"file holding the cluster's shared secret (default: ${ENV}); workers then sign "
              "and check KV windows and accept Worker calls only from routers and workers "
              "that hold it", flag="--cluster-key-file", type=str, metavar="PATH")

    def load(self) -> bytes | None:
        if self.key_file:
            path = Path(self.key_file)
            if not path.is_file():
                raise ValueError(f"--cluster-key-file {self.key_file}: no such file")
            raw = path.read_bytes().strip()
        else:
            raw = os.environ.get(ENV, "").encode().strip()
        if not raw:
            return None
        if len(raw) < MIN_KEY_BYTES:
            raise ValueError(f"the cluster key must be at least {MIN_KEY_BYTES} bytes, "
                             f"got {len(raw)}")
        return raw


class ClusterKey:
    def __init__(self, secret: bytes | None) -> None:
        self._secret = secret

    @property
    def enabled(self) -> bool:
        return self._secret is not None

    def _mac(self, purpose: bytes, fields: tuple) -> bytes:
        mac = hmac.new(self._secret, purpose, hashlib.sha256)
        for value in fields:
            data = value if isinstance(value, bytes) else str(value).encode()
            mac.update(len(data).to_bytes(8, "little"))
            mac.update(data)
        return mac.digest()

    def sign(self, *fields) -> bytes:
        """The capability over `fields` (empty without a key)."""
        return self._mac(b"pdserve-capability", fields) if self.enabled else b""

    def verify(self, signature: bytes, *fields) -> bool:
        """Whether `signature` is this cluster's capability over `fields` (True without a
        key: an open cluster checks nothing)."""
        return not self.enabled or hmac.compare_digest(signature, self.sign(*fields))

    def token(self, role: str) -> str:
        """The bearer token a `role` process presents on Worker calls ('' without a key)."""
        return self._mac(b"pdserve-token", (role,)).hex() if self.enabled else ""

    def role_of(self, token: str, roles: tuple[str, ...]) -> str | None:
        """Which of `roles` presented `token` (constant time per role), or None."""
        found = None
        for role in roles:
            if hmac.compare_digest(token.encode(), self.token(role).encode()):
                found = role
        return found


_key = ClusterKey(None)


def configure(config: ClusterKeyConfig) -> ClusterKey:
    global _key
    _key = ClusterKey(config.load())
    return _key


def current() -> ClusterKey:
    return _key


def window_fields(request_id: str, lease_id: str, begin: int, end: int,
                  kv_append_metadata, decode_agent_name: str, lease_ms: int,
                  issued_unix_ms: int) -> tuple:
    """What a KV window's capability covers, in one order for the signer and the checker."""
    return (request_id, lease_id, begin, end, ",".join(map(str, kv_append_metadata)),
            decode_agent_name, lease_ms, issued_unix_ms)
