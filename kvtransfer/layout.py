"""KVLayout: where every slot's K and V of every layer lives in a KV pool.

A pool holds ``num_slots = num_pages * page_size`` slots, ``slot = page * page_size +
offset``; every (layer, kv, slot) owns ``bytes_per_slot`` packed bytes (kv 0 = K, 1 = V) at

    base_addr + page * page_stride + layer * layer_stride + kv * kv_stride + offset * slot_stride

Two tensor shapes have this form (``KVLayout.from_tensor`` reads either):

- page-major (recommended) ``[num_pages, num_layers, 2, page_size, num_kv_heads, head_dim]``:
  a page holds every layer's K and V of its slots, so a run of consecutive pages is one
  contiguous span across all layers: one large memory descriptor per run.
- layer-major ``[num_layers, 2, num_slots, num_kv_heads, head_dim]``: one layer's K (or V)
  of consecutive slots is contiguous, so a run costs ``2 * num_layers`` descriptors;
  ``page_stride = page_size * slot_stride``.

Invariants: ``slot_stride == bytes_per_slot`` (a slot's K/V is packed), and no two
(layer, kv, slot) byte ranges overlap (checked from the strides). Two layouts can exchange
KV when dtype, layers, heads and head_dim agree; page size, shape and strides may differ.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

DTYPE_SIZES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}

PAGE_MAJOR, LAYER_MAJOR = "page-major", "layer-major"
LAYOUT_KINDS = (PAGE_MAJOR, LAYER_MAJOR)


class KVSizes:
    """Sizes derived from a pool's dtype, KV heads, head_dim, layers, slots and page size:
    one definition for a pool (`KVLayout`) and for a node's shards of one (`KVShards`)."""

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def bytes_per_slot(self) -> int:
        """Bytes of one slot's K (or V) in one layer over the heads held: the unit a
        descriptor is made of."""
        return self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token's KV occupies over all layers, K and V."""
        return self.bytes_per_slot * 2 * self.num_layers

    @property
    def num_pages(self) -> int:
        return self.num_slots // self.page_size


