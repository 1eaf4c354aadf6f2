"""Descriptors carry the device id of their own side's region (NIXL matches on it)."""

import asyncio

import numpy as np
import pytest
import torch

from pdserve.kvtransfer.agent import TransferAgent, TransferError
from pdserve.kvtransfer.layout import KVLayout
from pdserve.kvtransfer.regions import RegionTable, device_index, regions_of
from pdserve.kvtransfer.shards import KVShard, KVShards
from pdserve.prefill.peers import DecodePeers, PeerInfo, PeerRef
from tests.fake_agent import FakeFabric

POOL = 4096


@pytest.fixture(scope="module")
def pair():
    src = torch.arange(POOL, dtype=torch.int32).to(torch.uint8)
    dst = torch.zeros(POOL, dtype=torch.uint8)
    with TransferAgent("devid-prefill", src) as a, TransferAgent("devid-decode", dst) as b:
        yield a, src, b, dst


def layout(base_addr=0x10000, device="cpu", heads=2):
    return KVLayout(dtype="float16", num_layers=2, num_kv_heads=heads, head_dim=4, page_size=4, num_slots=8,
                    base_addr=base_addr, layer_stride=2 * 8 * heads * 8, kv_stride=8 * heads * 8,
                    slot_stride=heads * 8, device=device)


def test_lookup_gives_each_address_the_device_of_its_region():
    # given out of order: the table sorts them; 0x2000 and 0x3000 sit on device 1
    table = RegionTable([(0x1000, 0x1000, 0), (0x3000, 0x800, 1), (0x2000, 0x100, 1)])
    addrs = np.array([0x1000, 0x1fff, 0x2000, 0x20f0, 0x3000, 0x37ff, 0x1800], dtype=np.uint64)
    sizes = np.array([16, 1, 0x100, 0x10, 8, 1, 0x800], dtype=np.uint64)
    assert table.device_ids(addrs, sizes).tolist() == [0, 0, 1, 1, 1, 1, 0]


@pytest.mark.parametrize("addr, size", [(0x0fff, 1), (0x2100, 1), (0x1ff0, 0x20), (0x3800, 1)],
                         ids=["below-all", "in-a-gap", "straddles-two", "past-the-end"])
def test_lookup_refuses_a_descriptor_no_region_holds_whole(addr, size):
    table = RegionTable([(0x1000, 0x1000, 0), (0x2000, 0x100, 1), (0x3000, 0x800, 1)])
    with pytest.raises(ValueError, match=f"0x{addr:x}"):
        table.device_ids(np.array([0x1000, addr], dtype=np.uint64), np.array([8, size], dtype=np.uint64))


def test_overlapping_regions_are_refused():
    with pytest.raises(ValueError, match="overlap"):
        RegionTable([(0x1000, 0x1000, 0), (0x1800, 0x1000, 1)])


def test_a_write_with_the_peers_regions_lands_the_bytes(pair):
    a, src, b, dst = pair
    remote = a.add_remote(b.metadata(), regions=[(dst.data_ptr(), POOL, 0)])
    a.write(remote, [(src.data_ptr() + 10, dst.data_ptr() + 100, 50)], b"lands", timeout_s=10)
    assert b.wait_notification(b"lands", 10)
    assert torch.equal(dst[100:150], src[10:60])


def test_destination_descriptors_carry_the_peers_device_id_not_ours(pair):
    # NIXL finds no registration for device 1 of the peer's DRAM: the id reached the WRITE
    a, src, b, dst = pair
    remote = a.add_remote(b.metadata(), regions=[(dst.data_ptr(), POOL, 1)])
    try:
        with pytest.raises(TransferError, match="cannot create a WRITE"):
            a.write(remote, [(src.data_ptr(), dst.data_ptr() + 200, 8)], b"wrong-device", timeout_s=5)
        assert not dst[200:208].any()
    finally:
        a.remove_remote(remote)  # drops the table with the peer
    remote = a.add_remote(b.metadata())  # no regions: one device, ours (0)
    a.write(remote, [(src.data_ptr(), dst.data_ptr() + 200, 8)], b"right-device", timeout_s=10)
    assert b.wait_notification(b"right-device", 10)
    assert torch.equal(dst[200:208], src[:8])


