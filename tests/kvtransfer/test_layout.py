"""KVLayout of a pool tensor (page-major or layer-major): addresses, serialisation, compatibility."""

import pytest
import torch

from pdserve.kvtransfer.layout import KVLayout, pool_shape


def pool(kind="layer-major", dtype=torch.bfloat16, layers=3, pages=4, page_size=8, heads=2, dim=8):
    return torch.zeros(pool_shape(kind, layers, heads, dim, page_size, pages), dtype=dtype)


def element(kv_cache, layer, kvi, slot, page_size):
    if kv_cache.dim() == 6:
        return kv_cache[slot // page_size, layer, kvi, slot % page_size]
    return kv_cache[layer, kvi, slot]


@pytest.mark.parametrize("kind", ["page-major", "layer-major"])
def test_addresses_match_the_tensor_elements(kind):
    kv = pool(kind)
    lay = KVLayout.from_tensor(kv, page_size=8)
    assert lay.kind == kind and lay.dtype == "bfloat16" and lay.num_pages == 4 and lay.num_slots == 32
    assert lay.bytes_per_slot == 2 * 8 * 2 == lay.slot_stride
    for layer, kvi, slot in [(0, 0, 0), (2, 1, 31), (1, 0, 17), (1, 1, 8), (0, 1, 7)]:
        assert lay.addr(layer, kvi, slot) == element(kv, layer, kvi, slot, 8).data_ptr()
    assert lay.slot_addrs([17, 31]).tolist() == [lay.addr(0, 0, 17), lay.addr(0, 0, 31)]
    assert lay.extent == kv.numel() * kv.element_size()


def test_a_page_major_page_is_one_span_over_all_layers_and_kv():
    lay = KVLayout.from_tensor(pool("page-major"), page_size=8)
    assert lay.page_stride == lay.num_layers * 2 * lay.page_size * lay.bytes_per_slot
    assert lay.addr(0, 0, 8) - lay.addr(2, 1, 7) == lay.bytes_per_slot  # page 0 ends, page 1 begins


@pytest.mark.parametrize("kind", ["page-major", "layer-major"])
def test_to_dict_round_trips(kind):
    lay = KVLayout.from_tensor(pool(kind, torch.float32, page_size=16), page_size=16)
    assert KVLayout.from_dict(lay.to_dict()) == lay
    with pytest.raises(ValueError, match="unknown"):
        KVLayout.from_dict({**lay.to_dict(), "bogus": 1})


def test_a_layout_without_page_stride_reads_as_layer_major():
    # what a peer or message from before page_stride existed sends (proto3: absent = 0)
    lay = KVLayout.from_tensor(pool("layer-major"), page_size=8)
    assert "page_stride" not in lay.to_dict()
    assert KVLayout.from_dict({**lay.to_dict(), "page_stride": 0}) == lay
    assert "page_stride" in KVLayout.from_tensor(pool("page-major"), page_size=8).to_dict()


def test_page_size_and_layout_may_differ_but_model_shape_may_not():
    a = KVLayout.from_tensor(pool("page-major"), page_size=8)
    b = KVLayout.from_tensor(pool("layer-major", pages=4, page_size=16), page_size=16)
    assert a.incompatibilities(b) == []
    c = KVLayout.from_tensor(pool(dtype=torch.float16, heads=4), page_size=8)
    problems = a.incompatibilities(c)
    assert any("dtype" in p for p in problems) and any("num_kv_heads" in p for p in problems)


def test_unpacked_slots_overlaps_and_wrong_shapes_are_rejected():
    kv = torch.zeros(2, 2, 4, 16, 8).transpose(2, 3)  # [L, 2, heads, slots, dim] in memory
    with pytest.raises(ValueError, match="packed"):
        KVLayout.from_tensor(kv, page_size=4)
    with pytest.raises(ValueError, match="multiple of page_size"):
        KVLayout.from_tensor(torch.zeros(3, 2, 30, 2, 8), page_size=8)
    with pytest.raises(ValueError, match="page_size=4"):
        KVLayout.from_tensor(pool("page-major", page_size=8), page_size=4)
    with pytest.raises(ValueError, match="must be"):
        KVLayout.from_tensor(torch.zeros(3, 3, 8, 2, 8), page_size=8)
    good = KVLayout.from_tensor(pool("page-major"), page_size=8).to_dict()
    with pytest.raises(ValueError, match="overlaps"):  # pages closer than a page's bytes
        KVLayout.from_dict({**good, "page_stride": good["layer_stride"]})
