"""Capabilities for one-sided writes: with a cluster key, the prefill role writes only a
window its decode node signed, once, while it is fresh and not fenced; every other window
is PERMISSION_DENIED before anything runs, and nothing reaches the decode node's pool."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import grpc
import pytest
import torch

from pdserve.prefill.capability import CapabilityRefused
from pdserve.prefill.requests import RemoteSend
from pdserve.runtime import cluster_key
from tests.prefill.world import END, PROMPT, kv_of, within

KEY = b"prefill-capability-test-key-0123456789"


@pytest.fixture
def keyed(tmp_path):
    path = tmp_path / "cluster.key"
    path.write_bytes(KEY)
    cluster_key.configure(cluster_key.ClusterKeyConfig(key_file=str(path)))
    yield
    cluster_key.configure(cluster_key.ClusterKeyConfig())


def signed(nodes, request_id: str, window, issued_unix_ms: int | None = None):
    """`window` with the decode node's capability, as its PrepareReceive would hand it out."""
    issued = round(time.time() * 1000) if issued_unix_ms is None else issued_unix_ms
    fields = cluster_key.window_fields(request_id, window.lease_id, window.begin, END,
                                       window.kv_append_metadata, nodes.d_agent.name, 30_000,
                                       issued)
    return dataclasses.replace(window, lease_ms=30_000, issued_unix_ms=issued,
                               capability=cluster_key.current().sign(*fields))


def _altered(nodes, rid, w):
    meta = list(w.kv_append_metadata)
    meta[1] += 1  # the first run moved by one slot: someone else's KV
    return dataclasses.replace(signed(nodes, rid, w), kv_append_metadata=meta)


def _forged(nodes, rid, w):
    other = cluster_key.ClusterKey(b"not-this-cluster-key-0123456789")
    fields = cluster_key.window_fields(rid, w.lease_id, w.begin, END, w.kv_append_metadata,
                                       nodes.d_agent.name, 30_000, 0)
    return dataclasses.replace(w, lease_ms=30_000, capability=other.sign(*fields))


BAD = {
    "unsigned": (lambda nodes, rid, w: w, "does not carry a valid capability"),
    "forged": (_forged, "does not carry a valid capability"),
    "altered": (_altered, "does not carry a valid capability"),
    "longer-lease": (lambda nodes, rid, w: dataclasses.replace(
        signed(nodes, rid, w), lease_ms=600_000), "does not carry a valid capability"),
    "expired": (lambda nodes, rid, w: signed(nodes, rid, w, round(time.time() * 1000) - 3_600_000),
                "issued 3600 s ago, more than max_window_age_s 600"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_capability_is_permission_denied_and_nothing_runs(nodes, keyed, case):
    change, message = BAD[case]

    async def go():
        role = nodes.role()
        res = await nodes.reserve("c")
        before = await kv_of(nodes.decode)
        with pytest.raises(CapabilityRefused, match=message) as err:
            await role.remote_send(RemoteSend("c", PROMPT, END, change(nodes, "c", nodes.window(res))))
        assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert nodes.p_agent.writes == [] and role.load().num_running == 0
        assert torch.equal(await kv_of(nodes.decode), before)
        await nodes.unreserve("c")

    asyncio.run(go())


def test_signed_window_is_written_once_and_its_replay_refused(nodes, keyed):
    async def go():
        role = nodes.role()
        res = await nodes.reserve("r")
        window = signed(nodes, "r", nodes.window(res))
        result = await within(role.remote_send(RemoteSend("r", PROMPT, END, window)))
        assert result.num_tokens_sent == END and len(nodes.p_agent.writes) == 1
        with pytest.raises(CapabilityRefused, match="was used already"):
            await role.remote_send(RemoteSend("r", PROMPT, END, window))
        assert len(nodes.p_agent.writes) == 1
        await nodes.unreserve("r")

    asyncio.run(go())


def test_fenced_lease_is_never_written_even_with_a_valid_capability(nodes, keyed):
    """The decode node fenced the lease (FenceWrites) before its window reached us."""
    async def go():
        role = nodes.role()
        res = await nodes.reserve("f")
        window = signed(nodes, "f", nodes.window(res))
        assert await role.fence("f", window.lease_id) == (False, False)
        with pytest.raises(CapabilityRefused, match="was fenced already"):
            await role.remote_send(RemoteSend("f", PROMPT, END, window))
        assert nodes.p_agent.writes == []
        await nodes.unreserve("f")

    asyncio.run(go())


def test_fence_after_the_write_landed_says_it_wrote(nodes):
    """FenceWrites asked after the send ended (its write landed, the notification still on
    its way to D) answers `wrote`, so D counts the late write whichever proof comes first;
    another lease of the same request was not written."""
    async def go():
        role = nodes.role()
        res = await nodes.reserve("w")
        window = nodes.window(res)
        await within(role.remote_send(RemoteSend("w", PROMPT, END, window)))
        assert await role.fence("w", window.lease_id) == (False, True)
        assert await role.fence("w", "another-lease") == (False, False)
        await nodes.unreserve("w")

    asyncio.run(go())
