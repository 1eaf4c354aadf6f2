"""Decode attention straight from the pages, on CPU, with a small C kernel (paged_decode.c).

Why: torch has no paged attention for CPU. The torch path gathers every decode's pages into
a padded copy and then runs SDPA. At batch 32 with 384 context tokens (GQA 16/4 heads,
head_dim 64, fp32) on the 2-core dev machine the kernel took 5.1 ms against 6.3 ms for
gather + SDPA with 1 thread, and 2.7 ms against 12.3 ms with 2 threads (best of 40 each;
torch's several parallel ops per group suffer most when the cores are shared). With its
dot products eight K rows per horizontal sum (AVX2 intrinsics) and its weighted V sums held
in registers, one layer at batch 32, 300 tokens each (SmolLM2's 9/3 heads, head_dim 64,
fp32) takes 0.38 ms when the pages are in cache, against 0.62 ms for the plain-loop
version; from memory it takes ~1.0 ms either way (~15 GB/s: reading scattered 12 KB page
rows is bound by memory latency, not arithmetic; software prefetch of the next page gains
~6%; issued a head's share at a time between the heads' work rather than a page at once,
the 30 layers of a step at batch 32, ~300 tokens each, took 27 ms against 31-46 fp32 and
17.5-19 against 21-26 bf16, and the engine's decode attention went from 29 to 24 ms fp32,
23 to 18 ms bf16 per step). The prefetches bring lines into L2, not L1: into L1 they hold
the core's few L1 fill buffers, and the loads of the page being computed on queue behind
them, so memory time and arithmetic added up instead of overlapping (30 layers at batch 32,
320 tokens each, pages scattered: 30 -> 20.5 ms fp32, 18 -> 15 ms bf16; the engine's decode
attention 24.6 -> 16.8 ms fp32, 18 -> 13.4 ms bf16 per step). Tried and dropped: one pass
over each page's K and V with an online softmax (AVX-512, 16 scores per register): its
arithmetic per page cost more than the second pass's reads saved (15.8 ms against 9.4 ms
with the pages in cache). bfloat16 keys of head_dim 64 are scored with vdpbf16ps straight
from the page, not converted first: the 30 layers above took 10.4 against 13.9 ms with the
pages in cache, 14.9 against 16.8 from memory. Their values are summed with vdpbf16ps too,
two rows a lane, the weights rounded to bfloat16 (as torch's flash attention does for
bfloat16), with the page after next prefetched instead of the next: 8.0 against 11.5 ms in
cache, 11.5-12.3 against 12.4-13.7 from memory, and the engine's bf16 decode step 51.3 ->
46.8 ms (`pdserve bench step`, attention 13.3 -> 10.5).

The kernel is built and loaded by `engine.native` (compiled on first use, a second or
two). If that fails, or the dtype is not float32/bfloat16, `kernel_for` returns None and
callers use the torch path.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .. import native

_SOURCE = Path(__file__).with_name("paged_decode.c")
# Reassociation lets the dot products and softmax sums vectorize.
_FLAGS = [*native.BASE_FLAGS, "-fno-math-errno", "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros",
          "-freciprocal-math"]
_SYMBOLS = {torch.float32: "paged_decode_f32", torch.bfloat16: "paged_decode_bf16"}
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES = [_ptr, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, ctypes.c_float, _ptr, ctypes.c_int]


def _load() -> ctypes.CDLL | None:
    return native.load(_SOURCE, _FLAGS, {name: _ARGTYPES for name in _SYMBOLS.values()})


def kernel_for(dtype: torch.dtype, device: torch.device):
    """The kernel for a KV cache of `dtype` on `device`, or None (use the torch path)."""
    if device.type != "cpu" or dtype not in _SYMBOLS:
        return None
    lib = _load()
    return getattr(lib, _SYMBOLS[dtype]) if lib is not None else None


def paged_decode(kernel, q, k_cache, v_cache, block_tables, seq_lens, page_size: int, scale: float,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """out [B, H, D] (q's dtype) for one query per sequence: q [B, H, D], one layer's
    k_cache / v_cache [num_pages, page_size, Hkv, D] page views (any page stride, the same
    for both; each page's rows contiguous), block_tables int32 [B, max_pages] (contiguous),
    seq_lens int32 [B] (context length including the query's own token). `out`, if given, is
    a contiguous float32 [B, H, D] to write into (saves a copy)."""
    B, H, D = q.shape
    num_kv_heads = k_cache.shape[2]
    if (k_cache.shape[1] != page_size or v_cache.stride() != k_cache.stride()
            or k_cache.stride()[1:] != (num_kv_heads * D, D, 1)):
        # The kernel would read the wrong bytes: refuse rather than return garbage.
        raise ValueError(f"paged decode needs packed pages of {page_size} rows with equal K/V strides, "
                         f"got shape {tuple(k_cache.shape)}, strides {k_cache.stride()} / {v_cache.stride()}")
    qf = q.to(torch.float32).contiguous()
    if out is None or out.dtype != torch.float32 or not out.is_contiguous() or out.shape != (B, H, D):
        out = torch.empty(B, H, D, dtype=torch.float32)
    failed = kernel(
        qf.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), block_tables.shape[1],
        seq_lens.data_ptr(), B, H, num_kv_heads, D, page_size, k_cache.stride(0), scale, out.data_ptr(),
        torch.get_num_threads(),
    )
    if failed:
        raise MemoryError("paged decode kernel could not allocate its score buffers")
    return out if q.dtype == torch.float32 else out.to(q.dtype)
