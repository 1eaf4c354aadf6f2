"""Transfer planning: from slot lists on two pools to the fewest memory descriptors.

Position ``i`` of the window goes from ``src_slots[i]`` on the sender to ``dst_slots[i]``
on the receiver, for every requested layer, K and V. Invariants of a plan: descriptors
never overlap on either side; together they cover exactly the window's bytes; and no two
of them could be merged (none ends where another starts on both sides at once), so the
count is the minimum for these slot lists and layouts. Layouts and page sizes matter only
through addresses: a run ends where the next slot is not the next bytes on either side
(a page boundary in a page-major pool), and runs merge across layers, K/V and pages
wherever the bytes follow on both sides (whole pages of two page-major pools).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from .layout import KVLayout


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
    if s.size == 0:
        return np.zeros((0, 3), dtype=np.int64)
    unit = src.bytes_per_slot
    breaks = np.flatnonzero((np.diff(s) != unit) | (np.diff(d) != unit)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [s.size])))
    return np.stack([s[starts], d[starts], lengths * unit], axis=1)


def _check_slots(name: str, slots: np.ndarray, layout: KVLayout) -> None:
    if slots.size and (slots.min() < 0 or slots.max() >= layout.num_slots):
        bad = int(slots[(slots < 0) | (slots >= layout.num_slots)][0])
        raise PlanError(f"{name} slot {bad} is outside the pool of {layout.num_slots} slots")
    if np.unique(slots).size != slots.size:
        raise PlanError(f"{name} slots repeat a slot")


def plan_transfer(
    src: KVLayout,
    src_slots: Sequence[int],
    dst: KVLayout,
    dst_slots: Sequence[int],
    layers: Iterable[int] | None = None,
) -> TransferPlan:
    """Plan the move of ``src_slots`` -> ``dst_slots`` (paired by position) for ``layers``."""
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

    runs = slot_runs(src, s, dst, d)
    # every (layer, kv) pair copies every run: build the cross product without Python loops
    lk = np.stack(np.meshgrid(layer_ids, np.arange(2), indexing="ij"), axis=-1).reshape(-1, 2)
    src_off = lk[:, 0] * src.layer_stride + lk[:, 1] * src.kv_stride
    dst_off = lk[:, 0] * dst.layer_stride + lk[:, 1] * dst.kv_stride
    src_addrs = (src_off[:, None] + runs[None, :, 0]).reshape(-1)
    dst_addrs = (dst_off[:, None] + runs[None, :, 1]).reshape(-1)
    sizes = np.broadcast_to(runs[None, :, 2], (lk.shape[0], runs.shape[0])).reshape(-1)
    src_addrs, dst_addrs, sizes = _coalesce(src_addrs, dst_addrs, sizes)
    return TransferPlan(
        src_addrs=src_addrs.astype(np.uint64),
        dst_addrs=dst_addrs.astype(np.uint64),
        sizes=sizes.astype(np.uint64),
        num_tokens=int(s.size),
        num_runs=int(runs.shape[0]),
        num_layers=int(layer_ids.size),
    )


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
