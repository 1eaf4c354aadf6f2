"""TransferAgent between two real processes: exact placement, notifications, failures, idle CPU."""

import os
import threading
import time

import numpy as np
import pytest
import torch

from pdserve.kvtransfer.agent import TransferAgent, TransferError
from pdserve.benchmarks.transfer import fragmented_pages, pages_to_slots
from pdserve.kvtransfer.layout import KVLayout
from pdserve.benchmarks.kv_receiver import PoolSpec, ReceiverProcess, make_pool, slot_checksums
from pdserve.kvtransfer.plan import plan_transfer

# the receiver is page-major with pages of 8; senders: page-major with pages of 16 (the
# recommended layout, different page size) and layer-major with pages of 4
DST = PoolSpec(num_layers=3, num_kv_heads=2, head_dim=8, page_size=8, num_pages=48, dtype="float16")
SENDERS = {
    "page-major-16": PoolSpec(3, 2, 8, page_size=16, num_pages=24, dtype="float16", layout="page-major"),
    "layer-major-4": PoolSpec(3, 2, 8, page_size=4, num_pages=96, dtype="float16", layout="layer-major"),
}


@pytest.fixture(scope="module")
def receiver():
    torch.set_num_threads(1)
    with ReceiverProcess("test-decode", DST, fill_seed=2) as r:
        yield r


@pytest.fixture(scope="module")
def pair(receiver):
    pool = make_pool(SENDERS["page-major-16"], fill_seed=1)
    with TransferAgent("test-prefill", pool) as agent:
        yield agent, pool, KVLayout.from_tensor(pool, 16), receiver


def random_slots(rng, spec, n, fragmentation):
    pages, need = fragmented_pages(-(-n // spec.page_size) + 1, fragmentation, rng)
    shift = int(rng.integers(0, spec.num_pages - need + 1))
    offset = int(rng.integers(0, spec.page_size))
    return pages_to_slots([p + shift for p in pages], spec.page_size, n + offset)[offset:]


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.parametrize("sender", list(SENDERS))
def test_every_byte_lands_in_the_right_slot_and_nothing_else_is_touched(pair, receiver, sender):
    spec = SENDERS[sender]
    if sender == "page-major-16":
        agent, pool, layout, _ = pair
    else:
        pool = make_pool(spec, fill_seed=3)
        agent, layout = TransferAgent(f"test-prefill-{sender}", pool), KVLayout.from_tensor(pool, spec.page_size)
    assert layout.kind == spec.layout and receiver.layout.kind == "page-major"
    try:
        check_random_windows(agent, pool, layout, spec, receiver, seed=7 + len(sender))
    finally:
        if agent is not pair[0]:
            agent.close()


def check_random_windows(agent, pool, layout, spec, receiver, seed):
    remote = agent.add_remote(receiver.metadata)
    rng = np.random.default_rng(seed)
    for case in range(4):
        n = int(rng.integers(1, 150))
        frag = float(rng.choice([0.0, 0.3, 1.0, rng.random()]))
        src_slots = random_slots(rng, spec, n, frag)
        dst_slots = random_slots(rng, DST, n, frag)
        before = receiver.checksums()
        plan = plan_transfer(layout, src_slots, receiver.layout, dst_slots)
        tag = f"{agent.name}-req-{case}".encode()
        agent.write(remote, plan, tag, timeout_s=20)
        assert receiver.wait(tag, 10.0)
        after = receiver.checksums()
        want = slot_checksums(pool, src_slots).numpy()
        assert np.array_equal(after[:, :, dst_slots], want), f"case {case}: window bytes differ"
        untouched = np.ones(DST.num_pages * DST.page_size, dtype=bool)
        untouched[dst_slots] = False
        assert np.array_equal(after[:, :, untouched], before[:, :, untouched]), f"case {case}: outside touched"


def test_remotes_are_added_once_and_notifications_match_exact_tags(pair):
    agent, _, _, receiver = pair
    first = agent.add_remote(receiver.metadata)
    assert agent.add_remote(receiver.metadata) == first == "test-decode"
    assert agent.remotes.count(first) == 1
    agent.send_notification(first, b"req-10")
    agent.send_notification(first, b"req-1")
    assert receiver.wait(b"req-1", 10.0)
    assert receiver.wait(b"req-10", 10.0)
    assert not receiver.wait(b"req-1", 0.3)  # consumed, and never matched as a prefix


def test_unknown_remote_is_an_error(pair):
    agent, _, layout, _ = pair
    with pytest.raises(TransferError, match="unknown remote"):
        agent.write("nobody", [(layout.base_addr, layout.base_addr, 64)], b"x", timeout_s=1)


def test_a_remote_that_disappears_mid_transfer_gives_an_error_not_a_hang():
    torch.set_num_threads(1)
    big = PoolSpec(num_layers=8, num_kv_heads=8, head_dim=64, page_size=16, num_pages=256, dtype="float16")
    receiver = ReceiverProcess("test-doomed", big)
    pool = make_pool(big)
    agent = TransferAgent("test-sender", pool)
    try:
        remote = agent.add_remote(receiver.metadata)
        rng = np.random.default_rng(3)
        n = 1024
        plan = plan_transfer(KVLayout.from_tensor(pool, 16), random_slots(rng, big, n, 1.0),
                             receiver.layout, random_slots(rng, big, n, 1.0))
        agent.write(remote, plan, b"warm", timeout_s=20)
        outcome = {}
        writing = threading.Event()

        def keep_writing():
            try:
                for i in range(10_000):
                    agent.write(remote, plan, f"w{i}".encode(), timeout_s=5)
                    writing.set()
                outcome["result"] = "never failed"
            except TransferError as e:
                outcome["result"] = e

        writer = threading.Thread(target=keep_writing, daemon=True)
        writer.start()
        assert writing.wait(20), "no write completed"
        receiver.kill()  # while writes follow each other
        writer.join(30)
        assert not writer.is_alive(), "write hung after the remote died"
        assert isinstance(outcome["result"], TransferError)
        with pytest.raises(TransferError):  # an error, not a hang (pytest-timeout ends one)
            agent.write(remote, plan, b"after", timeout_s=5)
    finally:
        agent.close()
        receiver.close()


@pytest.mark.parametrize("progress_thread", [False, True], ids=["own-poller", "nixl-thread"])
def test_an_idle_agent_uses_under_three_percent_of_a_core(pair, progress_thread):
    _, _, _, connected = pair  # an idle receiver that already served transfers
    spec = PoolSpec(2, 1, 8, 4, 4)
    fresh = ReceiverProcess("test-idle", spec, progress_thread=progress_thread, progress_delay_us=5000)
    try:
        time.sleep(0.5)
        pids = [fresh.process.pid, connected.process.pid]
        c0, t0 = [cpu_seconds(p) for p in pids], time.monotonic()
        time.sleep(2.5)
        dt = time.monotonic() - t0
        use = [(cpu_seconds(p) - c) / dt for p, c in zip(pids, c0)]
        print(f"idle CPU share of a core (progress_thread={progress_thread}): {use}")
        assert all(u < 0.03 for u in use), use
    finally:
        fresh.close()
