"""One rank of a tensor-parallel node SIGKILLed: the node goes down whole (exit code 3,
no rank left behind), the router sees one node failure, the client gets the right answer
or a clear status, and no page stays held on the surviving nodes.

- A prefill rank killed while its node's KV write is held at the `kv_write` gate: the
  decode node prefills instead (the only prefill node is gone), and the answer is the one
  computed from scratch.
- A decode rank killed while a stream is held at the decode node's `stream` gate: the
  stream ends UNAVAILABLE.
- SIGTERM to the node's process group is no fault: rank 0 drains, then stops its ranks.
"""

from __future__ import annotations

import asyncio
import os
import select
import signal

import grpc
import pytest

from pdserve.client import AsyncClient
from tests.cluster.conftest import HELD, SLOW
from tests.cluster.nodes import GREEDY, Cluster, full, gate_open, gate_reached, load, run, wait_pools_full

FLAGS = ["--num-threads", "1", "--num-pages", "96", "--page-size", "8"]
PROMPT = [(i * 37) % 480 + 20 for i in range(200)]
RANK_DIED_EXIT = 3  # engine/tp/group.py


@pytest.fixture
def nodes(tiny_model, tmp_path):
    c = Cluster(tmp_path, tiny_model)
    common = ["--model", tiny_model, "--host", "127.0.0.1", *FLAGS]
    try:
        c.start("p", ["prefill", *common, "--tensor-parallel-size", "2", "--test-gates", SLOW], wait=False)
        c.start("d", ["decode", *common, "--tensor-parallel-size", "2", "--test-gates", HELD,
                      "--quarantine-grace-ms", "2000"], wait=False)
        c.wait("p", "d")
        c.start("router", ["router", "--model", tiny_model, "--host", "127.0.0.1", "--lease-ms", "3000",
                           "--min-remote-prefill-tokens", "0", "--health-interval-s", "0.3",
                           "--prefill", c.address("p"), "--decode", c.address("d")])
        yield c
    finally:
        c.stop()


def ranks(c: Cluster, name: str) -> list[int]:
    """The pids of node `name`'s ranks 1.. (children running the follower)."""
    found = []
    for pid in c.nodes[name].pids():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"pdserve.engine.tp.follower" in f.read():
                    found.append(pid)
        except OSError:
            pass
    return found


def kill_rank(c: Cluster, name: str) -> list[int]:
    """SIGKILL rank 1 of node `name`; every rank pid it had."""
    pids = [c.nodes[name].proc.pid, *ranks(c, name)]
    assert len(pids) == 2, pids
    os.kill(pids[1], signal.SIGKILL)
    return pids


def node_went_down(c: Cluster, name: str, pids: list[int]) -> None:
    assert c.nodes[name].proc.wait(timeout=60) == RANK_DIED_EXIT
    gone(pids)


def gone(pids: list[int], timeout_s: float = 60.0) -> None:
    """Wait until every one of `pids` has exited (the other ranks die with rank 0,
    PDEATHSIG): a pidfd turns readable when its process exits."""
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            assert select.select([fd], [], [], timeout_s)[0], f"process {pid} is still running"
        finally:
            os.close(fd)


def test_sigkill_of_a_prefill_rank_mid_transfer_gives_the_right_answer_and_frees_every_page(nodes):
    c = nodes
    request_id = f"{SLOW}tp-prefill-rank"

    async def go():
        await gate_open(c.address("p"), "prefill", request_id)  # it stops at the write
        async with AsyncClient(c.address("router")) as client:
            task = asyncio.ensure_future(client.generate(PROMPT, request_id=request_id, max_tokens=8, **GREEDY))
            await gate_reached(c.address("p"), "kv_write", request_id)
            assert (await load(c.address("p"))).num_running == 1
            pids = kill_rank(c, "p")
            out = await task
            expected = await client.generate(PROMPT, kv_window_end=0, max_tokens=8, **GREEDY)
        return expected, out, pids, await wait_pools_full([c.address("d")])

    expected, out, pids, reports = run(go(), timeout_s=180)
    node_went_down(c, "p", pids)
    assert out.token_ids == expected.token_ids and len(out.token_ids) == 8
    route = out.usage.route
    assert route.remote_send_skipped and route.skip_reason in ("fallback", "lease_ended", "no_prefill"), route
    assert all(full(r) for r in reports), reports


def test_sigkill_of_a_decode_rank_mid_generation_ends_the_stream_unavailable(nodes):
    c = nodes
    request_id = f"{HELD}tp-decode-rank"

    async def go():
        async with AsyncClient(c.address("router")) as client:
            stream = client.responses(PROMPT, request_id=request_id, max_tokens=200, **GREEDY)
            first = await stream.__anext__()
            await gate_reached(c.address("d"), "stream", request_id)
            pids = kill_rank(c, "d")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stream:
                    pass
        return first, err.value, pids, await wait_pools_full([c.address("p")])

    first, err, pids, reports = run(go(), timeout_s=180)
    node_went_down(c, "d", pids)
    assert first.token_ids
    assert err.code() == grpc.StatusCode.UNAVAILABLE, err
    assert all(full(r) for r in reports), reports


def test_sigterm_drains_the_node_and_stops_its_ranks_after_it(nodes):
    """SIGTERM reaches the node's whole process group: the ranks ignore it, and rank 0
    stops them once it has drained."""
    c = nodes
    pids = [c.nodes["d"].proc.pid, *ranks(c, "d")]
    assert len(pids) == 2
    c.nodes["d"].send_signal(signal.SIGTERM)
    assert c.nodes["d"].proc.wait(timeout=60) == 0
    gone(pids)
    assert "this node stops" not in c.log_text("d")  # no rank ended before rank 0
