"""Layer-wise sends (`--kv-send layerwise`, prefill/layerwise.py): each layer's KV goes out
while the prefill still runs, the notification once after the last write, and every
guarantee of the whole-window write still holds (abort, failure, no page leaked).

The prefill engine here computes the 28-token window in chunks of 8 (four steps), so a
layer's KV of an early chunk exists long before the prefill ends. The set-up, and how a
phase is reached without waiting for time: tests/prefill/world.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import threading
from concurrent.futures import Future

import pytest
import torch

import pdserve.prefill.layer_stream
import pdserve.prefill.layerwise
import pdserve.prefill.sending
from pdserve.kvtransfer.layout import KVLayout
from pdserve.prefill.layer_stream import StreamFailed
from pdserve.prefill.requests import OverlappedSend, RemoteSend
from pdserve.proto.tags import notification_tag
from pdserve.runtime.errors import PeerUnavailable, RequestAborted
from tests.prefill.world import (
    D_PAGE,
    D_PAGES,
    END,
    LEASE,
    P_PAGE,
    PROMPT,
    WAIT_S,
    PrefillWatch,
    at_slots,
    fill_pools,
    generate_tokens,
    kv_of,
    started_tokens,
    with_slots,
    within,
)

CHUNK = 8


def chunked(nodes, name: str):
    node = nodes.prefill_node(name, max_num_batched_tokens=CHUNK)
    watch = PrefillWatch(node[0])
    return (watch, node[1], node[2]), node[0]


def in_last_chunk(request_id: str, then):
    """A layer hook that calls `then()` once, at layer 0 of the request's last chunk."""
    called = threading.Event()

    def hook(layer: int, ranges) -> None:
        for rid, begin, end, _ in ranges:
            if rid == request_id and layer == 0 and end == END and not called.is_set():
                called.set()
                then()
    return hook


def tags(agent) -> list[tuple[str, bytes]]:
    """Notifications received, less the empty ones the fake agent records per write."""
    return [(sender, tag) for sender, tag in agent.take_notifications() if tag]


def wait_writes(agent, n: int = 1) -> bool:
    """On the engine thread: wait until `agent` made `n` writes (bounded)."""
    with agent._cond:
        return agent._cond.wait_for(lambda: len(agent.writes) >= n, WAIT_S)


@pytest.mark.parametrize("decode_has_prefix", [False, True], ids=["window-from-0", "after-decode-prefix"])
def test_layer_wise_writes_start_before_the_prefill_ends_and_land_exactly_the_window(nodes, decode_has_prefix):
    async def go():
        await fill_pools(nodes)
        node, engine = chunked(nodes, "layers-agent")
        role = nodes.role(node=node, kv_send="layerwise")
        if decode_has_prefix:  # the decode engine then has the prompt's full pages: a later window
            expected = await generate_tokens(nodes.decode, "local", PROMPT)
        else:
            expected = await generate_tokens(nodes.engine(), "local", PROMPT)
        res = await nodes.reserve("r")
        begin = res.prefix_matched_length
        before = await kv_of(nodes.decode)
        early = []  # a window past the decode node's prefix lies in the last chunk alone
        hook = in_last_chunk("r", lambda: early.append(wait_writes(node[1])))
        if begin < END - CHUNK:
            engine.add_layer_hook(hook)
        node[0].resume["r"] = asyncio.Event()  # hold the role at the prefill's end: pages pinned
        send = asyncio.ensure_future(role.remote_send(RemoteSend("r", PROMPT, END, nodes.window(res))))
        await within(node[0].event("r").wait())
        assert early == ([True] if begin < END - CHUNK else []), "no layer was written before the last chunk"
        src = await engine.run(lambda e: e.slots_of("r"))
        sent = at_slots(await kv_of(engine), src[begin:END], P_PAGE)
        node[0].resume["r"].set()
        result = await within(send)

        assert (result.kv_window_begin, result.kv_window_end) == (begin, END)
        assert torch.equal(await kv_of(nodes.decode), with_slots(before, res.slots, D_PAGE, sent))
        writes = node[1].writes
        assert len(writes) >= (2 if early else 1) and all(w.notification == b"" for w in writes)
        assert result.num_bytes == sum(w.num_bytes for w in writes) == sent.numel() * sent.element_size()
        assert tags(nodes.d_agent) == [("layers-agent", notification_tag("r", LEASE))]
        assert await started_tokens(nodes.decode, "r") == expected
        engine.remove_layer_hook(hook)

    asyncio.run(go())


@pytest.mark.parametrize("p_order, d_order", [("layer-major", "layer-major"), ("page-major", "layer-major"),
                                              ("layer-major", "page-major")])
