"""Decode attention straight from the pages, on CPU, with a small C kernel (paged_decode.c).

Why: torch has no paged attention for CPU. The torch path gathers every decode's pages into
a padded copy and then runs SDPA (at batch 32, 384 tokens, 2 threads: 12.3 ms against the
kernel's 2.7 on Zen 4). The kernel reads each K and V row once, straight from its page, in
two passes. Decode attention is bound by memory latency, not arithmetic, so what matters is
prefetching: the page after next goes into L2 (not L1, whose few fill buffers the loads of
the current page need), a head's share at a time, and on past the end of each pass.
bfloat16 keys and values of head_dim 64 use vdpbf16ps straight from the page. What was
tried and measured: docs/kernels.md.

The kernel is built and loaded by `engine.native` (compiled on first use, a second or
two). If that fails, or the dtype is not float32/bfloat16, `kernel_for` returns None and
callers use the torch path.
"""

from __future__ import annotations

import ctypes

import torch

from .. import native

# Reassociation lets the dot products and softmax sums vectorize.
_FLAGS = [*native.BASE_FLAGS, "-fno-math-errno", "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros",
          "-freciprocal-math"]
_SYMBOLS = {torch.float32: "paged_decode_f32", torch.bfloat16: "paged_decode_bf16"}
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES = [_ptr, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, ctypes.c_float, _i64,
             ctypes.c_float, _ptr, _ptr, ctypes.c_int]
_KERNELS = native.KernelLibrary(__file__, "paged_decode.c", dict.fromkeys(_SYMBOLS.values(), _ARGTYPES), _FLAGS)


def kernel_for(dtype: torch.dtype, device: torch.device):
    """The kernel for a KV cache of `dtype` on `device`, or None (use the torch path)."""
    return _KERNELS.function(_SYMBOLS[dtype], device) if dtype in _SYMBOLS else None


def paged_decode(kernel, q, k_cache, v_cache, block_tables, seq_lens, page_size: int, scale: float,
                 out: torch.Tensor | None = None, window: int = 0, softcap: float = 0.0,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """out [B, H, D] (q's dtype) for one query per sequence: q [B, H, D], one layer's
    k_cache / v_cache [num_pages, page_size, Hkv, D] page views (any page stride, the same
    for both; each page's rows contiguous), block_tables int32 [B, max_pages] (contiguous),
    seq_lens int32 [B] (context length including the query's own token). `out`, if given, is
    a contiguous float32 [B, H, D] to write into (saves a copy). `window` > 0: each query
    sees its last `window` positions only (a sliding-window layer); `softcap` > 0: each
    scaled score s becomes softcap * tanh(s / softcap) (Gemma 2). `sinks`, float32 [H] or
    None: query head h's softmax has one more score, sinks[h], with no value (GPT-OSS)."""
    B, H, D = q.shape
    num_kv_heads = k_cache.shape[2]
    if (k_cache.shape[1] != page_size or v_cache.stride() != k_cache.stride()
            or k_cache.stride()[1:] != (num_kv_heads * D, D, 1)):
        # The kernel would read the wrong bytes: refuse rather than return garbage.
        raise ValueError(f"paged decode needs packed pages of {page_size} rows with equal K/V strides, "
                         f"got shape {tuple(k_cache.shape)}, strides {k_cache.stride()} / {v_cache.stride()}")
    if sinks is not None:
        if sinks.shape != (H,):
            raise ValueError(f"sinks must be one per query head, [{H}], got {tuple(sinks.shape)}")
        sinks = sinks.to("cpu", torch.float32).contiguous()  # held until the kernel returns
    qf = q.to(torch.float32).contiguous()
    if out is None or out.dtype != torch.float32 or not out.is_contiguous() or out.shape != (B, H, D):
        out = torch.empty(B, H, D, dtype=torch.float32)
    failed = kernel(
        qf.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), block_tables.shape[1],
        seq_lens.data_ptr(), B, H, num_kv_heads, D, page_size, k_cache.stride(0), scale, window, softcap,
        None if sinks is None else sinks.data_ptr(), out.data_ptr(), torch.get_num_threads(),
    )
    if failed:
        raise MemoryError("paged decode kernel could not allocate its score buffers")
    return out if q.dtype == torch.float32 else out.to(q.dtype)