@dataclass(frozen=True)
class KVLayout(KVSizes):
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    num_slots: int
    base_addr: int
    layer_stride: int
    kv_stride: int
    slot_stride: int
    device: str = "cpu"
    # 0 means "pages follow each other slot by slot" (layer-major): descriptions written
    # before this field existed, or proto3 messages without it, read as what they meant
    page_stride: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"unsupported KV dtype {self.dtype!r}; known: {sorted(DTYPE_SIZES)}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size", "num_slots"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_slots % self.page_size:
            raise ValueError(
                f"num_slots={self.num_slots} is not a multiple of page_size={self.page_size}"
            )
        if self.page_stride == 0:
            object.__setattr__(self, "page_stride", self.page_size * self.slot_stride)
        if self.slot_stride != self.bytes_per_slot:
            raise ValueError(
                f"slot_stride={self.slot_stride} must equal bytes_per_slot={self.bytes_per_slot} "
                "(a slot's K/V must be packed so runs of slots are contiguous)"
            )
        self._check_no_overlap()

    def _check_no_overlap(self) -> None:
        # Sorted by stride, each axis must step past everything the smaller axes span;
        # then every (page, layer, kv, offset) owns its own bytes.
        axes = sorted(
            (stride, count, name)
            for stride, count, name in (
                (self.slot_stride, self.page_size, "slot_stride"),
                (self.kv_stride, 2, "kv_stride"),
                (self.layer_stride, self.num_layers, "layer_stride"),
                (self.page_stride, self.num_pages, "page_stride"),
            )
            if count > 1
        )
        span = self.bytes_per_slot
        for stride, count, name in axes:
            if stride < span:
                raise ValueError(
                    f"{name}={stride} overlaps the {span} bytes spanned by the smaller strides "
                    f"(layer_stride={self.layer_stride}, kv_stride={self.kv_stride}, "
                    f"page_stride={self.page_stride}, slot_stride={self.slot_stride})"
                )
            span += stride * (count - 1)

    @property
    def kind(self) -> str:
        """``"page-major"``, ``"layer-major"``, or ``"strided"`` for any other strides."""
        packed_page = self.page_size * self.slot_stride
        if self.kv_stride == packed_page and self.layer_stride == 2 * packed_page and (
            self.page_stride == self.num_layers * self.layer_stride or self.num_pages == 1
        ):
            return PAGE_MAJOR
        if self.page_stride == packed_page and self.kv_stride == self.num_slots * self.slot_stride and (
            self.layer_stride == 2 * self.kv_stride or self.num_layers == 1
        ):
            return LAYER_MAJOR
        return "strided"

    @property
    def extent(self) -> int:
        """Bytes from ``base_addr`` to the end of the last slot (the span to register)."""
        return self.addr(self.num_layers - 1, 1, self.num_slots - 1) - self.base_addr + self.bytes_per_slot

    def addr(self, layer: int, kv: int, slot: int) -> int:
        page, offset = divmod(slot, self.page_size)
        return (self.base_addr + page * self.page_stride + layer * self.layer_stride
                + kv * self.kv_stride + offset * self.slot_stride)

    def slot_addrs(self, slots: Any) -> np.ndarray:
        """``addr(0, 0, s)`` for every slot in ``slots`` (int64 array); add layer/kv strides."""
        s = np.asarray(slots, dtype=np.int64)
        return self.base_addr + (s // self.page_size) * self.page_stride + (s % self.page_size) * self.slot_stride

    def incompatibilities(self, other: "KVLayout") -> list[str]:
        """Why KV cannot move between ``self`` and ``other`` (empty when it can)."""
        problems = []
        for name in ("dtype", "num_layers", "num_kv_heads", "head_dim"):
            a, b = getattr(self, name), getattr(other, name)
            if a != b:
                problems.append(f"{name} differs: {a} vs {b}")
        return problems

    def to_dict(self) -> dict[str, Any]:
        """Every field; ``page_stride`` is left out when it is the layer-major default, so
        a layer-major layout still fits a message or peer that predates the field."""
        d = asdict(self)
        if self.page_stride == self.page_size * self.slot_stride:
            del d["page_stride"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "KVLayout":
        fields = cls.__dataclass_fields__
        unknown = set(d) - set(fields)
        if unknown:
            raise ValueError(f"unknown KVLayout field(s): {sorted(unknown)}")
        missing = [f for f in fields if f not in d and f not in ("device", "page_stride")]
        if missing:
            raise ValueError(f"KVLayout is missing field(s): {missing}")
        return cls(**{k: (str(v) if k in ("dtype", "device") else int(v)) for k, v in d.items()})

    @classmethod
    def from_tensor(cls, kv_cache: Any, page_size: int) -> "KVLayout":
        """Describe a pool tensor, page-major ``[P, L, 2, page_size, Hkv, D]`` (6-D) or
        layer-major ``[L, 2, num_slots, Hkv, D]`` (5-D)."""
        shape, item = tuple(int(x) for x in kv_cache.shape), kv_cache.element_size()
        s = [int(x) * item for x in kv_cache.stride()]
        if kv_cache.dim() == 6 and shape[2] == 2:
            num_pages, num_layers, _, ps, heads, head_dim = shape
            if ps != page_size:
                raise ValueError(f"page-major kv_cache has pages of {ps} slots, but page_size={page_size}")
            strides = dict(page_stride=s[0], layer_stride=s[1], kv_stride=s[2], slot_stride=s[3])
            num_slots = num_pages * ps
        elif kv_cache.dim() == 5 and shape[1] == 2:
            num_layers, _, num_slots, heads, head_dim = shape
            strides = dict(layer_stride=s[0], kv_stride=s[1], slot_stride=s[2], page_stride=page_size * s[2])
        else:
            raise ValueError(
                "kv_cache must be [num_pages, num_layers, 2, page_size, num_kv_heads, head_dim] "
                f"or [num_layers, 2, num_slots, num_kv_heads, head_dim], got shape {shape}"
            )
        if s[-1] != item or s[-2] != head_dim * item or strides["slot_stride"] != heads * head_dim * item:
            raise ValueError(
                f"kv_cache slots must be packed ([num_kv_heads, head_dim] contiguous), strides {tuple(kv_cache.stride())}"
            )
        device = kv_cache.device
        return cls(
            dtype=str(kv_cache.dtype).removeprefix("torch."),
            num_layers=num_layers,
            num_kv_heads=heads,
            head_dim=head_dim,
            page_size=int(page_size),
            num_slots=num_slots,
            base_addr=int(kv_cache.data_ptr()),
            device=device.type if device.index is None else f"{device.type}:{device.index}",
            **strides,
        )


def pool_shape(kind: str, num_layers: int, num_kv_heads: int, head_dim: int, page_size: int,
               num_pages: int) -> tuple[int, ...]:
    """The tensor shape of a pool of ``kind`` (``"page-major"`` or ``"layer-major"``)."""
    if kind == PAGE_MAJOR:
        return (num_pages, num_layers, 2, page_size, num_kv_heads, head_dim)
    if kind == LAYER_MAJOR:
        return (num_layers, 2, num_pages * page_size, num_kv_heads, head_dim)
    raise ValueError(f"KV layout must be one of {LAYOUT_KINDS}, got {kind!r}")