def test_layer_wise_sends_between_pools_of_either_order_land_exactly_the_window(nodes, p_order, d_order):
    """`--kv-layout` (engine/kv_pool.py): the plan follows each side's strides. Between two
    layer-major pools a step's run of slots is two descriptors per layer, whatever the
    page sizes, where page-major pools of pages of 8 and 4 slots need one per page."""
    async def go():
        decode = nodes.engine(D_PAGE, D_PAGES, kv_layout=d_order)
        d_agent = nodes.fabric.agent("decode-" + d_order, decode.engine.kv_cache)
        nodes.decode, nodes.d_agent = decode, d_agent
        nodes.d_layout = KVLayout.from_tensor(decode.engine.kv_cache, D_PAGE)
        engine, agent, layout = nodes.prefill_node("layers-" + p_order, max_num_batched_tokens=CHUNK,
                                                   kv_layout=p_order)
        assert (layout.kind, nodes.d_layout.kind) == (p_order, d_order)
        await fill_pools(nodes)
        await engine.run(lambda e: e.kv_cache.fill_(-3.0))
        watch = PrefillWatch(engine)
        role = nodes.role(node=(watch, agent, layout), kv_send="layerwise")
        expected = await generate_tokens(nodes.engine(), "local", PROMPT)
        res = await nodes.reserve("r")
        before = await kv_of(decode)
        watch.resume["r"] = asyncio.Event()  # hold the role at the prefill's end: pages pinned
        send = asyncio.ensure_future(role.remote_send(RemoteSend("r", PROMPT, END, nodes.window(res))))
        await within(watch.event("r").wait())
        src = await engine.run(lambda e: e.slots_of("r"))
        sent = at_slots(await kv_of(engine), src[:END], P_PAGE)
        watch.resume["r"].set()
        result = await within(send)

        assert torch.equal(await kv_of(decode), with_slots(before, res.slots, D_PAGE, sent))
        assert result.num_bytes == sent.numel() * sent.element_size()
        if p_order == d_order == "layer-major":  # both pools fresh: every step's slots are one run
            assert result.num_descriptors == 2 * layout.num_layers * len(agent.writes)
        assert tags(d_agent) == [("layers-" + p_order, notification_tag("r", LEASE))]
        assert await started_tokens(decode, "r") == expected

    asyncio.run(go())


def test_layers_computed_before_an_overlapped_window_arrives_are_written_when_it_does(nodes):
    async def go():
        node, engine = chunked(nodes, "layers-agent")
        role = nodes.role(node=node, kv_send="layerwise")
        expected = await generate_tokens(nodes.engine(), "local", PROMPT)
        res = await nodes.reserve("o")
        delivered = threading.Event()
        loop = asyncio.get_running_loop()

        def deliver():  # from the engine thread, in the last chunk: three chunks wait for it
            asyncio.run_coroutine_threadsafe(role.deliver_window("o", nodes.window(res)), loop).result(WAIT_S)
            delivered.set()
        hook = in_last_chunk("o", deliver)
        engine.add_layer_hook(hook)
        send = asyncio.ensure_future(role.remote_send_overlapped(OverlappedSend("o", PROMPT, END)))
        result = await within(send)
        assert delivered.is_set() and (result.kv_window_begin, result.kv_window_end) == (0, END)
        assert tags(nodes.d_agent) == [("layers-agent", notification_tag("o", LEASE))]
        assert await started_tokens(nodes.decode, "o") == expected
        engine.remove_layer_hook(hook)

    asyncio.run(go())


def test_an_abort_in_the_middle_of_a_layer_wise_window_stops_its_writes_and_frees_its_pages(nodes):
    async def go():
        node, engine = chunked(nodes, "layers-agent")
        role = nodes.role(node=node, kv_send="layerwise")
        res = await nodes.reserve("a")
        reached, proceed = threading.Event(), threading.Event()

        def hold():  # some layers are written, the prefill is not over
            assert wait_writes(node[1])
            reached.set()
            proceed.wait(WAIT_S)
        hook = in_last_chunk("a", hold)
        engine.add_layer_hook(hook)
        send = asyncio.ensure_future(role.remote_send(RemoteSend("a", PROMPT, END, nodes.window(res))))
        assert await asyncio.to_thread(reached.wait, WAIT_S)
        stream = role.in_flight["a"].stream
        abort = asyncio.ensure_future(role.abort("a"))
        await asyncio.wait([pdserve.prefill.layer_stream.on_loop(stream.future)], timeout=WAIT_S)  # stopped, drained
        written = len(node[1].writes)
        proceed.set()  # the rest of the prefill computes layers: none of them may be written
        assert await within(abort) is True
        with pytest.raises(RequestAborted):
            await within(send)
        assert await nodes.no_write_notice("a")
        assert tags(nodes.d_agent) == []  # and no KV-ready tag
        assert len(node[1].writes) == written, "a layer was written after the abort"
        engine.remove_layer_hook(hook)
        await nodes.unreserve("a")

    asyncio.run(go())


def test_a_failed_layer_write_fails_the_send_and_tells_the_decode_node(nodes):
    async def go():
        node, engine = chunked(nodes, "layers-agent")
        role = nodes.role(node=node, kv_send="layerwise")
        res = await nodes.reserve("f")
        node[1].fail_next_write("link down")
        with pytest.raises(PeerUnavailable, match="link down"):
            await within(role.remote_send(RemoteSend("f", PROMPT, END, nodes.window(res))))
        assert await nodes.no_write_notice("f")
        assert tags(nodes.d_agent) == []
        await nodes.unreserve("f")

    asyncio.run(go())


