"""Paged attention and KV writes as Triton kernels (the GPU path).

Same signatures as `cpu_ops`: k_cache / v_cache are one layer's
`[num_pages, page_size, num_kv_heads, head_dim]` views of the page-major KV cache, strided
over pages; slot s is `[s // page_size, s % page_size]`. The kernels take every stride, so
any view with a unit last stride works.

Invariants:
- Importing this module never imports triton: CPU-only installs keep working, and the
  kernels are jitted on first use, so `TRITON_INTERPRET=1` (the CPU interpreter the tests
  use) only has to be set before the first call, not before the import.
- One program of `paged_attention` owns a block of one sequence's queries for all the query
  heads of one KV head (GQA of any ratio: each K/V tile is loaded once for the whole group).
  It walks the context in tiles with an online softmax, full over the cached prefix and
  causal over the new tokens. Decode is the case of one query.
- A decode batch too small to fill the GPU (one sequence of 8 KV heads is 8 programs) cuts
  each context into splits of whole tiles, a program each, whose outputs and log-sum-exps
  a second kernel combines (flash-decoding). How many depends on the batch's shape only,
  so a CUDA graph captured for a batch size stays right for any lengths.
- Any head_dim up to 256 (padded to a power of two inside the kernel, masked) and any page
  size, including 1 and non-powers of two: each key position finds its page by division.
- fp32 inputs use IEEE fp32 dot products (no TF32), so fp32 results match the torch path.
"""

from __future__ import annotations

import functools

import torch

from pdserve.arith import ceil_div

from ..triton_jit import kernel

triton = None
tl = None  # triton.language; bound on first use (engine/triton_jit.py) so the kernels see it

MAX_HEAD_DIM = 256
MAX_SPLITS = 16  # splits of one decode's context (flash-decoding); the combine's width


