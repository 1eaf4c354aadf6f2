"""Paged attention and KV writes in plain torch (the CPU path).

Signatures are shared with `triton_ops`: k_cache / v_cache are one layer's
`[num_pages, page_size, num_kv_heads, head_dim]` views of the page-major KV cache
(`kv_cache[:, layer, 0]` / `kv_cache[:, layer, 1]`): strided over pages (a page is
`num_layers * 2 * page_size * Hkv * D` elements further on), each page's rows contiguous.
Slot s is `[s // page_size, s % page_size]`.

For speed the work is split in two: `plan_attention` turns a step's page tables into gather
indices and masks once per step (plain Python lists in, a few small tensors out), and
`attend` runs every layer from that plan. Each run of consecutive decodes (one query each)
is one call of the C paged-decode kernel (`paged_decode`), and each prefill chunk one call
of the C prefill kernel (`prefill_attention`): both read K/V straight from the pages.
Without those kernels (no compiler, fp16, not CPU), decodes are grouped by context length
so each group is one page gather and one SDPA call; query heads that share a KV head act as
that KV head's query rows, so GQA needs no repeated K/V. Prefill chunks then gather their
pages and run SDPA one sequence at a time, causal over the new tokens and full over the
cached prefix. Capped scores (Gemma 2) and attention sinks (GPT-OSS), which neither SDPA nor
the prefill kernel takes, run those groups and chunks through `capped_attention` instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pdserve.arith import ceil_div

from .paged_decode import kernel_for, paged_decode
from .prefill_attention import kernel_for as prefill_kernel_for
from .prefill_attention import prefill_attention

# A decode group grows while its padded size stays within this factor of its real size.
_PADDING_SLACK = 1.3
_CAPPED_ROWS = 256  # query rows a block of `capped_attention`


@dataclass
class DecodeGroup:
    rows: slice  # query rows, contiguous
    pages: torch.Tensor  # int64 [B, P], padded with page 0
    mask: torch.Tensor | None  # bool [B, 1, 1, P * page_size], None when nothing is padded


@dataclass
class DecodeRun:
    """Consecutive decodes for the C kernel: no padding copies, any mix of lengths."""

    rows: slice
    block_tables: torch.Tensor  # int32 [B, max_pages], padded with page 0
    seq_lens: torch.Tensor  # int32 [B]
    kernel: object
    window: int = 0  # a sliding window (each query sees its last `window` positions); 0: all


@dataclass
class PrefillSeq:
    rows: slice
    pages: torch.Tensor  # int64 [P] (int32 for the kernel)
    context_len: int
    mask: torch.Tensor | None  # bool [n, context_len - first_key]; None: plain causal (no cached prefix)
    kernel: object = None  # the C prefill kernel, which needs no mask
    first_key: int = 0  # the position of `pages`' first key (a sliding window skips those before)


@dataclass
class AttentionPlan:
    page_size: int
    softcap: float = 0.0  # > 0: each scaled score s is softcap * tanh(s / softcap) (Gemma 2)
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    decode_runs: list[DecodeRun] = field(default_factory=list)
    prefills: list[PrefillSeq] = field(default_factory=list)


def plan_attention(
    query_lens: list[int], seq_lens: list[int], page_lists: list[list[int]], page_size: int, device="cpu",
    kv_dtype: torch.dtype | None = None, window: int = 0, softcap: float = 0.0,
) -> AttentionPlan:
    """Plan for sequences whose queries are consecutive rows, in the given order, over a
    KV cache of `kv_dtype` (None: never the C kernel). Runs of consecutive decodes
    (query_len 1) are one kernel call, or without the kernel grouped by length; callers
    that sort decodes by `seq_len` get the tightest groups. `window` > 0: each query sees
    only its last `window` keys (itself included), as transformers' sliding window does: the
    decode kernel skips the pages before it, and prefill chunks, whose kernel takes no
    window, run the torch path's SDPA under a window mask. `softcap` > 0 caps the scores
    (`AttentionPlan.softcap`): the decode kernel does, and prefill chunks run plain torch."""
    plan = AttentionPlan(page_size, softcap)
    kernel = kernel_for(kv_dtype, torch.device(device)) if kv_dtype is not None else None
    prefill_kernel = (prefill_kernel_for(kv_dtype, torch.device(device))
                      if kv_dtype is not None and not window and not softcap else None)
    row = 0
    b = 0
    while b < len(query_lens):
        if query_lens[b] != 1:
            n, ctx = query_lens[b], seq_lens[b]
            num_pages = ceil_div(ctx, page_size)
            if prefill_kernel is not None:
                pages = torch.tensor(page_lists[b][:num_pages], dtype=torch.int32)
                plan.prefills.append(PrefillSeq(slice(row, row + n), pages, ctx, None, prefill_kernel))
                row += n
                b += 1
                continue
            # Under a window no query of the chunk sees a key before ctx - n - window + 1: the
            # pages wholly before it are not gathered.
            first_page = max(0, ctx - n - window + 1) // page_size if window else 0
            first_key = first_page * page_size
            pages = torch.tensor(page_lists[b][first_page:num_pages], dtype=torch.int64, device=device)
            mask = _prefill_mask(n, ctx, first_key, window, device)
            plan.prefills.append(PrefillSeq(slice(row, row + n), pages, ctx, mask, first_key=first_key))
            row += n
            b += 1
            continue
        start = b
        if kernel is not None:
            while b < len(query_lens) and query_lens[b] == 1:
                b += 1
            plan.decode_runs.append(_decode_run(row, seq_lens[start:b], page_lists[start:b], page_size, kernel, window))
            row += b - start
            continue
        total = 0
        while b < len(query_lens) and query_lens[b] == 1:
            longest = max(seq_lens[start:b + 1])
            total += seq_lens[b]
            if b > start and (b + 1 - start) * longest > _PADDING_SLACK * total + page_size:
                break
            b += 1
        plan.decode_groups.append(_decode_group(row, seq_lens[start:b], page_lists[start:b], page_size, device, window))
        row += b - start
    return plan


def _prefill_mask(n, ctx, first_key, window, device) -> torch.Tensor | None:
    """bool [n, ctx - first_key], True where a chunk's query sees a key; None: plain causal."""
    if ctx == n and not (window and ctx > window):
        return None
    q_pos = torch.arange(ctx - n, ctx, device=device).unsqueeze(1)
    keys = torch.arange(first_key, ctx, device=device).unsqueeze(0)
    return (keys <= q_pos) & (keys > q_pos - window) if window else keys <= q_pos