def test_every_send_of_a_role_streams_its_layers_once(nodes):
    """The role's layer hook is installed once (with the role), whatever the number of sends."""
    async def go():
        node, engine = chunked(nodes, "layers-agent")
        role = nodes.role(node=node, kv_send="layerwise")
        for key in ("s1", "s2", "s3"):
            res = await nodes.reserve(key)
            result = await within(role.remote_send(RemoteSend(key, PROMPT, END, nodes.window(res))))
            assert result.kv_window_end == END
            assert tags(nodes.d_agent) == [("layers-agent", notification_tag(key, LEASE))]
            await nodes.unreserve(key)
        assert await engine.run(lambda e: engine._layer_hooks) == [role.layers.hook]

    asyncio.run(go())


class FakeCudaEvent:
    """A CUDA event the test completes by hand: `query` and `synchronize` as torch's."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.waited = threading.Event()  # someone blocked in synchronize()

    def query(self) -> bool:
        return self.done.is_set()

    def synchronize(self) -> None:
        self.waited.set()
        self.done.wait(WAIT_S)


def test_on_a_gpu_a_layer_is_written_only_once_its_cuda_event_has_completed(nodes, monkeypatch):
    """The pool's layout says cuda: the hook records an event per layer and step (here a
    stand-in), and the sender posts no span whose event is not complete: the first chunk
    goes out once its layers' events are done, the rest waits for theirs."""
    events: list[FakeCudaEvent] = []

    def stored(device):
        assert threading.current_thread().name != "kv-layers", "not on the engine's thread"
        events.append(FakeCudaEvent())
        return events[-1]

    monkeypatch.setattr(pdserve.prefill.layerwise, "kv_stored", stored)
    for module in (pdserve.prefill.layerwise, pdserve.prefill.sending):  # no CUDA here: the threads bind nothing
        monkeypatch.setattr(module, "bind_device", lambda device: None)

    async def go():
        await fill_pools(nodes)
        (watch, agent, layout), engine = chunked(nodes, "layers-agent")
        gpu_layout = dataclasses.replace(layout, device="cuda:0")
        role = nodes.role(node=(watch, agent, gpu_layout), kv_send="layerwise")
        expected = await generate_tokens(nodes.engine(), "local", PROMPT)
        res = await nodes.reserve("g")
        assert res.prefix_matched_length == 0
        before = await kv_of(nodes.decode)
        watch.resume["g"] = asyncio.Event()  # hold the role at the prefill's end: pages pinned
        send = asyncio.ensure_future(role.remote_send(RemoteSend("g", PROMPT, END, nodes.window(res))))
        await within(watch.event("g").wait())  # every chunk computed, no event complete
        layers = gpu_layout.num_layers
        assert len(events) == layers * 4  # one per layer of each of the four chunks
        assert await asyncio.to_thread(events[0].waited.wait, WAIT_S), "the sender did not wait on the device"
        assert agent.writes == [], "a layer was written before its K/V store ran"
        for event in events[:layers]:  # the first chunk's layers are stored
            event.done.set()
        assert await asyncio.to_thread(wait_writes, agent)
        assert agent.writes[0].num_bytes == CHUNK * gpu_layout.bytes_per_token  # that chunk alone
        assert await asyncio.to_thread(events[layers].waited.wait, WAIT_S)
        assert len(agent.writes) == 1
        for event in events[layers:]:
            event.done.set()
        src = await engine.run(lambda e: e.slots_of("g"))
        sent = at_slots(await kv_of(engine), src[:END], P_PAGE)
        watch.resume["g"].set()
        result = await within(send)
        assert result.num_bytes == sum(w.num_bytes for w in agent.writes) == sent.numel() * sent.element_size()
        assert torch.equal(await kv_of(nodes.decode), with_slots(before, res.slots, D_PAGE, sent))
        assert tags(nodes.d_agent) == [("layers-agent", notification_tag("g", LEASE))]
        assert await started_tokens(nodes.decode, "g") == expected

    asyncio.run(go())


def test_a_stream_that_fails_in_the_loops_last_turn_is_not_logged_as_never_retrieved(caplog):
    # An aborted send's end is often never awaited: asyncio must not log its StreamFailed,
    # even when the loop stops in the very turn that sets it.
    gc.collect()  # what earlier tests left is not this test's
    caplog.clear()
    loop = asyncio.new_event_loop()

    async def fail_and_return():
        ended = Future()
        on_loop = pdserve.prefill.layer_stream.on_loop(ended)
        ended.set_exception(StreamFailed("aborted"))
        return on_loop

    ended = loop.run_until_complete(fail_and_return())
    loop.close()
    assert ended.done()  # and its exception unread here, as an unawaited send's is
    with caplog.at_level("ERROR", logger="asyncio"):
        del ended
        gc.collect()
    assert "never retrieved" not in caplog.text
