"""Transfer planning: every window byte lands in the right slot, nothing else, fewest descriptors.

Pools are simulated as byte buffers (base address 0) in the page-major layout, the
layer-major layout, and page-major with gaps between pages.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.kvtransfer.layout import KVLayout
from pdserve.kvtransfer.plan import PlanError, plan_transfer

KINDS = ["page-major", "layer-major", "padded-page-major"]


def layout(layers, heads, dim, page_size, num_pages, kind="layer-major"):
    bps = heads * dim * 4
    slots = page_size * num_pages
    if kind == "layer-major":
        return KVLayout("float32", layers, heads, dim, page_size, slots, 0,
                        layer_stride=2 * slots * bps, kv_stride=slots * bps, slot_stride=bps)
    page = layers * 2 * page_size * bps + (3 * bps if kind == "padded-page-major" else 0)
    return KVLayout("float32", layers, heads, dim, page_size, slots, 0, layer_stride=2 * page_size * bps,
                    kv_stride=page_size * bps, slot_stride=bps, page_stride=page)


def slots_from_pages(draw, page_size, num_pages, n, offset):
    need = -(-(n + offset) // page_size)
    pages = draw(st.permutations(range(num_pages)))[:need]
    if draw(st.booleans()):
        pages = sorted(pages)  # unfragmented sometimes, so long runs get exercised
    slots = [p * page_size + o for p in pages for o in range(page_size)]
    return slots[offset:offset + n]


def apply(plan, src_mem, dst_mem):
    for s, d, n in plan.descriptors:
        dst_mem[d:d + n] = src_mem[s:s + n]


def byte_map(src, src_slots, dst, dst_slots, layers):
    """For every source byte, the receiver byte it must land in (-1: not in the window)."""
    f = np.full(src.extent, -1, dtype=np.int64)
    b = src.bytes_per_slot
    for layer in layers:
        for kv in range(2):
            for s, d in zip(src_slots, dst_slots):
                a, c = src.addr(layer, kv, s), dst.addr(layer, kv, d)
                f[a:a + b] = np.arange(c, c + b)
    return f


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_plan_moves_exactly_the_window_in_fewest_descriptors_for_any_layouts(data):
    layers = data.draw(st.integers(1, 3))
    heads, dim = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 3))
    sp, dp = data.draw(st.sampled_from([1, 2, 4, 8])), data.draw(st.sampled_from([1, 2, 4, 8]))
    skind, dkind = data.draw(st.sampled_from(KINDS)), data.draw(st.sampled_from(KINDS))
    n = data.draw(st.integers(1, 24))
    src = layout(layers, heads, dim, sp, -(-(n + 8) // sp) + 2, skind)
    dst = layout(layers, heads, dim, dp, -(-(n + 8) // dp) + 3, dkind)
    src_slots = slots_from_pages(data.draw, sp, src.num_pages, n, data.draw(st.integers(0, sp - 1)))
    dst_slots = slots_from_pages(data.draw, dp, dst.num_pages, n, data.draw(st.integers(0, dp - 1)))
    chosen = data.draw(st.one_of(st.none(), st.sets(st.integers(0, layers - 1), min_size=1)))
    plan = plan_transfer(src, src_slots, dst, dst_slots, layers=None if chosen is None else sorted(chosen))
    moved = range(layers) if chosen is None else sorted(chosen)

    f = byte_map(src, src_slots, dst, dst_slots, moved)
    rng = np.random.default_rng(0)
    src_mem = rng.integers(0, 256, src.extent, dtype=np.uint8)
    dst_mem = rng.integers(0, 256, dst.extent, dtype=np.uint8)
    expected = dst_mem.copy()
    expected[f[f >= 0]] = src_mem[f >= 0]
    apply(plan, src_mem, dst_mem)
    assert np.array_equal(dst_mem, expected)  # exact bytes, nothing else on the receiver
    read = np.zeros(src.extent, dtype=bool)
    for s, _, z in plan.descriptors:
        read[s:s + z] = True
    assert np.array_equal(read, f >= 0)  # the sender reads only the window
    assert plan.total_bytes == n * src.bytes_per_slot * 2 * len(moved)

    # no overlap on either side, and the count is the number of maximal spans that are
    # contiguous on both sides, counted byte by byte (the minimum any plan can reach)
    for addrs in (plan.src_addrs, plan.dst_addrs):
        order = np.argsort(addrs)
        assert (addrs[order][:-1] + plan.sizes[order][:-1] <= addrs[order][1:]).all()
    inside = f >= 0
    continues = np.zeros_like(inside)
    continues[1:] = inside[1:] & inside[:-1] & (f[1:] == f[:-1] + 1)
    assert plan.num_descriptors == int((inside & ~continues).sum())


def test_consecutive_page_major_pages_are_one_descriptor_over_all_layers():
    src, dst = layout(4, 2, 8, 16, 8, "page-major"), layout(4, 2, 8, 16, 8, "page-major")
    plan = plan_transfer(src, list(range(16, 80)), dst, list(range(48, 112)))
    assert plan.num_descriptors == 1 and plan.total_bytes == 4 * src.page_stride
    # a partial first page is a span per layer and K/V; its last (layer 3's V) runs into
    # the whole pages after it
    plan = plan_transfer(src, list(range(8, 80)), dst, list(range(40, 112)))
    assert plan.num_descriptors == 4 * 2


def test_page_major_with_different_page_sizes_moves_the_smaller_page_per_layer_and_kv():
    src, dst = layout(4, 2, 8, 16, 8, "page-major"), layout(4, 2, 8, 8, 16, "page-major")
    plan = plan_transfer(src, list(range(16, 80)), dst, list(range(40, 104)))
    # 8 receiver pages x 4 layers x K/V, less the 3 joins where the last layer's V of one
    # sender page runs into the first layer's K of the next on both sides
    assert plan.num_descriptors == (64 // 8) * 4 * 2 - 3
    assert plan.sizes.min() == 8 * src.bytes_per_slot


def test_layer_major_to_page_major_is_one_descriptor_per_page_layer_and_kv():
    src, dst = layout(4, 2, 8, 16, 8), layout(4, 2, 8, 16, 8, "page-major")
    plan = plan_transfer(src, list(range(16, 80)), dst, list(range(16, 80)))
    assert plan.num_descriptors == 4 * 4 * 2


def test_consecutive_layer_major_pages_coalesce_into_one_descriptor_per_layer_and_kv():
    src, dst = layout(4, 2, 8, 16, 8), layout(4, 2, 8, 8, 16)
    plan = plan_transfer(src, list(range(16, 80)), dst, list(range(40, 104)))
    assert plan.num_descriptors == 4 * 2 and plan.num_runs == 1
    assert set(plan.sizes.tolist()) == {64 * src.bytes_per_slot}


@pytest.mark.parametrize("kind", ["page-major", "layer-major"])
def test_a_whole_pool_to_the_same_shape_is_one_descriptor(kind):
    a = layout(3, 1, 4, 4, 4, kind)
    plan = plan_transfer(a, list(range(16)), a, list(range(16)))
    assert plan.num_descriptors == 1 and plan.total_bytes == a.extent


def test_layers_subset_only_moves_those_layers():
    a = layout(4, 1, 2, 4, 4)
    plan = plan_transfer(a, [0, 1, 2], a, [4, 5, 6], layers=[2])
    assert plan.num_layers == 1 and plan.num_descriptors == 2
    assert all(a.addr(2, 0, 0) <= s < a.addr(3, 0, 0) for s in plan.src_addrs.tolist())
    # page-major, whole pages: one layer's K and V of a page are one span
    p = layout(4, 1, 2, 4, 4, "page-major")
    plan = plan_transfer(p, list(range(4, 12)), p, list(range(0, 8)), layers=[1])
    assert plan.num_descriptors == 2 and set(plan.sizes.tolist()) == {2 * 4 * p.bytes_per_slot}


def test_bad_inputs_raise_plan_errors():
    a = layout(2, 1, 2, 4, 4)
    with pytest.raises(PlanError, match="3 slots but receiver has 2"):
        plan_transfer(a, [0, 1, 2], a, [0, 1])
    with pytest.raises(PlanError, match="outside the pool"):
        plan_transfer(a, [0, 16], a, [0, 1])
    with pytest.raises(PlanError, match="repeat"):
        plan_transfer(a, [0, 1], a, [3, 3])
    with pytest.raises(PlanError, match="num_layers differs"):
        plan_transfer(a, [0], layout(3, 1, 2, 4, 4), [0])
    with pytest.raises(PlanError, match="layers must be in"):
        plan_transfer(a, [0], a, [0], layers=[5])