def _padded_pages(lens, page_lists, page_size) -> tuple[int, list[list[int]]]:
    """(pages of the longest sequence, each sequence's pages padded with page 0 to that)."""
    num_pages = ceil_div(max(lens), page_size)
    return num_pages, [pl[:ceil_div(n, page_size)] + [0] * (num_pages - ceil_div(n, page_size))
                       for pl, n in zip(page_lists, lens)]


def _decode_group(row, lens, page_lists, page_size, device, window: int = 0) -> DecodeGroup:
    num_pages, padded = _padded_pages(lens, page_lists, page_size)
    pages = torch.tensor(padded, dtype=torch.int64, device=device)
    mask = None
    if any(n != num_pages * page_size for n in lens) or (window and max(lens) > window):
        lens_t = torch.tensor(lens, device=device).view(-1, 1, 1, 1)
        keys = torch.arange(num_pages * page_size, device=device).view(1, 1, 1, -1)
        mask = (keys < lens_t) & (keys >= lens_t - window) if window else keys < lens_t
    return DecodeGroup(slice(row, row + len(lens)), pages, mask)


def _decode_run(row, lens, page_lists, page_size, kernel, window: int = 0) -> DecodeRun:
    _, padded = _padded_pages(lens, page_lists, page_size)
    block_tables = torch.tensor(padded, dtype=torch.int32)
    return DecodeRun(slice(row, row + len(lens)), block_tables, torch.tensor(lens, dtype=torch.int32), kernel, window)


def store_kv(k_cache, v_cache, k, v, slot_mapping) -> None:
    """Write k/v [T, Hkv, D] into the slots `slot_mapping` (int64 [T])."""
    # A page's rows are adjacent but pages lie a whole page of every layer apart, so no
    # [num_slots, ...] view exists: index the (page, offset) pair.
    page_size = k_cache.shape[1]
    where = (torch.div(slot_mapping, page_size, rounding_mode="floor"), slot_mapping % page_size)
    k_cache.index_put_(where, k.to(k_cache.dtype))
    v_cache.index_put_(where, v.to(v_cache.dtype))


def rows_packed(k_cache, v_cache) -> bool:
    """Whether each page's rows are contiguous and K and V share their strides and dtype
    (what the C kernel reads; the engine's page views always are)."""
    _, _, num_kv_heads, head_dim = k_cache.shape
    return (
        k_cache.dtype == v_cache.dtype and k_cache.stride() == v_cache.stride()
        and k_cache.stride()[1:] == (num_kv_heads * head_dim, head_dim, 1)
    )