def test_destination_descriptors_carry_the_peers_memory_kind_not_ours(pair):
    # A GPU pool writing into a CPU one (or back) names the peer's kind: NIXL finds the
    # peer's registration by it. Named VRAM, this DRAM peer has none: the kind reached the WRITE.
    a, src, b, dst = pair
    remote = a.add_remote(b.metadata(), regions=[(dst.data_ptr(), POOL, 0)], memory_kind="VRAM")
    try:
        with pytest.raises(TransferError, match="cannot create a WRITE"):
            a.write(remote, [(src.data_ptr(), dst.data_ptr() + 300, 8)], b"wrong-kind", timeout_s=5)
        assert not dst[300:308].any()
        assert a.add_remote(b.metadata(), memory_kind="DRAM") == remote  # known peer, kind updated
        a.write(remote, [(src.data_ptr(), dst.data_ptr() + 300, 8)], b"right-kind", timeout_s=10)
        assert b.wait_notification(b"right-kind", 10)
        assert torch.equal(dst[300:308], src[:8])
    finally:
        a.remove_remote(remote)


def test_a_restarted_peer_does_not_keep_its_old_regions(pair):
    a, src, _, _ = pair
    old_pool, new_pool = torch.zeros(POOL, dtype=torch.uint8), torch.zeros(POOL, dtype=torch.uint8)
    with TransferAgent("devid-restarts", old_pool) as old:
        remote = a.add_remote(old.metadata(), regions=[(old_pool.data_ptr(), POOL, 1)])
    with TransferAgent("devid-restarts", new_pool) as new:
        assert a.add_remote(new.metadata()) == remote  # new metadata, known name, no regions
        a.write(remote, [(src.data_ptr(), new_pool.data_ptr(), 8)], b"restarted", timeout_s=10)
        assert new.wait_notification(b"restarted", 10)
        assert torch.equal(new_pool[:8], src[:8])
        a.remove_remote(remote)


def test_a_descriptor_outside_every_region_is_an_error_naming_its_address(pair):
    a, src, b, dst = pair
    remote = a.add_remote(b.metadata(), regions=[(dst.data_ptr(), POOL, 0)])
    outside = dst.data_ptr() + POOL - 4  # starts inside, ends past the pool
    with pytest.raises(TransferError, match=f"remote 'devid-decode' descriptor at 0x{outside:x}"):
        a.write(remote, [(src.data_ptr(), outside, 8)], b"x", timeout_s=5)
    local = src.data_ptr() + POOL
    with pytest.raises(TransferError, match=f"local descriptor at 0x{local:x}"):
        a.write(remote, [(local, dst.data_ptr(), 8)], b"x", timeout_s=5)


@pytest.mark.parametrize("device, want", [("cpu", 0), ("cuda", 0), ("cuda:0", 0), ("cuda:1", 1), ("cuda:12", 12)])
def test_regions_of_a_layout_names_its_device(device, want):
    lay = layout(device=device)
    assert device_index(device) == want
    assert regions_of(lay) == [(0x10000, lay.extent, want)]


def test_regions_of_shards_gives_one_region_per_rank_on_its_own_device():
    r0, r1 = layout(0x10000, "cuda:0", heads=1), layout(0x90000, "cuda:1", heads=1)
    shards = KVShards((KVShard(r0, 0, rank=0), KVShard(r1, 1, rank=1)), num_kv_heads=2)
    assert regions_of(shards) == [(0x10000, r0.extent, 0), (0x90000, r1.extent, 1)]


def test_a_device_without_an_integer_index_is_refused():
    with pytest.raises(ValueError, match="cuda:x"):
        device_index("cuda:x")


def test_prefill_passes_the_decode_peers_regions_to_its_agent():
    fabric = FakeFabric()
    p_agent = fabric.agent("p", torch.zeros(64, dtype=torch.uint8))
    d_agent = fabric.agent("d", torch.zeros(64, dtype=torch.uint8))
    d_layout = layout(0x50000, "cuda:1")
    info = PeerInfo("d", d_agent.metadata(), d_layout)
    peers = DecodePeers(p_agent, layout(device="cuda:0"))
    asyncio.run(peers.get(PeerRef("d", "unused:0", info)))
    assert p_agent.remote_regions == {"d": [(0x50000, d_layout.extent, 1)]}


def test_a_layer_major_pool_registers_as_one_region_and_a_view_with_gaps_does_not():
    from pdserve.engine.kv_pool import kv_pool
    from pdserve.kvtransfer.regions import memory_regions

    pool = kv_pool("layer-major", 4, 3, 2, 2, 8, lambda shape: torch.zeros(shape))
    assert not pool.is_contiguous()
    assert memory_regions(pool) == ([(pool.data_ptr(), pool.numel() * 4, 0)], "DRAM")
    with pytest.raises(ValueError, match="layer-major"):
        memory_regions(pool[:, :2])  # two of three layers: bytes of the third lie between
    with pytest.raises(ValueError, match="layer-major"):
        memory_regions(torch.zeros(8, 8).t()[1:])  # permuted, but not from the storage's start
