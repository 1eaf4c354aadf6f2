"""The KV pool tensor, in either memory order, always indexed
`[page, layer, K/V, offset in page, KV head, head dim]`.

- page-major (the default): memory in that order. A page holds every layer, so a run of
  consecutive pages is one byte span: a whole-window send moves it in one NIXL descriptor.
- layer-major: memory ordered `[layer, K/V, page, offset, head, dim]`, and the pool is a
  permuted view of it, so every index stays the same. One layer's K (or V) of a run of
  pages is one span: a layer-wise send moves a run's layer in two descriptors, where
  page-major needs one per page (a 4096-token window of 16-token pages: 256 per layer).
Each layer's K and V are `[pages, page_size, heads, dim]` views with packed rows in both
orders; every kernel takes their strides. `KVLayout.from_tensor` reads the order from the
strides, so peers learn it with the layout.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable

import torch

from .config import KV_LAYOUTS

PAGE_MAJOR, LAYER_MAJOR = KV_LAYOUTS
_LAYER_MAJOR_TO_INDEX = (2, 0, 1, 3, 4, 5)  # [layer, kv, page, ...] seen as [page, layer, kv, ...]


def kv_pool(order: str, num_pages: int, num_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
            alloc: Callable[[tuple[int, ...]], torch.Tensor]) -> torch.Tensor:
    """A pool in `order`, its memory from `alloc(shape)` (one dense tensor of that shape)."""
    if order == PAGE_MAJOR:
        return alloc((num_pages, num_layers, 2, page_size, num_kv_heads, head_dim))
    if order == LAYER_MAJOR:
        return alloc((num_layers, 2, num_pages, page_size, num_kv_heads, head_dim)).permute(*_LAYER_MAJOR_TO_INDEX)
    raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {order!r}")


def mapped_pool(order: str, shape: tuple[int, ...], fd: int, dtype: torch.dtype) -> torch.Tensor:
    """A pool of `shape` (as indexed) in `order` on the shared file `fd`: a tensor-parallel
    rank's, which rank 0 maps as well to register it."""
    num_pages, num_layers, _, page_size, num_kv_heads, head_dim = shape

    def alloc(dense: tuple[int, ...]) -> torch.Tensor:
        count = math.prod(dense)
        region = mmap.mmap(fd, count * dtype.itemsize, flags=mmap.MAP_SHARED)
        return torch.frombuffer(region, dtype=dtype, count=count).view(dense)  # keeps `region` alive

    return kv_pool(order, num_pages, num_layers, page_size, num_kv_heads, head_dim, alloc)
