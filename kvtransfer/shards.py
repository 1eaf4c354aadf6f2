"""KVShards: a node's KV pool split over its tensor-parallel ranks, by KV head.

Rank ``r`` of a TP node holds the model's KV heads ``[head_begin, head_end)`` in its own
pool (a ``KVLayout`` whose ``num_kv_heads`` is the shard's head count). A node that does
not shard is ``KVShards.single(layout)``: one shard holding every head.

Invariants (checked on construction): at least one shard; every shard has the same dtype,
layers, head_dim, page_size and num_slots (so slot ``s`` is page ``s // page_size`` on
every rank) and the same device kind (``cpu``/``cuda``: ranks sit on different GPUs of one
node); every head of ``[0, num_kv_heads)`` is held by some shard, and no shard holds a head
outside it. Shards may overlap: with fewer KV heads than ranks a head is replicated.

A ``KVShards`` answers what a ``KVLayout`` answers about a whole pool (``bytes_per_slot``
counts all the model's heads), so code that sizes or pairs pools takes either; addresses
are per shard (``shards[i].layout``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .layout import KVLayout, KVSizes

_AGREE = ("dtype", "num_layers", "head_dim", "page_size", "num_slots")


def _device_kind(device: str) -> str:
    return device.split(":", 1)[0]


@dataclass(frozen=True)
class KVShard:
    """One rank's pool: its layout holds heads ``[head_begin, head_end)`` of the model."""

    layout: KVLayout
    head_begin: int
    rank: int = 0

    @property
    def head_end(self) -> int:
        return self.head_begin + self.layout.num_kv_heads


@dataclass(frozen=True)
class KVShards(KVSizes):
    shards: tuple[KVShard, ...]
    num_kv_heads: int  # the model's KV heads, over all shards

    def __post_init__(self) -> None:
        object.__setattr__(self, "shards", tuple(self.shards))
        if not self.shards:
            raise ValueError("KVShards needs at least one shard")
        if self.num_kv_heads <= 0:
            raise ValueError(f"num_kv_heads must be positive, got {self.num_kv_heads}")
        first = self.shards[0]
        for sh in self.shards:
            for name in _AGREE:
                a, b = getattr(first.layout, name), getattr(sh.layout, name)
                if a != b:
                    raise ValueError(
                        f"shards disagree on {name}: rank {first.rank} has {a}, rank {sh.rank} has {b}"
                    )
            if _device_kind(sh.layout.device) != _device_kind(first.layout.device):
                raise ValueError(
                    f"shards disagree on device kind: rank {first.rank} is on {first.layout.device}, "
                    f"rank {sh.rank} on {sh.layout.device}"
                )
            if sh.head_begin < 0 or sh.head_end > self.num_kv_heads:
                raise ValueError(
                    f"rank {sh.rank} holds heads [{sh.head_begin}, {sh.head_end}), outside the "
                    f"model's [0, {self.num_kv_heads})"
                )
        held = {h for sh in self.shards for h in range(sh.head_begin, sh.head_end)}
        missing = sorted(set(range(self.num_kv_heads)) - held)
        if missing:
            raise ValueError(f"KV heads {missing} of {self.num_kv_heads} are held by no shard")

    @classmethod
    def single(cls, layout: KVLayout) -> "KVShards":
        """A node without tensor parallelism: one shard holding every head."""
        return cls((KVShard(layout, 0, 0),), layout.num_kv_heads)

    @property
    def dtype(self) -> str:
        return self.shards[0].layout.dtype

    @property
    def num_layers(self) -> int:
        return self.shards[0].layout.num_layers

    @property
    def head_dim(self) -> int:
        return self.shards[0].layout.head_dim

    @property
    def page_size(self) -> int:
        return self.shards[0].layout.page_size

    @property
    def num_slots(self) -> int:
        return self.shards[0].layout.num_slots

    @property
    def device(self) -> str:
        """The first shard's device (rank 0's, as ``head_ranges`` orders them); the others
        share its kind."""
        return self.shards[0].layout.device

    def incompatibilities(self, other: "KVShards | KVLayout") -> list[str]:
        """Why KV cannot move between ``self`` and ``other`` (empty when it can). Head
        counts are the model's, so any two shardings of one model are compatible."""
        return KVLayout.incompatibilities(self, other)  # the same fields, read off either

    def regions(self) -> list[tuple[int, int]]:
        """``(addr, nbytes)`` of every shard's pool, in shard order (what the agent registers)."""
        return [(sh.layout.base_addr, sh.layout.extent) for sh in self.shards]

    def to_dict(self) -> dict[str, Any]:
        return {
            "shards": [
                {"layout": sh.layout.to_dict(), "head_begin": sh.head_begin, "rank": sh.rank}
                for sh in self.shards
            ],
            "num_kv_heads": self.num_kv_heads,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "KVShards":
        unknown = set(d) - {"shards", "num_kv_heads"}
        if unknown or "shards" not in d or "num_kv_heads" not in d:
            raise ValueError(f"KVShards needs keys 'shards' and 'num_kv_heads', got {sorted(d)}")
        shards = tuple(
            KVShard(KVLayout.from_dict(s["layout"]), int(s["head_begin"]), int(s.get("rank", 0)))
            for s in d["shards"]
        )
        return cls(shards, int(d["num_kv_heads"]))


def as_shards(x: KVLayout | KVShards) -> KVShards:
    """``x`` as shards: a plain layout is one shard holding all its heads."""
    return x if isinstance(x, KVShards) else KVShards.single(x)


def head_ranges(num_kv_heads: int, world: int) -> list[tuple[int, int]]:
    """The KV heads ``[begin, end)`` rank ``r`` of ``world`` ranks holds.

    With at least as many heads as ranks, rank ``r`` holds ``[r*H//world, (r+1)*H//world)``
    (floor split: 3 heads on 2 ranks is ``[0, 1), [1, 3)``). With fewer, each head is
    replicated on ``world // H`` consecutive ranks: rank ``r`` holds head ``r*H//world``.
    """
    if num_kv_heads <= 0 or world <= 0:
        raise ValueError(f"num_kv_heads={num_kv_heads} and world={world} must be positive")
    if num_kv_heads >= world:
        return [(r * num_kv_heads // world, (r + 1) * num_kv_heads // world) for r in range(world)]
    if world % num_kv_heads:
        raise ValueError(
            f"{world} ranks cannot share {num_kv_heads} KV heads: with fewer heads than ranks, "
            "the rank count must be a multiple of the head count (replicate each head equally); "
            "pick a TP size that divides or is a multiple of the KV head count"
        )
    return [(h, h + 1) for h in (r * num_kv_heads // world for r in range(world))]
