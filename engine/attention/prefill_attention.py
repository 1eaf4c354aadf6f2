"""Prefill attention straight from the pages, on CPU, with a small C kernel
(prefill_attention.c): a sequence's chunk of new tokens, causal, over its whole context.

Why: the torch path gathers the sequence's pages into a contiguous copy and runs SDPA, whose
CPU kernel is tuned for wide heads. On SmolLM2's narrow heads (9 query over 3 KV heads of
64) the kernel reads each page once per task (one KV head, 32 query positions), with an
online softmax whose max moves only when a score passes it by more than 8: a prefill step's
attention in `pdserve bench step` went from 94 to 60 ms at first, and later kernels
reached about 170 GFLOP/s float32 on Zen 4. AVX-512 (with vdpbf16ps for bfloat16 pages)
and AVX2 paths; generic loops elsewhere. What was tried and measured: docs/kernels.md.

Built and loaded by `engine.native`; `kernel_for` returns None when that fails or the KV
dtype is not float32/bfloat16, and callers use the torch path.
"""

from __future__ import annotations

import ctypes

import torch

from .. import native
from .paged_decode import _FLAGS

_SYMBOLS = {torch.float32: "prefill_attention_f32", torch.bfloat16: "prefill_attention_bf16"}
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES = [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _i64, ctypes.c_float, _ptr, ctypes.c_int]
_KERNELS = native.KernelLibrary(__file__, "prefill_attention.c", dict.fromkeys(_SYMBOLS.values(), _ARGTYPES),
                                _FLAGS)


def kernel_for(dtype: torch.dtype, device: torch.device):
    """The kernel for a KV cache of `dtype` on `device`, or None (use the torch path)."""
    return _KERNELS.function(_SYMBOLS[dtype], device) if dtype in _SYMBOLS else None


def prefill_attention(kernel, q, k_cache, v_cache, pages: torch.Tensor, context_len: int, scale: float,
                      out: torch.Tensor) -> None:
    """Write into `out` [n, H, D] (any dtype; float32 contiguous is written directly) the
    attention of q [n, H, D], positions context_len - n .. context_len - 1, over the first
    `context_len` slots of `pages` (int32, contiguous) in one layer's k_cache / v_cache
    [num_pages, page_size, Hkv, D] page views (packed rows, equal strides: see
    cpu_ops.rows_packed)."""
    n, H, D = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    qf = q.to(torch.float32).contiguous()
    direct = out.dtype == torch.float32 and out.is_contiguous()
    dest = out if direct else torch.empty(n, H, D, dtype=torch.float32)
    failed = kernel(
        qf.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), pages.data_ptr(), n, context_len, H, num_kv_heads,
        D, page_size, k_cache.stride(0), scale, dest.data_ptr(), torch.get_num_threads(),
    )
    if failed:
        raise MemoryError("prefill attention kernel could not allocate its work buffers")
    if not direct:
        out.copy_(dest)
