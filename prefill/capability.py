"""Which windows a prefill node may write: D's signature, its age, and leases spent here.

- `check_capability`: with a cluster key, the window must carry D's HMAC over exactly what
  it names (runtime/cluster_key.py `window_fields`), issued no longer ago than
  `max_age_s` by our wall clock against D's. The age bound only limits how long a copied
  window could be replayed after this node forgot it; it is far wider than any clock skew,
  and no page's safety rests on it (D reuses pages only on proof, decode/quarantine.py).
- `SpentLeases`: a lease whose window was used, or that D fenced, is never written again
  here. Bounded (oldest forgotten first), so memory stays flat.
Every refusal is `CapabilityRefused` (PERMISSION_DENIED), raised before anything runs.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import grpc

from pdserve.runtime import cluster_key
from pdserve.runtime.errors import NodeError

MAX_SPENT = 65536


class CapabilityRefused(NodeError):
    """The window's capability is forged, altered, replayed, expired or fenced."""

    code = grpc.StatusCode.PERMISSION_DENIED


def check_capability(request_id: str, end: int, window, max_age_s: float) -> None:
    key = cluster_key.current()
    if not key.enabled:
        return
    fields = cluster_key.window_fields(
        request_id, window.lease_id, window.begin, end, window.kv_append_metadata,
        window.decode.agent_name, window.lease_ms, window.issued_unix_ms)
    if not key.verify(window.capability, *fields):
        raise CapabilityRefused(f"the window of request {request_id!r} (lease "
                                f"{window.lease_id!r}) does not carry a valid capability from "
                                "its decode node; nothing was written")
    age_s = time.time() - window.issued_unix_ms / 1000
    if age_s > max_age_s:
        raise CapabilityRefused(f"the window of request {request_id!r} was issued {age_s:.0f} s "
                                f"ago, more than max_window_age_s {max_age_s:g}; nothing was "
                                "written")


class SpentLeases:
    def __init__(self, bound: int = MAX_SPENT) -> None:
        self.bound = bound
        self._spent: OrderedDict[tuple[str, str], str] = OrderedDict()  # -> "used" | "fenced"

    def check(self, request_id: str, lease_id: str) -> None:
        how = self._spent.get((request_id, lease_id))
        if how is not None:
            raise CapabilityRefused(f"the window of lease {lease_id!r} (request {request_id!r}) "
                                    f"was {how} already; nothing was written")

    def add(self, request_id: str, lease_id: str, how: str) -> None:
        self._spent.setdefault((request_id, lease_id), how)
        while len(self._spent) > self.bound:
            self._spent.popitem(last=False)
