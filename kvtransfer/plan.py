"""Transfer planning: from slot lists on two pools to the fewest memory descriptors.

Position ``i`` of the window goes from ``src_slots[i]`` on the sender to ``dst_slots[i]``
on the receiver, for every requested layer, K and V. Invariants of a plan: descriptors
never overlap on either side; together they cover exactly the window's bytes; and no two
of them could be merged (none ends where another starts on both sides at once), so the
count is the minimum for these slot lists and layouts. Layouts and page sizes matter only
through addresses: a run ends where the next slot is not the next bytes on either side
(a page boundary in a page-major pool), and runs merge across layers, K/V and pages
wherever the bytes follow on both sides (whole pages of two page-major pools).

Either side may be a tensor-parallel node (``KVShards``): each destination shard then
receives every head it holds straight from a source shard's pool (the lowest-rank one
holding that head), one descriptor per position, layer and K/V where only part of a
slot's heads move, merged wherever the bytes still follow on both sides. Sender ranges
then overlap only where several destination shards replicate one head.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from .layout import KVLayout
from .shards import KVShards, as_shards


class PlanError(ValueError):
    """The two sides cannot be paired (incompatible layouts, bad slots, length mismatch)."""


@dataclass(frozen=True)
class TransferPlan:
    """Descriptors as three parallel ``uint64`` arrays (sorted by source address)."""

    src_addrs: np.ndarray
    dst_addrs: np.ndarray
    sizes: np.ndarray
    num_tokens: int
    num_runs: int  # runs of slots contiguous in memory on both sides, per layer and K/V
    num_layers: int

    @property
    def num_descriptors(self) -> int:
        return int(self.sizes.size)

    @property
    def total_bytes(self) -> int:
        return int(self.sizes.sum())

    @property
    def descriptors(self) -> list[tuple[int, int, int]]:
        return list(zip(self.src_addrs.tolist(), self.dst_addrs.tolist(), self.sizes.tolist()))

    def __len__(self) -> int:
        return self.num_descriptors

    def __iter__(self) -> Iterator[tuple[int, int, int]]:
        return iter(self.descriptors)

    def halves(self) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
        """The descriptors cut at half the bytes (one descriptor split if it spans the cut):
        two writes that together move exactly this plan's bytes."""
        first, rest, left = [], [], self.total_bytes // 2
        for src, dst, n in self.descriptors:
            take = min(n, left)
            if take:
                first.append((src, dst, take))
            if n > take:
                rest.append((src + take, dst + take, n - take))
            left -= take
        return first, rest


def slot_runs(src: KVLayout, src_slots: Sequence[int], dst: KVLayout, dst_slots: Sequence[int]) -> np.ndarray:
    """Maximal runs of positions whose slots are contiguous bytes on both sides, within one
    layer's K (or V), as an ``[n, 3]`` array (src addr, dst addr, bytes) for layer 0's K.

    The step from one slot to the next is the same for every (layer, kv), so these runs
    hold for all of them after adding that layer's and K/V's offset.
    """
    s, d = src.slot_addrs(src_slots).reshape(-1), dst.slot_addrs(dst_slots).reshape(-1)
    return _runs(s, d, src.bytes_per_slot)


def _runs(s: np.ndarray, d: np.ndarray, unit: int) -> np.ndarray:
    """Maximal runs of positions whose ``unit``-byte chunks at ``s``/``d`` follow each other
    on both sides, as ``[n, 3]`` (src addr, dst addr, bytes)."""
    if s.size == 0:
        return np.zeros((0, 3), dtype=np.int64)
    breaks = np.flatnonzero((np.diff(s) != unit) | (np.diff(d) != unit)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [s.size])))
    return np.stack([s[starts], d[starts], lengths * unit], axis=1)


def _check_slots(name: str, slots: np.ndarray, layout: KVLayout | KVShards) -> None:
    if slots.size and (slots.min() < 0 or slots.max() >= layout.num_slots):
        bad = int(slots[(slots < 0) | (slots >= layout.num_slots)][0])
        raise PlanError(f"{name} slot {bad} is outside the pool of {layout.num_slots} slots")
    if np.unique(slots).size != slots.size:
        raise PlanError(f"{name} slots repeat a slot")


