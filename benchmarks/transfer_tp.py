"""``pdserve bench transfer --tp A:B``: the KV window between two tensor-parallel nodes.

The sender has A pools and the receiver process B (``kv_receiver``); rank ``r`` of a side
holds the KV heads ``head_ranges(kv_heads, world)[r]`` in its own pool, and each side's one
agent registers all its pools, as a TP node's agent does. The plan goes straight from
source rank pools to destination rank pools (head slices). Invariants:
- The plan moves exactly the window's bytes for every head each destination rank holds
  (``expected_bytes``), and ``check_plan`` accepts it (on its first ``CHECK_TOKENS``
  positions: it walks every head in Python) before anything is timed.
- All ranks' descriptors go in one write, so per-rank rates share the window's median time.
- A head held by several source ranks is read from the lowest-rank one (as ``plan.py``
  does), so that is the copy whose data must arrive.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import numpy as np

from pdserve.kvtransfer.layout import KVLayout
from pdserve.kvtransfer.plan import TransferPlan, check_plan, plan_transfer
from pdserve.kvtransfer.shards import KVShard, KVShards, head_ranges

CHECK_TOKENS = 4096  # check_plan takes about 5 s on 4096 tokens x 30 layers x 3 heads


def parse_tp(text: str) -> tuple[int, int]:
    """``A:B`` (sender ranks, receiver ranks), for argparse."""
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not SENDER_RANKS:RECEIVER_RANKS; give both rank counts, e.g. --tp 2:2 "
            "(1:1 is no tensor parallelism)") from None
    if a <= 0 or b <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: rank counts must be positive, e.g. --tp 1:2")
    return a, b


def tp_problem(tp: tuple[int, int], kv_heads: int) -> str | None:
    """Why ``--tp`` cannot split ``kv_heads`` heads as ``head_ranges`` requires, or None."""
    for side, world in zip(("sender", "receiver"), tp):
        try:
            head_ranges(kv_heads, world)
        except ValueError as err:
            return f"--tp {tp[0]}:{tp[1]} with --kv-heads {kv_heads} (the {side}'s {world} ranks): {err}"
    return None


def owners(src: KVShards) -> list[int]:
    """For each model head, the index of the lowest-rank source shard holding it."""
    by_rank = sorted(range(len(src.shards)), key=lambda i: (src.shards[i].rank, i))
    return [next(i for i in by_rank if src.shards[i].head_begin <= h < src.shards[i].head_end)
            for h in range(src.num_kv_heads)]


def _sent_heads(kv_heads: int, src_ranges: list[tuple[int, int]], dst_ranges: list[tuple[int, int]]) -> list[int]:
    """Heads each source rank sends (a head twice if two destination ranks hold it)."""
    sent = [0] * len(src_ranges)
    for h in range(kv_heads):
        owner = next(r for r, (b, e) in enumerate(src_ranges) if b <= h < e)
        sent[owner] += sum(b <= h < e for b, e in dst_ranges)
    return sent


def sender_pools(a: argparse.Namespace, max_tokens: int, src_need: int) -> tuple[list[Any], KVShards]:
    """The sender's rank pools (uninitialised) and their shards, all with the same page count
    (``KVShards`` requires it), at least ``src_need`` pages."""
    from pdserve.benchmarks.kv_receiver import PoolSpec, allocate

    tp = a.tp or (1, 1)
    src_ranges = head_ranges(a.kv_heads, tp[0])
    sent = _sent_heads(a.kv_heads, src_ranges, head_ranges(a.kv_heads, tp[1]))
    # room for the memcpy destination: each rank copies what it sends within its own pool
    pages = max([src_need] + [math.ceil(2 * max_tokens * s / ((e - b) * a.page_size))
                              for s, (b, e) in zip(sent, src_ranges)])
    pools, shards = [], []
    for rank, (b, e) in enumerate(src_ranges):
        spec = PoolSpec(a.layers, e - b, a.head_dim, a.page_size, pages, a.dtype, a.layout)
        pools.append(allocate(spec.shape, a.dtype, a.huge_pages))
        shards.append(KVShard(KVLayout.from_tensor(pools[-1], a.page_size), b, rank))
    return pools, KVShards(tuple(shards), a.kv_heads)


def as_side(shards: KVShards) -> KVLayout | KVShards:
    """What to plan with: a one-pool side as its layout (the plan without tensor parallelism)."""
    return shards.shards[0].layout if len(shards.shards) == 1 else shards


def expected_bytes(tokens: int, dst: KVShards) -> int:
    """The window's bytes: every head each destination rank holds, all layers, K and V."""
    heads = sum(sh.head_end - sh.head_begin for sh in dst.shards)
    return tokens * dst.num_layers * 2 * dst.head_dim * dst.itemsize * heads


def check_window(plan: TransferPlan, src: KVShards, src_slots: list[int], dst: KVShards,
                 dst_slots: list[int]) -> int:
    """Fail loudly unless the plan moves the window's bytes and ``check_plan`` accepts it (or,
    past ``CHECK_TOKENS``, a plan of the window's first positions); the positions checked."""
    want = expected_bytes(len(src_slots), dst)
    if plan.total_bytes != want:
        raise RuntimeError(f"the plan moves {plan.total_bytes} bytes but the window of {len(src_slots)} "
                           f"tokens is {want} bytes over the destination ranks' heads")
    n = min(len(src_slots), CHECK_TOKENS)
    if n < len(src_slots):
        plan = plan_transfer(as_side(src), src_slots[:n], as_side(dst), dst_slots[:n])
    check_plan(plan, src, src_slots[:n], dst, dst_slots[:n])
    return n


