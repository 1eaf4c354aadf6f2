"""The FakeAgent the role tests stand on: it copies exactly the planned bytes, notifies
after the data, refuses what NIXL refuses, and its knobs do what the role tests rely on."""

from __future__ import annotations

import threading

import pytest
import torch

from pdserve.kvtransfer.agent import TransferError
from pdserve.kvtransfer.layout import KVLayout
from pdserve.kvtransfer.plan import plan_transfer
from tests.fake_agent import FakeFabric


def pools():
    fabric = FakeFabric()
    src = torch.arange(4 * 2 * 2 * 4 * 2 * 8, dtype=torch.float32).reshape(4, 2, 2, 4, 2, 8)
    dst = torch.full((8, 2, 2, 2, 2, 8), -1.0)
    a, b = fabric.agent("a", src), fabric.agent("b", dst)
    return a, b, KVLayout.from_tensor(src, 4), KVLayout.from_tensor(dst, 2)


def test_write_copies_exactly_the_planned_slots_then_notifies():
    a, b, la, lb = pools()
    assert a.add_remote(b.metadata()) == "b"
    plan = plan_transfer(la, [5, 6, 7, 8], lb, [3, 10, 11, 2])
    a.write("b", plan, b"tag")
    expected = torch.full_like(b.kv_cache, -1.0)
    for s, d in zip([5, 6, 7, 8], [3, 10, 11, 2]):
        expected[d // 2, :, :, d % 2] = a.kv_cache[s // 4, :, :, s % 4]
    assert torch.equal(b.kv_cache, expected)
    assert b.take_notifications() == [("a", b"tag")] and b.take_notifications() == []
    assert sum(n for _, _, n in b.received) == plan.total_bytes == a.writes[0].num_bytes


def test_write_refuses_unknown_peers_and_addresses_outside_either_pool():
    a, b, la, lb = pools()
    with pytest.raises(TransferError, match="unknown remote agent 'b'"):
        a.write("b", [], b"t")
    a.add_remote(b.metadata())
    with pytest.raises(TransferError, match="outside 'a'"):
        a.write("b", [(la.base_addr - 4, lb.base_addr, 8)], b"t")
    with pytest.raises(TransferError, match="outside 'b'"):
        a.write("b", [(la.base_addr, lb.base_addr + b.nbytes - 4, 8)], b"t")
    with pytest.raises(TransferError, match="cannot load"):
        a.add_remote(b"nixlSerDes|Agent...")
    assert b.take_notifications() == [] and a.writes == []


def test_held_write_copies_nothing_until_released_and_failed_write_copies_nothing():
    a, b, la, lb = pools()
    a.add_remote(b.metadata())
    plan = plan_transfer(la, [0], lb, [0])
    a.fail_next_write("boom")
    with pytest.raises(TransferError, match="boom"):
        a.write("b", plan, b"t")
    assert (b.kv_cache == -1.0).all() and b.take_notifications() == []

    hold = a.hold_writes()
    writer = threading.Thread(target=a.write, args=("b", plan, b"t"))
    writer.start()
    assert hold.started.wait(5)
    assert (b.kv_cache == -1.0).all() and b.take_notifications() == []
    hold.release()
    writer.join(5)
    assert not (b.kv_cache == -1.0).all() and b.wait_notification(b"t", 5)
