"""KVLayout: where every slot's K and V of every layer lives in a KV pool.

The engine's pool is one tensor ``[num_layers, 2, num_slots, num_kv_heads, head_dim]``
(dim 1: 0 = K, 1 = V), ``slot = page_id * page_size + offset``. The byte address of
(layer, kv, slot) is ``base_addr + layer * layer_stride + kv * kv_stride +
slot * slot_stride``. Invariant: ``slot_stride == bytes_per_slot`` (one slot's K of one
layer is ``num_kv_heads * head_dim`` packed elements), so consecutive slots of one layer's K
(or V) form one contiguous byte span; that is what lets runs of pages coalesce into single
memory descriptors. Two layouts can exchange KV when dtype, layers, heads and head_dim
agree; page size, pool size and strides may differ.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

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


@dataclass(frozen=True)
class KVLayout:
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
        if self.slot_stride != self.bytes_per_slot:
            raise ValueError(
                f"slot_stride={self.slot_stride} must equal bytes_per_slot={self.bytes_per_slot} "
                "(a slot's K/V must be packed so runs of slots are contiguous)"
            )

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def bytes_per_slot(self) -> int:
        """Bytes of one slot's K (or V) in one layer: the unit a descriptor is made of."""
        return self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token's KV occupies over all layers, K and V."""
        return self.bytes_per_slot * 2 * self.num_layers

    @property
    def num_pages(self) -> int:
        return self.num_slots // self.page_size

    @property
    def extent(self) -> int:
        """Bytes from ``base_addr`` to the end of the last slot (the span to register)."""
        return (
            (self.num_layers - 1) * self.layer_stride
            + self.kv_stride
            + self.num_slots * self.slot_stride
        )

    def addr(self, layer: int, kv: int, slot: int) -> int:
        return self.base_addr + layer * self.layer_stride + kv * self.kv_stride + slot * self.slot_stride

    def incompatibilities(self, other: "KVLayout") -> list[str]:
        """Why KV cannot move between ``self`` and ``other`` (empty when it can)."""
        problems = []
        for name in ("dtype", "num_layers", "num_kv_heads", "head_dim"):
            a, b = getattr(self, name), getattr(other, name)
            if a != b:
                problems.append(f"{name} differs: {a} vs {b}")
        return problems

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "KVLayout":
        fields = cls.__dataclass_fields__
        unknown = set(d) - set(fields)
        if unknown:
            raise ValueError(f"unknown KVLayout field(s): {sorted(unknown)}")
        missing = [f for f in fields if f not in d and f != "device"]
        if missing:
            raise ValueError(f"KVLayout is missing field(s): {missing}")
        return cls(**{k: (str(v) if k in ("dtype", "device") else int(v)) for k, v in d.items()})

    @classmethod
    def from_tensor(cls, kv_cache: Any, page_size: int) -> "KVLayout":
        """Describe an engine pool tensor ``[num_layers, 2, num_slots, num_kv_heads, head_dim]``."""
        if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
            raise ValueError(
                f"kv_cache must be [num_layers, 2, num_slots, num_kv_heads, head_dim], "
                f"got shape {tuple(kv_cache.shape)}"
            )
        num_layers, _, num_slots, heads, head_dim = (int(x) for x in kv_cache.shape)
        item = kv_cache.element_size()
        s = [int(x) * item for x in kv_cache.stride()]
        if s[4] != item or s[3] != head_dim * item or s[2] != heads * head_dim * item:
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
            layer_stride=s[0],
            kv_stride=s[1],
            slot_stride=s[2],
            device=device.type if device.index is None else f"{device.type}:{device.index}",
        )