def attend(q: torch.Tensor, k_cache, v_cache, plan: AttentionPlan, scale: float,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """out [T, H, D] for q [T, H, D] under `plan`. `sinks`, float32 [H] on q's device or
    None: query head h's softmax has one more score, sinks[h] (natural-log units, like the
    scaled and capped scores), whose weight is dropped (GPT-OSS's attention sinks). SDPA
    and the C prefill kernel take no sink: with sinks, their work runs `capped_attention`."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    if sinks is not None and sinks.shape != (num_heads,):
        raise ValueError(f"sinks must be one per query head, [{num_heads}], got {tuple(sinks.shape)}")
    manual = bool(plan.softcap) or sinks is not None  # SDPA cannot run these
    page_size = plan.page_size
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for r in plan.decode_runs:
        dest = out[r.rows]
        o = paged_decode(r.kernel, q[r.rows], k_cache, v_cache, r.block_tables, r.seq_lens, page_size, scale, dest,
                         r.window, plan.softcap, sinks)
        if o.data_ptr() != dest.data_ptr():
            dest.copy_(o)
    # index_select over pages gathers the chosen pages into one contiguous tensor, whatever
    # the page stride of the views, so the views below are free.
    for g in plan.decode_groups:
        b, p = g.pages.shape
        flat = g.pages.view(-1)
        k = k_cache.index_select(0, flat).view(b, p * page_size, num_kv_heads, head_dim).transpose(1, 2)
        v = v_cache.index_select(0, flat).view(b, p * page_size, num_kv_heads, head_dim).transpose(1, 2)
        # The `group` query heads of one KV head are that head's queries: [B, Hkv, G, D].
        qg = q[g.rows].view(b, num_kv_heads, group, head_dim)
        if manual:
            mask = g.mask if g.mask is not None else torch.ones(1, dtype=torch.bool, device=q.device)
            o = capped_attention(qg, k, v, mask, scale, plan.softcap,
                                 None if sinks is None else sinks.view(num_kv_heads, group, 1))
        else:
            o = F.scaled_dot_product_attention(qg, k, v, attn_mask=g.mask, scale=scale)
        out[g.rows] = o.reshape(b, num_heads, head_dim)
    for s in plan.prefills:
        ctx = s.context_len
        if s.kernel is not None:
            if sinks is None:
                prefill_attention(s.kernel, q[s.rows], k_cache, v_cache, s.pages, ctx, scale, out[s.rows])
                continue
            if s.mask is None:  # planned for the kernel, which needs none: made once, for all layers
                s.mask = _prefill_mask(s.rows.stop - s.rows.start, ctx, 0, 0, q.device)
        keys = ctx - s.first_key
        k = k_cache.index_select(0, s.pages).view(-1, num_kv_heads, head_dim)[:keys].transpose(0, 1)
        v = v_cache.index_select(0, s.pages).view(-1, num_kv_heads, head_dim)[:keys].transpose(0, 1)
        qs = q[s.rows].transpose(0, 1)  # [H, n, D]
        if manual:
            n = qs.shape[1]
            mask = s.mask if s.mask is not None else torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            o = capped_attention(qs.reshape(num_kv_heads, group, n, head_dim), k.unsqueeze(1), v.unsqueeze(1), mask,
                                 scale, plan.softcap, None if sinks is None else sinks.view(num_kv_heads, group, 1, 1)
                                 ).reshape(num_heads, n, head_dim)
            out[s.rows] = o.transpose(0, 1)
            continue
        o = F.scaled_dot_product_attention(
            qs.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
            attn_mask=s.mask, is_causal=s.mask is None, scale=scale, enable_gqa=group > 1,
        )
        out[s.rows] = o[0].transpose(0, 1)
    return out


def capped_attention(q, k, v, mask, scale: float, softcap: float = 0.0, sinks=None) -> torch.Tensor:
    """Attention in plain matmuls, as transformers' eager path runs what SDPA takes no part
    in: softcap > 0 caps the scaled scores, softcap * tanh(s / softcap), before the mask and
    the softmax (Gemma 2); `sinks` (float32 broadcast to [..., n, 1], a query head's each; None:
    none) are one more score column of each softmax, dropped after it (GPT-OSS). q [..., n,
    D] against k, v [..., c, D], broadcast (a KV head's query heads share its keys); mask:
    bool, broadcast to the scores [..., n, c], True where a query sees a key. Queries go
    `_CAPPED_ROWS` at a time, so the scores held stay small whatever the chunk and context."""
    n = q.shape[-2]
    out = []
    for i in range(0, n, _CAPPED_ROWS):
        s = torch.matmul(q[..., i:i + _CAPPED_ROWS, :], k.transpose(-1, -2)) * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        rows = mask if mask.dim() < 2 or mask.shape[-2] == 1 else mask[..., i:i + _CAPPED_ROWS, :]
        s = s.masked_fill(~rows, float("-inf"))
        if sinks is None:
            p = torch.softmax(s, dim=-1, dtype=torch.float32)
        else:
            p = torch.softmax(torch.cat([s.float(), sinks.expand(*s.shape[:-1], 1)], dim=-1), dim=-1)[..., :-1]
        out.append(torch.matmul(p.to(q.dtype), v))
    return out[0] if len(out) == 1 else torch.cat(out, dim=-2)


def paged_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, page_size: int, scale: float,
                    sinks: torch.Tensor | None = None):
    """Attention of q [T, H, D] over the paged cache, see the module docstring and the
    contract: sequence b's queries are rows query_start_loc[b]:query_start_loc[b+1], the
    last positions of a context of seq_lens[b] tokens. `sinks`: as `attend`'s."""
    starts = query_start_loc.tolist()
    query_lens = [e - s for s, e in zip(starts[:-1], starts[1:])]
    if k_cache.shape[1] != page_size:
        raise ValueError(f"k_cache has pages of {k_cache.shape[1]} slots, but page_size={page_size}")
    kv_dtype = k_cache.dtype if rows_packed(k_cache, v_cache) else None
    plan = plan_attention(query_lens, seq_lens.tolist(), block_tables.tolist(), page_size, q.device, kv_dtype)
    return attend(q, k_cache, v_cache, plan, scale, sinks)