def _pair(src: KVLayout | KVShards, src_slots: Sequence[int], dst: KVLayout | KVShards,
          dst_slots: Sequence[int], layers: Iterable[int] | None) -> tuple[np.ndarray, ...]:
    """The checked window: sender slots, receiver slots and layer ids as int64 arrays."""
    problems = src.incompatibilities(dst)
    if problems:
        raise PlanError("incompatible KV layouts: " + "; ".join(problems))
    s = np.asarray(src_slots, dtype=np.int64).reshape(-1)
    d = np.asarray(dst_slots, dtype=np.int64).reshape(-1)
    if s.size != d.size:
        raise PlanError(f"sender has {s.size} slots but receiver has {d.size}")
    _check_slots("sender", s, src)
    _check_slots("receiver", d, dst)
    layer_ids = np.arange(src.num_layers) if layers is None else np.asarray(list(layers), dtype=np.int64)
    if layer_ids.size and (layer_ids.min() < 0 or layer_ids.max() >= src.num_layers):
        raise PlanError(f"layers must be in [0, {src.num_layers}), got {layer_ids.tolist()}")
    if np.unique(layer_ids).size != layer_ids.size:
        raise PlanError(f"layers repeat: {layer_ids.tolist()}")
    return s, d, layer_ids


def plan_transfer(
    src: KVLayout | KVShards,
    src_slots: Sequence[int],
    dst: KVLayout | KVShards,
    dst_slots: Sequence[int],
    layers: Iterable[int] | None = None,
) -> TransferPlan:
    """Plan the move of ``src_slots`` -> ``dst_slots`` (paired by position) for ``layers``.
    A plain ``KVLayout`` facing ``KVShards`` is one shard holding every head."""
    s, d, layer_ids = _pair(src, src_slots, dst, dst_slots, layers)
    if isinstance(src, KVLayout) and isinstance(dst, KVLayout):
        runs = slot_runs(src, s, dst, d)
        src_addrs, dst_addrs, sizes = _coalesce(*_over_layers(runs, layer_ids, src, dst))
        num_runs = int(runs.shape[0])
    else:
        src, dst = as_shards(src), as_shards(dst)
        src_addrs, dst_addrs, sizes, num_runs = _plan_shards(src, s, dst, d, layer_ids)
        # Every head each destination rank holds, once per position, layer and K/V: a cheap
        # check of the whole plan (check_plan walks it byte by byte, for the tests).
        expected = s.size * layer_ids.size * 2 * sum(b.layout.bytes_per_slot for b in dst.shards)
        if int(sizes.sum()) != expected:
            raise PlanError(f"the plan moves {int(sizes.sum())} bytes, not the window's {expected}")
    return TransferPlan(
        src_addrs=src_addrs.astype(np.uint64),
        dst_addrs=dst_addrs.astype(np.uint64),
        sizes=sizes.astype(np.uint64),
        num_tokens=int(s.size),
        num_runs=num_runs,
        num_layers=int(layer_ids.size),
    )


def _over_layers(runs: np.ndarray, layer_ids: np.ndarray, src: KVLayout, dst: KVLayout) -> tuple[np.ndarray, ...]:
    """Layer 0's K runs repeated for every (layer, kv), as src addrs, dst addrs, sizes."""
    # every (layer, kv) pair copies every run: build the cross product without Python loops
    lk = np.stack(np.meshgrid(layer_ids, np.arange(2), indexing="ij"), axis=-1).reshape(-1, 2)
    src_off = lk[:, 0] * src.layer_stride + lk[:, 1] * src.kv_stride
    dst_off = lk[:, 0] * dst.layer_stride + lk[:, 1] * dst.kv_stride
    src_addrs = (src_off[:, None] + runs[None, :, 0]).reshape(-1)
    dst_addrs = (dst_off[:, None] + runs[None, :, 1]).reshape(-1)
    sizes = np.broadcast_to(runs[None, :, 2], (lk.shape[0], runs.shape[0])).reshape(-1)
    return src_addrs, dst_addrs, sizes


def _head_pairs(src: KVShards, dst: KVShards) -> list[tuple[int, int, int, int]]:
    """(source shard, destination shard, first head, end head): every head each destination
    shard holds, from the lowest-rank source shard holding it, in maximal head ranges."""
    by_rank = sorted(range(len(src.shards)), key=lambda i: (src.shards[i].rank, i))
    owner = [next(i for i in by_rank if src.shards[i].head_begin <= h < src.shards[i].head_end)
             for h in range(src.num_kv_heads)]
    pairs = []
    for j, shard in enumerate(dst.shards):
        h = shard.head_begin
        while h < shard.head_end:
            end = h + 1
            while end < shard.head_end and owner[end] == owner[h]:
                end += 1
            pairs.append((owner[h], j, h, end))
            h = end
    return pairs