def _store_kv_kernel(
    K, V, KCache, VCache, SlotMapping, page_size,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcp, stride_kcs, stride_kch, stride_vcp, stride_vcs, stride_vch,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(SlotMapping + t).to(tl.int64)
    if slot >= 0:  # a negative slot marks a padding token: nothing to write
        d = tl.arange(0, HEAD_DIM_PAD)
        mask = d < HEAD_DIM
        k = tl.load(K + t * stride_kt + h * stride_kh + d, mask=mask)
        v = tl.load(V + t * stride_vt + h * stride_vh + d, mask=mask)
        page, offset = slot // page_size, slot % page_size
        tl.store(KCache + page * stride_kcp + offset * stride_kcs + h * stride_kch + d,
                 k.to(KCache.dtype.element_ty), mask=mask)
        tl.store(VCache + page * stride_vcp + offset * stride_vcs + h * stride_vch + d,
                 v.to(VCache.dtype.element_ty), mask=mask)


def _paged_attention_kernel(
    Q, KCache, VCache, Out, Lse, BlockTables, QueryStartLoc, SeqLens, Sinks,
    scale_log2e, page_size, num_splits, window, softcap,
    stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_ot, stride_oh, stride_os, stride_lt, stride_lh, stride_bt,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    NUM_Q_PER_KV: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, SPLIT: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    if SPLIT:  # decode only: the third axis cuts the context, and there is one query block
        split = tl.program_id(2)
        m_block = 0
    else:
        split = 0
        m_block = tl.program_id(2)
    q_start = tl.load(QueryStartLoc + b)
    num_new = tl.load(QueryStartLoc + b + 1) - q_start
    seq_len = tl.load(SeqLens + b)
    if m_block * BLOCK_M < num_new:
        # Rows are (query, head-in-group) pairs: BLOCK_M queries x GROUP_PAD heads.
        rows = tl.arange(0, BLOCK_M * GROUP_PAD)
        m = m_block * BLOCK_M + rows // GROUP_PAD
        head = kv_head * NUM_Q_PER_KV + rows % GROUP_PAD
        row_ok = (m < num_new) & (rows % GROUP_PAD < NUM_Q_PER_KV)
        d = tl.arange(0, HEAD_DIM_PAD)
        d_ok = d < HEAD_DIM
        q_rows = (q_start + m).to(tl.int64)
        q = tl.load(Q + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        q_pos = seq_len - num_new + m  # absolute position of each row's query

        m_i = tl.full([BLOCK_M * GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M * GROUP_PAD], tl.float32)
        acc = tl.zeros([BLOCK_M * GROUP_PAD, HEAD_DIM_PAD], tl.float32)
        if HAS_SINKS:
            # The sink is one more score (base 2 here) with no value: the softmax starts from
            # it. Split 0 alone does, so the combine (one softmax over the splits' log-sum-exps)
            # counts it once.
            m_i = tl.load(Sinks + head, mask=row_ok, other=float("-inf")) * 1.4426950408889634
            if SPLIT:
                m_i = tl.where(split == 0, m_i, float("-inf"))
            l_i = tl.where(m_i > float("-inf"), 1.0, 0.0)
        # The block's last query sees positions up to its own: nothing after it is loaded;
        # under a sliding window its first query sees none before its last `window`.
        kv_end = tl.minimum(seq_len, seq_len - num_new + (m_block + 1) * BLOCK_M)
        first = tl.maximum(seq_len - num_new + m_block * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N
        kv_begin = tl.where(window > 0, first, 0)
        if SPLIT:  # this program's split: whole tiles, the last split shorter or empty
            chunk = tl.cdiv(tl.cdiv(kv_end - kv_begin, num_splits), BLOCK_N) * BLOCK_N
            lo = kv_begin + split * chunk
            hi = tl.minimum(kv_end, lo + chunk)
        else:
            lo = kv_begin
            hi = kv_end
        for start in range(lo, hi, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            pos_ok = pos < hi
            page = tl.load(BlockTables + b * stride_bt + pos // page_size, mask=pos_ok, other=0)
            page = page.to(tl.int64)
            offset = (pos % page_size).to(tl.int64)
            k_row = page * stride_kp + offset * stride_ks + kv_head * stride_kh
            v_row = page * stride_vp + offset * stride_vs + kv_head * stride_vh
            kv_mask = pos_ok[:, None] & d_ok[None, :]
            k = tl.load(KCache + k_row[:, None] + d[None, :], mask=kv_mask, other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * scale_log2e
            if softcap > 0:  # Gemma 2: cap * tanh(score / cap), the score in natural units
                x = s * (0.6931471805599453 / softcap)  # ln 2: s is in base-2 units
                s = softcap * 1.4426950408889634 * (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0))
            visible = (pos[None, :] <= q_pos[:, None]) & pos_ok[None, :]
            if window > 0:
                visible = visible & (pos[None, :] > q_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # Rows that have seen nothing yet (padding rows) keep a finite reference point.
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_ref[:, None])
            alpha = tl.exp2(m_i - m_ref)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(VCache + v_row[:, None] + d[None, :], mask=kv_mask, other=0.0)
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(Out + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + split * stride_os + d[None, :],
                 out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        if SPLIT:  # the split's log-sum-exp (base 2), which weighs it in the combine; -inf if empty
            lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
            tl.store(Lse + q_rows * stride_lt + head * stride_lh + split, lse, mask=row_ok)


def _combine_splits_kernel(
    Partial, Lse, Out, num_splits,
    stride_pt, stride_ph, stride_ps, stride_lt, stride_lh, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    s_ok = s < num_splits
    lse = tl.load(Lse + t * stride_lt + h * stride_lh + s, mask=s_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    # Split 0 is empty only for an empty context: then every weight is 0 and so is the output
    # (as without splits), not -inf - -inf = NaN.
    weight = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    part = tl.load(Partial + t * stride_pt + h * stride_ph + s[:, None] * stride_ps + d[None, :],
                   mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    total = tl.sum(weight, 0)
    out = tl.sum(part * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(Out + t * stride_ot + h * stride_oh + d, out.to(Out.dtype.element_ty), mask=d_ok)


def _load(name: str):
    return kernel(globals(), name)


def _pow2_at_least(n: int, floor: int = 1) -> int:
    return max(floor, 1 << max(0, n - 1).bit_length())


def store_kv(k_cache, v_cache, k, v, slot_mapping) -> None:
    """Write k/v [T, Hkv, D] into the slots `slot_mapping` (int64 [T]; negative = skip)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    kernel = _load("_store_kv_kernel")
    kernel[(num_tokens, num_kv_heads)](
        k, v, k_cache, v_cache, slot_mapping, k_cache.shape[1],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=_pow2_at_least(head_dim),
    )


def paged_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, page_size: int, scale: float,
                    max_query_len: int | None = None, num_splits: int | None = None,
                    launch: tuple[int, int, int] | None = None, window: int = 0, softcap: float = 0.0,
                    sinks: torch.Tensor | None = None):
    """Attention of q [T, H, D] over the paged cache: sequence b's queries are rows
    query_start_loc[b]:query_start_loc[b+1], the last positions of a context of
    seq_lens[b] tokens (causal over them, full over the cached prefix).

    `max_query_len`, the most queries of any sequence, when the caller knows it: then
    nothing here reads a tensor's values, so the call is CUDA-graph capturable and never
    waits for the device (otherwise it is read from query_start_loc).

    `num_splits` (decodes only: `max_query_len` 1) cuts each context into that many splits
    attended by programs of their own, then combined; None: as many as fill the GPU
    (`decode_splits`), 1 on a CPU. `launch` overrides `launch_config`'s (rows, tile, warps):
    benchmarks compare tiles with it. `window` > 0: each query sees its last `window`
    positions only (a sliding-window layer); `softcap` > 0: each scaled score s is
    softcap * tanh(s / softcap) (Gemma 2). `sinks`, float32 [H] on q's device or None:
    query head h's softmax has one more score, sinks[h] (natural-log units, like the scaled
    and capped scores), whose weight is dropped (GPT-OSS's attention sinks)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[1] != page_size:
        raise ValueError(f"k_cache has pages of {k_cache.shape[1]} slots, but page_size={page_size}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} > {MAX_HEAD_DIM} is not supported by the Triton kernel")
    if sinks is not None and sinks.shape != (num_heads,):
        raise ValueError(f"sinks must be one per query head, [{num_heads}], got {tuple(sinks.shape)}")
    out = torch.empty_like(q)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    group = num_heads // num_kv_heads
    group_pad = _pow2_at_least(group)
    max_new = max_query_len or int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if num_splits is None:
        num_splits = decode_splits(num_seqs, num_kv_heads, q.device) if max_new == 1 else 1
    if num_splits > 1 and max_new != 1:
        raise ValueError(f"num_splits={num_splits} needs decodes alone (one query a sequence), got {max_new}")
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    head_dim_pad = _pow2_at_least(head_dim, 16)
    ieee = q.dtype == torch.float32
    if launch is None:
        rows, block_n, num_warps = launch_config(head_dim, ieee, max_new == 1, group_pad)
    else:
        rows, block_n, num_warps = launch
        if rows < 16 or block_n < 16 or rows & (rows - 1) or block_n & (block_n - 1):
            raise ValueError(f"launch {launch}: rows and tile must be powers of two >= 16 (tl.dot's least)")
    block_m = max(1, rows // group_pad)
    split = num_splits > 1
    if split:  # each split's output (fp32) and log-sum-exp, for the combine
        part = torch.empty(num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=q.device)
        grid = (num_seqs, num_kv_heads, num_splits)
    else:
        part, lse = out, out  # lse: not read or written without splits
        grid = (num_seqs, num_kv_heads, ceil_div(max_new, block_m))
    kernel = _load("_paged_attention_kernel")
    kernel[grid](
        q, k_cache, v_cache, part, lse, block_tables, query_start_loc, seq_lens,
        q if sinks is None else sinks.to(torch.float32).contiguous(),  # q: never read without sinks
        scale * 1.4426950408889634, page_size, num_splits, window, float(softcap),  # log2(e): the kernel uses exp2
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), part.stride(0), part.stride(1),
        part.stride(2) if split else 0, lse.stride(0) if split else 0, lse.stride(1) if split else 0,
        block_tables.stride(0),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        NUM_Q_PER_KV=group, GROUP_PAD=group_pad,
        BLOCK_M=block_m, BLOCK_N=block_n, IEEE=ieee, SPLIT=split, HAS_SINKS=sinks is not None, num_warps=num_warps,
    )
    if split:
        _load("_combine_splits_kernel")[(num_tokens, num_heads)](
            part, lse, out, num_splits,
            part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=_pow2_at_least(head_dim), SPLITS_PAD=MAX_SPLITS,
        )
    return out


# (query rows a program, K/V positions a tile, warps) by (head_dim padded, IEEE fp32, decode).
# tl.dot needs at least 16 rows: decodes fill them with the group's heads; prefills take
# more, to reuse each K/V tile. fp32 dots run on the FMA units (IEEE, for exactness) and
# hold more per thread: their tiles are the ones ptxas compiles for sm_90 without spilling
# registers to local memory, with Triton 3.6 and 3.9 (tests/engine/test_triton_compile.py).
_LAUNCH = {
    (64, False, True): (16, 64, 4), (64, False, False): (64, 64, 4),
    (128, False, True): (16, 64, 4), (128, False, False): (64, 64, 4),
    (256, False, True): (16, 32, 4), (256, False, False): (64, 32, 4),
    (64, True, True): (16, 64, 8), (64, True, False): (32, 32, 8),
    (128, True, True): (16, 32, 8), (128, True, False): (64, 16, 8),
    (256, True, True): (16, 32, 8), (256, True, False): (32, 16, 8),
}


def launch_config(head_dim: int, ieee: bool, decode: bool, group_pad: int = 1) -> tuple[int, int, int]:
    """(rows, tile, warps); a group of more heads than the rows makes the rows, and then a
    tile as much narrower, so that a program holds what the table's does."""
    rows, block_n, warps = _LAUNCH[_pow2_at_least(head_dim, 64), ieee, decode]
    if group_pad > rows:
        rows, block_n = group_pad, max(16, block_n * rows // group_pad)
    return rows, block_n, warps


def decode_splits(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """Splits per context for a decode batch: enough programs for about two per SM of the
    GPU (a batch of one sequence of 8 KV heads is otherwise 8 programs on a 132-SM H200,
    each walking the whole context alone). It depends on the batch's shape alone, never
    on its lengths, so a CUDA graph captured for a batch size keeps it."""
    if device.type != "cuda":
        return 1
    return max(1, min(MAX_SPLITS, 2 * _sm_count(device.index) // (num_seqs * num_kv_heads)))


@functools.cache
def _sm_count(index: int | None) -> int:
    return torch.cuda.get_device_properties(index if index is not None else torch.cuda.current_device()
                                            ).multi_processor_count
