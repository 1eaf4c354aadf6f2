"""Prefill attention straight from the pages, on CPU, with a small C kernel
(prefill_attention.c): a sequence's chunk of new tokens, causal, over its whole context.

Why: the torch path gathers the sequence's pages into a contiguous copy and runs SDPA, whose
CPU kernel is tuned for wide heads. On SmolLM2's shape (9 query heads over 3 KV heads,
head_dim 64) on the 2-core dev machine, per layer, best of 15 per case: a fresh 256-token
prompt took 0.67 ms against 1.10 ms for gather + SDPA (fp32; bf16 0.66 against 1.14), a
512-token one 2.5 against 4.1-4.3, a 200-token chunk after a 256-token prefix 1.37 against
1.8. Tasks of 32 positions beat 16 by 7%. In `pdserve bench step` (32 prompts of 256
tokens) a prefill step's attention went from 94 to 60 ms (fp32) and 104 to 60 ms (bf16).
Later, measured on the 30 layers of two 1024-token prompts (~72 GFLOP): reading only the
task's head from each page (not every head's rows, copied), eight chains of FMAs for the
scores instead of four (their latency bound the loop), and V rows held in registers (the
compiler had folded each row's loads into all 16 FMAs) took it from 635-683 to 548-590 ms
fp32, about 120 GFLOP/s. Then, on the same case: each query's max moves only when a score
passes it by more than 8 (no horizontal max, no rescaling on most pages; the sums kept 16
lanes wide) and K is transposed in registers: 526 -> 425 ms fp32 (~170 GFLOP/s), 536 -> 427
bf16. For bfloat16 pages (AVX512-BF16), scores and weighted sums by vdpbf16ps, two
dimensions or two rows a lane (the weights rounded to bfloat16, as torch's flash attention
does): 427 -> 292 ms. Tried and dropped: tiles of two pages per softmax update (no faster
than one).

Without AVX-512 (AVX2 and FMA, e.g. AMD Zen 3) the same plan runs on 8-lane registers: four
queries' scores in two registers each, the softmax with the same lazy max, the weighted V
rows a quarter of head_dim at a time for the four queries; bfloat16 pages are converted to
float32 first. Before it, those CPUs ran the generic loops: in `pdserve bench step --batch 4
--prompt-len 1024` (2 cores of an EPYC Zen 3) a prefill step's attention took 1090 and 1100
ms, against 644 and 645 with it (old and new alternating twice; the step 3113/3171 -> 2686/2710).
Then the scores went through memory with constant indices before the softmax: it indexed
them at run time, so gcc had kept the eight sums on the stack and stored them on every step
of the scoring loop. 30 layers of one 1024-token prompt took 346 ms against 541 (same bits
out), and that prefill step's attention 558 / 462 ms against 767 / 792. Then each page's K
was transposed in 8 x 8 blocks of registers, not element by element: one layer of a
1024-token prompt 9.39-9.43 -> 8.84-8.98 ms (~135 GFLOP/s of causal work), and with
`engine.native.keep_step_buffers` a 1024-token prefill in the engine 1546-1617 -> 1491-1515
ms, a prefill step of `pdserve bench step` (32 prompts of 256) 2297-2306 -> 2143-2153 ms.
Tasks of 16 or 64 positions ran level with 32 there.

Built and loaded by `engine.native`; `kernel_for` returns None when that fails or the KV
dtype is not float32/bfloat16, and callers use the torch path.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .. import native
from .paged_decode import _FLAGS

_SOURCE = Path(__file__).with_name("prefill_attention.c")
_SYMBOLS = {torch.float32: "prefill_attention_f32", torch.bfloat16: "prefill_attention_bf16"}
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES = [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _i64, ctypes.c_float, _ptr, ctypes.c_int]


def kernel_for(dtype: torch.dtype, device: torch.device):
    """The kernel for a KV cache of `dtype` on `device`, or None (use the torch path)."""
    if device.type != "cpu" or dtype not in _SYMBOLS:
        return None
    lib = native.load(_SOURCE, _FLAGS, {name: _ARGTYPES for name in _SYMBOLS.values()})
    return getattr(lib, _SYMBOLS[dtype]) if lib is not None else None


def prefill_attention(kernel, q, k_cache, v_cache, pages: torch.Tensor, context_len: int, scale: float,
                      out: torch.Tensor) -> None:
    """Write into `out` [n, H, D] (any dtype; float32 contiguous is written directly) the
    attention of q [n, H, D], positions context_len - n .. context_len - 1, over the first
    `context_len` slots of `pages` (int32, contiguous) in one layer's k_cache / v_cache
    [num_pages, page_size, Hkv, D] page views (packed rows, equal strides: see
    torch_ops.rows_packed)."""
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