def _plan_shards(src: KVShards, s: np.ndarray, dst: KVShards, d: np.ndarray,
                 layer_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    head_bytes = src.head_dim * src.itemsize
    by_pools: dict[tuple[int, int], list] = {}
    num_runs = 0
    for i, j, h0, h1 in _head_pairs(src, dst):
        a, b = src.shards[i], dst.shards[j]
        # a head sub-range of a slot is contiguous; slots follow only when it is the whole slot
        runs = _runs(a.layout.slot_addrs(s) + (h0 - a.head_begin) * head_bytes,
                     b.layout.slot_addrs(d) + (h0 - b.head_begin) * head_bytes, (h1 - h0) * head_bytes)
        by_pools.setdefault((i, j), []).append(_over_layers(runs, layer_ids, a.layout, b.layout))
        num_runs += int(runs.shape[0])
    # Merged within one pair of pools only: two pools may lie next to each other in memory,
    # but NIXL takes a descriptor only inside one registered region. A replicated source
    # head is read by several destination shards, so source ranges may repeat; destination
    # ranges never overlap, so merging in destination order finds every merge.
    merged = []
    for parts in by_pools.values():
        src_addrs, dst_addrs, sizes = (np.concatenate(p) for p in zip(*parts))
        dst_addrs, src_addrs, sizes = _coalesce(dst_addrs, src_addrs, sizes)
        merged.append((src_addrs, dst_addrs, sizes))
    src_addrs, dst_addrs, sizes = (np.concatenate(p) for p in zip(*merged))
    order = np.lexsort((dst_addrs, src_addrs))  # the plan's source order
    return src_addrs[order], dst_addrs[order], sizes[order], num_runs


def check_plan(plan: TransferPlan, src: KVLayout | KVShards, src_slots: Sequence[int],
               dst: KVLayout | KVShards, dst_slots: Sequence[int], layers: Iterable[int] | None = None) -> None:
    """Raise ``PlanError`` unless ``plan`` writes each head a destination shard holds, for
    every layer, K/V and position of the window, exactly once, from that head, layer, K/V
    and position in some source shard, and writes nothing else. Walks every head of every
    position in Python: meant for tests, slow for big windows."""
    src, dst = as_shards(src), as_shards(dst)
    s, d, layer_ids = _pair(src, src_slots, dst, dst_slots, layers)
    hb = src.head_dim * src.itemsize
    allowed: dict[int, set[int]] = {}  # destination head address -> source addresses of it
    for b in dst.shards:
        for h in range(b.head_begin, b.head_end):
            holders = [a for a in src.shards if a.head_begin <= h < a.head_end]
            for layer in layer_ids.tolist():
                for kv in (0, 1):
                    to = b.layout.slot_addrs(d) + b.layout.addr(layer, kv, 0) - b.layout.base_addr
                    froms = [a.layout.slot_addrs(s) + a.layout.addr(layer, kv, 0) - a.layout.base_addr
                             + (h - a.head_begin) * hb for a in holders]
                    for i, addr in enumerate((to + (h - b.head_begin) * hb).tolist()):
                        allowed[addr] = {int(f[i]) for f in froms}
    written: set[int] = set()
    for src_addr, dst_addr, n in plan.descriptors:
        where = f"descriptor ({src_addr:#x} -> {dst_addr:#x}, {n} bytes)"
        if n % hb:
            raise PlanError(f"{where} is not a whole number of {hb}-byte heads")
        for k in range(0, n, hb):
            sa, da = src_addr + k, dst_addr + k
            if da not in allowed:
                raise PlanError(f"{where} writes {da:#x}, which is no destination head of the window")
            if da in written:
                raise PlanError(f"{where} writes {da:#x} a second time")
            if sa not in allowed[da]:
                raise PlanError(f"{where} fills {da:#x} from {sa:#x}, not the same head, layer, K/V "
                                "and position of a source shard")
            written.add(da)
    if len(written) != len(allowed):
        first = min(set(allowed) - written)
        raise PlanError(f"{len(allowed) - len(written)} destination head(s) are never written, "
                        f"the first at {first:#x}")


def _coalesce(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, ...]:
    """Merge descriptors adjacent on both sides.

    Sorting by source address is enough to find every merge: a descriptor can only be
    followed (in source memory) by the one starting at its end, and that one comes next in
    sorted order because descriptors do not overlap.
    """
    if src.size == 0:
        return src, dst, sizes
    order = np.argsort(src, kind="stable")
    src, dst, sizes = src[order], dst[order], sizes[order]
    joins = (src[:-1] + sizes[:-1] == src[1:]) & (dst[:-1] + sizes[:-1] == dst[1:])
    starts = np.concatenate(([0], np.flatnonzero(~joins) + 1))
    merged = np.add.reduceat(sizes, starts)
    return src[starts], dst[starts], merged
