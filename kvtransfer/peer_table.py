"""`PeerTable`: the peers one NIXL agent writes to, and what their descriptors need.

Invariants:
- A peer's metadata is loaded into NIXL once per distinct blob (keyed by its digest), and
  reused; new metadata under a known name (the peer restarted) replaces the stale entry,
  its regions and memory kind too, instead of failing (NIXL refuses to overwrite a name).
- A peer's regions (``(addr, nbytes, device id)``) give each destination descriptor the
  device id of the region holding it; its memory kind ("DRAM"/"VRAM") names the
  descriptors' kind, as NIXL finds a peer's registration by it (a GPU pool may write into
  a CPU one). Either left out, the agent's own stands in.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .regions import RegionTable


class PeerLoadError(RuntimeError):
    """NIXL could not load a peer's metadata."""


@dataclass
class Peer:
    digest: str  # of its loaded metadata
    regions: RegionTable | None = None  # None: added without its regions
    mem: Any = None  # its NIXL memory kind (a nixl._bindings segment type); None: the agent's


def agent_name(metadata: bytes) -> str | None:
    """The agent name inside NIXL metadata (``nixlSerDes|Agent`` + u64 length + name)."""
    head = b"nixlSerDes|Agent"
    if not metadata.startswith(head) or len(metadata) < len(head) + 8:
        return None
    n = int.from_bytes(metadata[len(head) : len(head) + 8], "little")
    raw = metadata[len(head) + 8 : len(head) + 8 + n]
    return raw.decode(errors="replace") if len(raw) == n else None


class PeerTable:
    def __init__(self, nixl_agent: Any, kinds: dict[str, Any]):
        """`kinds`: NIXL's segment type of each memory kind name ("DRAM", "VRAM")."""
        self._agent, self._kinds = nixl_agent, kinds
        self._lock = threading.Lock()
        self._peers: dict[str, Peer] = {}  # by remote agent name

    def add(self, metadata: bytes, regions: Sequence[tuple[int, int, int]] | None, memory_kind: str) -> str:
        """The peer's agent name, its metadata loaded if new; `regions` and `memory_kind`
        (when given) replace what was known of it."""
        digest = hashlib.sha256(metadata).hexdigest()
        table = None if regions is None else RegionTable(regions)  # refused before anything is loaded
        mem = self._kinds[memory_kind] if memory_kind else None
        with self._lock:
            name = next((n for n, peer in self._peers.items() if peer.digest == digest), None)
            if name is None:
                name = self._load(metadata)
                self._peers[name] = Peer(digest)
            peer = self._peers[name]
            if table is not None:
                peer.regions = table
            if mem is not None:
                peer.mem = mem
            return name

    def _load(self, metadata: bytes) -> str:
        try:
            name = self._agent.loadRemoteMD(metadata)
        except Exception as e:
            stale = agent_name(metadata)  # a known name: the peer restarted
            if stale is None or stale not in self._peers:
                raise PeerLoadError(f"cannot load remote agent metadata: {e}") from e
            self._drop(stale)
            try:
                name = self._agent.loadRemoteMD(metadata)
            except Exception as e2:
                raise PeerLoadError(f"cannot load remote agent metadata: {e2}") from e2
        return name.decode() if isinstance(name, bytes) else str(name)

    def get(self, name: str) -> Peer | None:
        return self._peers.get(name)

    def names(self) -> list[str]:
        with self._lock:
            return list(self._peers)

    def remove(self, name: str) -> None:
        with self._lock:
            self._drop(name)

    def close(self) -> None:
        """Drop every peer, and the reference to the NIXL agent (whose destructor must run)."""
        with self._lock:
            for name in list(self._peers):
                self._drop(name)
            self._agent = None

    def _drop(self, name: str) -> None:
        self._peers.pop(name, None)
        try:
            self._agent.invalidateRemoteMD(name)
        except Exception:
            pass  # already gone: nothing left to drop
