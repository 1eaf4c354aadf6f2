"""Tensor-parallel transfer plans: every destination shard gets exactly its heads, nothing else.

Pools are real fp32 page-major tensors, one per rank, and plans are executed with
``ctypes.memmove`` on their addresses. A source shard's pool is its head slice of one
model-wide reference pool of distinct non-zero values, so every destination head must end
up equal to the reference at the same global head, and every other byte must stay zero.
"""

import ctypes
import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.kvtransfer.layout import KVLayout
from pdserve.kvtransfer.plan import PlanError, check_plan, plan_transfer
from pdserve.kvtransfer.shards import KVShard, KVShards, as_shards, head_ranges

LAYERS, HEAD_DIM, PAGE_SIZE, PAGES = 4, 8, 4, 8


def reference(heads):
    n = PAGES * LAYERS * 2 * PAGE_SIZE * heads * HEAD_DIM
    return torch.arange(1, n + 1, dtype=torch.float32).reshape(PAGES, LAYERS, 2, PAGE_SIZE, heads, HEAD_DIM)


def node(heads, world, ref=None):
    """(KVShards, pools) of a TP=``world`` node: rank pools are ``ref``'s head slices, or zeros."""
    pools, shards = [], []
    for rank, (b, e) in enumerate(head_ranges(heads, world)):
        shape = (PAGES, LAYERS, 2, PAGE_SIZE, e - b, HEAD_DIM)
        pool = torch.zeros(shape) if ref is None else ref[..., b:e, :].clone()
        pools.append(pool)
        shards.append(KVShard(KVLayout.from_tensor(pool, PAGE_SIZE), b, rank))
    return KVShards(tuple(shards), heads), pools


def execute(plan):
    for src, dst, n in plan.descriptors:
        ctypes.memmove(dst, src, n)