def _pool_of(addrs: np.ndarray, sizes: np.ndarray, shards: KVShards) -> np.ndarray:
    """Index of the shard whose pool holds each descriptor (all of it, or raise)."""
    bases = np.array([sh.layout.base_addr for sh in shards.shards], dtype=np.uint64)
    ends = bases + np.array([sh.layout.extent for sh in shards.shards], dtype=np.uint64)
    order = np.argsort(bases)
    idx = order[np.clip(np.searchsorted(bases[order], addrs, side="right") - 1, 0, None)]
    outside = (addrs < bases[idx]) | (addrs + sizes > ends[idx])
    if outside.any():
        k = int(np.flatnonzero(outside)[0])
        raise RuntimeError(f"descriptor at {int(addrs[k]):#x} ({int(sizes[k])} bytes) lies in no single pool")
    return idx


def pair_bytes(plan: TransferPlan, src: KVShards, dst: KVShards) -> np.ndarray:
    """``[A, B]`` bytes the plan moves from each source pool to each destination pool."""
    out = np.zeros((len(src.shards), len(dst.shards)), dtype=np.int64)
    np.add.at(out, (_pool_of(plan.src_addrs, plan.sizes, src), _pool_of(plan.dst_addrs, plan.sizes, dst)),
              plan.sizes.astype(np.int64))
    return out


def _chunks(src: int, dst: int, nbytes: int, chunks: int, unit: int) -> list[tuple[int, int, int]]:
    """One contiguous span, cut into ``chunks`` near-equal descriptors (``unit``-aligned)."""
    cuts = [min(nbytes, round(nbytes * i / chunks / unit) * unit) for i in range(chunks + 1)]
    cuts[-1] = nbytes
    return [(src + a, dst + a, b - a) for a, b in zip(cuts[:-1], cuts[1:]) if b > a]


def raw_descriptors(pairs: np.ndarray, src: KVShards, dst: KVShards, chunks: int) -> list[tuple[int, int, int]]:
    """The plan's bytes as one contiguous span per (source pool, destination pool) pair, cut
    into ``chunks``: a NIXL descriptor stays inside one registered region, so no fewer
    descriptors can move the same bytes between these pools. Spans follow each other in
    every pool (the sender's pools hold twice what they send)."""
    out: list[tuple[int, int, int]] = []
    read, written = [0] * len(src.shards), [0] * len(dst.shards)
    for i, a in enumerate(src.shards):
        for j, b in enumerate(dst.shards):
            n = int(pairs[i, j])
            if n:
                out += _chunks(a.layout.base_addr + read[i], b.layout.base_addr + written[j], n, chunks,
                               a.layout.bytes_per_slot)
                read[i] += n
                written[j] += n
    return out


def per_rank(plan: TransferPlan, src: KVShards, dst: KVShards, seconds: float) -> dict[str, list[dict]]:
    """Bytes, descriptors and rate of each destination and source rank over the one write's
    median time (``gbps`` in GB/s, as ``kv_gbps``)."""
    sizes = plan.sizes.astype(np.int64)

    def side(shards: KVShards, idx: np.ndarray) -> list[dict]:
        rows = []
        for k, sh in enumerate(shards.shards):
            nbytes = int(sizes[idx == k].sum())
            rows.append({"rank": sh.rank, "heads": [sh.head_begin, sh.head_end], "bytes": nbytes,
                         "descriptors": int((idx == k).sum()), "gbps": round(nbytes / seconds / 1e9, 6)})
        return rows

    return {"dst": side(dst, _pool_of(plan.dst_addrs, plan.sizes, dst)),
            "src": side(src, _pool_of(plan.src_addrs, plan.sizes, src))}


def heads_arrived(pools: list[Any], src: KVShards, receiver: Any, src_slots: list[int],
                  dst_slots: list[int]) -> bool:
    """Every head each destination rank holds, at ``dst_slots``, equals that head at
    ``src_slots`` in the source rank it is read from (per-head checksums)."""
    from pdserve.benchmarks.kv_receiver import head_checksums

    sums = [head_checksums(pool, src_slots).numpy() for pool in pools]
    want = [sums[i][..., h - src.shards[i].head_begin] for h, i in enumerate(owners(src))]
    for j, sh in enumerate(receiver.shards.shards):
        got = receiver.head_checksums(j, dst_slots)
        if not (got == np.stack(want[sh.head_begin:sh.head_end], axis=-1)).all():
            return False
    return True


def tp_fields(a: argparse.Namespace, plan: TransferPlan, src: KVShards, dst: KVShards, seconds: float,
              checked_tokens: int) -> dict[str, Any]:
    return {"tp": f"{a.tp[0]}:{a.tp[1]}", "expected_bytes": expected_bytes(plan.num_tokens, dst),
            "plan_checked_tokens": checked_tokens, "per_rank": per_rank(plan, src, dst, seconds)}
