"""Registered memory regions, and the device id each NIXL descriptor must carry.

NIXL matches a descriptor against registered memory by (addr, len, devId), so a WRITE's
source descriptors carry the id of the local region they lie in and its destination
descriptors the id of the peer's region (prefill on cuda:0 writing into decode on cuda:1
names device 0 on one side and 1 on the other).

Invariants: a ``RegionTable``'s regions are sorted by address and do not overlap (checked),
so the only region that can hold an address is the last one starting at or below it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from .layout import KVLayout
from .shards import KVShards


def device_index(device: str) -> int:
    """The device id of a layout's ``device`` ("cuda:1" -> 1; "cuda" and "cpu" -> 0)."""
    kind, _, index = device.partition(":")
    if not index:
        return 0
    if not index.isdigit():
        raise ValueError(f"device {device!r} has no integer index after {kind!r}:")
    return int(index)


def regions_of(layout: KVLayout | KVShards) -> list[tuple[int, int, int]]:
    """A pool's ``(addr, nbytes, device id)`` regions, one per shard: what a peer registered,
    read from the layout it described itself with."""
    layouts = [sh.layout for sh in layout.shards] if isinstance(layout, KVShards) else [layout]
    return [(lay.base_addr, lay.extent, device_index(lay.device)) for lay in layouts]


def memory_kind_of(layout: KVLayout | KVShards) -> str:
    """"DRAM" or "VRAM": the NIXL memory kind a pool described by ``layout`` was registered as."""
    layouts = [sh.layout for sh in layout.shards] if isinstance(layout, KVShards) else [layout]
    return "DRAM" if all(lay.device == "cpu" for lay in layouts) else "VRAM"


def memory_regions(memory: Any) -> tuple[list[tuple[int, int, int]], str]:
    """(addr, nbytes, device id) regions and memory kind ("DRAM"/"VRAM") of a KV pool given
    as a tensor or as ``[(addr, nbytes), ...]`` (host memory)."""
    if hasattr(memory, "data_ptr") and hasattr(memory, "element_size"):
        if not (memory.is_contiguous() or dense_storage(memory)):
            raise ValueError("the KV pool tensor must be contiguous, or a permuted view of all of its "
                             "storage (a layer-major pool), to be registered as one region")
        dev = memory.device
        kind = "DRAM" if dev.type == "cpu" else "VRAM"
        dev_id = 0 if dev.index is None else int(dev.index)
        return [(int(memory.data_ptr()), memory.numel() * memory.element_size(), dev_id)], kind
    regions = []
    for r in memory:
        addr, nbytes = int(r[0]), int(r[1])
        if nbytes <= 0:
            raise ValueError(f"region at 0x{addr:x} has non-positive size {nbytes}")
        regions.append((addr, nbytes, 0))
    if not regions:
        raise ValueError("at least one memory region is required")
    return regions, "DRAM"


def dense_storage(tensor: Any) -> bool:
    """Whether ``tensor`` covers its whole storage, each byte once, from its first byte (as a
    permuted view of a contiguous tensor does): its bytes are then one region."""
    storage = tensor.untyped_storage()
    dims = sorted((st, n) for st, n in zip(tensor.stride(), tensor.shape) if n > 1)
    step = 1
    for st, n in dims:  # packed: each stride is the product of the sizes below it
        if st != step:
            return False
        step *= n
    return tensor.data_ptr() == storage.data_ptr() and step * tensor.element_size() == storage.nbytes()


class RegionTable:
    """Sorted ``(addr, end, device id)`` regions of one agent, local or remote."""

    def __init__(self, regions: Iterable[tuple[int, int, int]]) -> None:
        rows = sorted((int(a), int(a) + int(n), int(d)) for a, n, d in regions)
        if not rows:
            raise ValueError("at least one memory region is required")
        for (a0, e0, _), (a1, _, _) in zip(rows, rows[1:]):
            if a1 < e0:
                raise ValueError(f"regions [0x{a0:x}, 0x{e0:x}) and [0x{a1:x}, ...) overlap")
        self.starts = np.array([r[0] for r in rows], dtype=np.uint64)
        self.ends = np.array([r[1] for r in rows], dtype=np.uint64)
        self.dev_ids = np.array([r[2] for r in rows], dtype=np.uint64)

    def device_ids(self, addrs: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """The device id of the region holding each ``[addr, addr + size)``; ValueError
        naming the first descriptor that no region holds whole."""
        addrs = np.asarray(addrs, dtype=np.uint64)
        sizes = np.asarray(sizes, dtype=np.uint64)
        i = np.searchsorted(self.starts, addrs, side="right").astype(np.int64) - 1
        j = np.maximum(i, 0)
        inside = (i >= 0) & (addrs + sizes <= self.ends[j])
        if not inside.all():
            k = int(np.argmin(inside))
            held = ", ".join(f"[0x{a:x}, 0x{e:x})" for a, e in zip(self.starts.tolist(), self.ends.tolist()))
            raise ValueError(f"descriptor at 0x{int(addrs[k]):x} (+{int(sizes[k])} bytes) lies in no "
                             f"registered region (regions: {held})")
        return self.dev_ids[j]