def expected_pools(ref, dst, src_slots, dst_slots, layers):
    out = []
    for shard in dst.shards:
        want = torch.zeros(PAGES, LAYERS, 2, PAGE_SIZE, shard.head_end - shard.head_begin, HEAD_DIM)
        for s, d in zip(src_slots, dst_slots):
            for layer in layers:
                want[d // PAGE_SIZE, layer, :, d % PAGE_SIZE] = \
                    ref[s // PAGE_SIZE, layer, :, s % PAGE_SIZE, shard.head_begin:shard.head_end]
        out.append(want)
    return out


def move_and_check(heads, a, b, src_slots, dst_slots, layers=None):
    ref = reference(heads)
    (src, src_pools), (dst, dst_pools) = node(heads, a, ref), node(heads, b)
    plan = plan_transfer(src, src_slots, dst, dst_slots, layers=layers)
    moved = range(LAYERS) if layers is None else layers
    check_plan(plan, src, src_slots, dst, dst_slots, layers=layers)
    execute(plan)
    for got, want in zip(dst_pools, expected_pools(ref, dst, src_slots, dst_slots, moved)):
        assert torch.equal(got, want)  # the right head's values, zeros everywhere else
    held = sum(sh.head_end - sh.head_begin for sh in dst.shards)
    assert plan.total_bytes == len(src_slots) * len(moved) * 2 * held * HEAD_DIM * 4
    assert plan.num_tokens == len(src_slots) and plan.num_layers == len(moved)
    return plan, (src, src_pools), (dst, dst_pools)


CASES = ([(3, a, b) for a, b in [(1, 1), (1, 2), (2, 1), (2, 2), (1, 3), (3, 1), (2, 3)]]
         + [(4, a, b) for a, b in [(1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 1)]]
         + [(1, a, b) for a, b in [(1, 2), (2, 1), (2, 2)]])


@pytest.mark.parametrize("heads,a,b", CASES)
def test_each_destination_shard_gets_exactly_its_heads(heads, a, b):
    move_and_check(heads, a, b, list(range(2, 22)), list(range(5, 25)))


@pytest.mark.parametrize("heads,a,b", [(3, 2, 3), (4, 4, 1), (1, 1, 2), (3, 1, 1)])
def test_fragmented_window_with_a_layer_subset_moves_only_those_layers(heads, a, b):
    src_slots = [p * PAGE_SIZE + o for p in (6, 1, 3) for o in range(PAGE_SIZE)][1:11]
    dst_slots = [p * PAGE_SIZE + o for p in (0, 7, 2) for o in range(PAGE_SIZE)][2:12]
    move_and_check(heads, a, b, src_slots, dst_slots, layers=[1, 3])


def test_whole_slots_on_both_sides_merge_across_pages_even_from_a_replicated_source():
    # same sharding: each rank pair is one pool-to-pool copy of the whole pages
    plan, *_ = move_and_check(4, 2, 2, list(range(8, 24)), list(range(16, 32)))
    assert plan.num_descriptors == 2
    # one source head read by two destination ranks: the repeated source ranges still merge
    plan, *_ = move_and_check(1, 1, 2, list(range(8, 24)), list(range(16, 32)))
    assert plan.num_descriptors == 2
    # part of a slot per side: one descriptor per position, layer and K/V
    plan, *_ = move_and_check(2, 1, 2, list(range(8, 24)), list(range(16, 32)))
    assert plan.num_descriptors == 2 * 16 * LAYERS * 2


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_any_sharding_and_window_passes_check_plan(data):
    heads = data.draw(st.sampled_from([1, 2, 3, 4]))
    worlds = [w for w in (1, 2, 3, 4) if heads >= w or w % heads == 0]
    a, b = data.draw(st.sampled_from(worlds)), data.draw(st.sampled_from(worlds))
    n = data.draw(st.integers(0, 12))
    src_slots = data.draw(st.permutations(range(PAGES * PAGE_SIZE)))[:n]
    dst_slots = sorted(data.draw(st.permutations(range(PAGES * PAGE_SIZE)))[:n])
    layers = data.draw(st.one_of(st.none(), st.sets(st.integers(0, LAYERS - 1), min_size=1).map(sorted)))
    move_and_check(heads, a, b, src_slots, dst_slots, layers=layers)


def test_check_plan_rejects_a_missing_or_duplicated_descriptor():
    plan, (src, _), (dst, _) = move_and_check(3, 2, 3, list(range(2, 10)), list(range(5, 13)))
    args = (src, list(range(2, 10)), dst, list(range(5, 13)))
    fewer = dataclasses.replace(plan, src_addrs=plan.src_addrs[1:], dst_addrs=plan.dst_addrs[1:],
                                sizes=plan.sizes[1:])
    with pytest.raises(PlanError, match="never written"):
        check_plan(fewer, *args)
    twice = dataclasses.replace(plan, src_addrs=np.append(plan.src_addrs, plan.src_addrs[:1]),
                                dst_addrs=np.append(plan.dst_addrs, plan.dst_addrs[:1]),
                                sizes=np.append(plan.sizes, plan.sizes[:1]))
    with pytest.raises(PlanError, match="second time"):
        check_plan(twice, *args)
    wrong_source = dataclasses.replace(plan, src_addrs=plan.src_addrs + np.uint64(HEAD_DIM * 4))
    with pytest.raises(PlanError, match="not the same head"):
        check_plan(wrong_source, *args)


def test_single_shards_plan_exactly_like_plain_layouts():
    a = KVLayout.from_tensor(torch.zeros(PAGES, LAYERS, 2, PAGE_SIZE, 3, HEAD_DIM), PAGE_SIZE)
    b = KVLayout.from_tensor(torch.zeros(PAGES, LAYERS, 2, PAGE_SIZE, 3, HEAD_DIM), PAGE_SIZE)
    for src_slots, dst_slots, layers in [(range(2, 22), range(5, 25), None), ([9, 3, 4, 30], [0, 1, 2, 3], [2])]:
        plain = plan_transfer(a, list(src_slots), b, list(dst_slots), layers=layers)
        for s, d in [(KVShards.single(a), KVShards.single(b)), (a, KVShards.single(b)), (KVShards.single(a), b)]:
            sharded = plan_transfer(s, list(src_slots), d, list(dst_slots), layers=layers)
            assert sharded.descriptors == plain.descriptors and sharded.num_runs == plain.num_runs


def test_head_ranges_split_floor_wise_and_replicate_few_heads():
    assert head_ranges(4, 2) == [(0, 2), (2, 4)]
    assert head_ranges(3, 2) == [(0, 1), (1, 3)]
    assert head_ranges(3, 3) == [(0, 1), (1, 2), (2, 3)]
    assert head_ranges(8, 1) == [(0, 8)]
    assert head_ranges(2, 4) == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert head_ranges(1, 2) == [(0, 1), (0, 1)]
    with pytest.raises(ValueError, match="3 ranks cannot share 2 KV heads"):
        head_ranges(2, 3)


def test_shards_round_trip_through_a_dict_and_answer_like_a_layout():
    shards, _ = node(3, 2)
    back = KVShards.from_dict(shards.to_dict())
    assert back == shards
    assert (shards.num_kv_heads, shards.bytes_per_slot, shards.num_pages) == (3, 3 * HEAD_DIM * 4, PAGES)
    assert shards.bytes_per_token == 3 * HEAD_DIM * 4 * 2 * LAYERS
    assert shards.regions() == [(sh.layout.base_addr, sh.layout.extent) for sh in shards.shards]
    plain = shards.shards[0].layout
    assert as_shards(plain) == KVShards.single(plain) and as_shards(shards) is shards


def test_incompatible_or_invalid_shards_say_which_values_differ():
    three, _ = node(3, 2)
    four, _ = node(4, 2)
    with pytest.raises(PlanError, match="num_kv_heads differs: 3 vs 4"):
        plan_transfer(three, [0], four, [0])
    two_heads = three.shards[1].layout
    assert three.incompatibilities(two_heads) == ["num_kv_heads differs: 3 vs 2"]
    assert three.incompatibilities(node(3, 3)[0]) == []
    with pytest.raises(ValueError, match=r"KV heads \[2\] of 3 are held by no shard"):
        KVShards((three.shards[0], KVShard(three.shards[0].layout, 1, 1)), 3)
    with pytest.raises(ValueError, match=r"holds heads \[2, 4\), outside the model's \[0, 3\)"):
        KVShards((three.shards[0], KVShard(two_heads, 2, 1)), 3)
    half = KVLayout.from_tensor(torch.zeros(PAGES // 2, LAYERS, 2, PAGE_SIZE, 2, HEAD_DIM), PAGE_SIZE)
    with pytest.raises(ValueError, match="disagree on num_slots: rank 0 has 32, rank 1 has 16"):
        KVShards((three.shards[0], KVShard(half, 1, 1)), 3)
    with pytest.raises(ValueError, match="at least one shard"):
        KVShards((), 3)
    with pytest.raises(PlanError, match="outside the pool"):
        plan_transfer(three, [PAGES * PAGE_SIZE], node(3, 1)[0].shards[0].layout, [0])


def test_a_replicated_head_is_read_from_the_lowest_rank_holding_it():
    ref = reference(2)
    (src, _pools), (dst, _) = node(2, 4, ref), node(2, 1)
    # shards listed out of rank order: rank, not position, picks the source
    src = KVShards(tuple(reversed(src.shards)), 2)
    plan = plan_transfer(src, list(range(4, 12)), dst, list(range(0, 8)))
    rank_of = {sh.rank: sh.layout for sh in src.shards}
    for addr in plan.src_addrs.tolist():
        assert any(rank_of[r].base_addr <= addr < rank_of[r].base_addr + rank_of[r].extent for r in (0, 2))
