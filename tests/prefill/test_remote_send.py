"""RemoteSend: the bytes that land, the notification, the tokens.

The set-up, and how a phase is reached without waiting for time: tests/prefill/world.py.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from pdserve.prefill.requests import RemoteSend
from pdserve.proto.tags import notification_tag
from tests.prefill.world import (
    D_PAGE,
    END,
    GREEDY,
    LEASE,
    P_PAGES,
    PROMPT,
    PROMPT_LEN,
    WAIT_S,
    fill_pools,
    free_pages,
    generate_tokens,
    kv_of,
    prompt_of,
    started_tokens,
    with_slots,
    within,
)

# ---- RemoteSend: the bytes, the notification, the tokens -------------------------------

@pytest.mark.parametrize("decode_has_prefix", [False, True], ids=["window-from-0", "after-decode-prefix"])
def test_remote_send_writes_exactly_the_window_kv_into_the_reserved_slots_and_notifies(
        nodes, decode_has_prefix):
    async def go():
        await fill_pools(nodes)
        role = nodes.role()
        if decode_has_prefix:
            # A colocated run on the receiving engine caches the prompt's full pages there,
            # so its reservation starts past them: those slots must stay untouched.
            expected_tokens = await generate_tokens(nodes.decode, "local", PROMPT)
        else:
            expected_tokens = await generate_tokens(nodes.engine(), "local", PROMPT)
        res = await nodes.reserve("r")
        begin = res.prefix_matched_length
        assert begin == ((END - 1) // D_PAGE) * D_PAGE if decode_has_prefix else begin == 0
        before = await kv_of(nodes.decode)

        hold = nodes.p_agent.hold_writes()
        send = asyncio.ensure_future(role.remote_send(
            RemoteSend("r", PROMPT, END, nodes.window(res))))
        sent = await nodes.sent_kv_while_held(hold, "r", begin)
        assert not (sent == -3.0).any(), "the window's source KV was never computed"
        hold.release()
        result = await within(send)

        after = await kv_of(nodes.decode)
        assert torch.equal(after, with_slots(before, res.slots, D_PAGE, sent))
        assert (result.kv_window_begin, result.kv_window_end) == (begin, END)
        assert result.num_tokens_sent == END - begin
        assert result.num_bytes == (END - begin) * nodes.p_layout.bytes_per_token
        [write] = nodes.p_agent.writes
        assert write.remote == "decode-agent" and write.num_bytes == result.num_bytes
        assert result.num_descriptors == len(write.descriptors)
        assert nodes.d_agent.take_notifications() == [
            ("prefill-agent", notification_tag("r", LEASE))]
        load = role.load()
        assert (load.num_running, load.remote_sends_total, load.last_kv_window_begin,
                load.kv_bytes_sent_total) == (0, 1, begin, result.num_bytes)
        assert await free_pages(nodes.prefill) == (P_PAGES, P_PAGES)

        assert await started_tokens(nodes.decode, "r") == expected_tokens

    asyncio.run(go())


def test_received_window_generates_what_a_colocated_engine_generates(nodes):
    """Without the byte comparison: the end-to-end claim on a second prompt and a window
    that ends before the last two prompt tokens."""
    prompt = prompt_of(37, seed=11)

    async def go():
        role = nodes.role()
        expected = await generate_tokens(nodes.engine(), "local", prompt)
        res = await nodes.reserve("r2", prompt, end=35)
        result = await within(role.remote_send(RemoteSend("r2", prompt, -2, nodes.window(res))))
        assert (result.kv_window_begin, result.kv_window_end) == (0, 35)
        assert await started_tokens(nodes.decode, "r2") == expected

    asyncio.run(go())


def test_decode_peer_is_added_once_for_concurrent_sends(nodes):
    prompts = [prompt_of(PROMPT_LEN, seed=s) for s in (1, 2)]

    async def go():
        role = nodes.role()
        reservations = [await nodes.reserve(f"c{i}", p) for i, p in enumerate(prompts)]
        results = await within(asyncio.gather(*(
            role.remote_send(RemoteSend(f"c{i}", p, END, nodes.window(res)))
            for i, (p, res) in enumerate(zip(prompts, reservations)))))
        assert [r.num_tokens_sent for r in results] == [END, END]
        assert nodes.p_agent.add_remote_calls == 1
        assert sorted(tag for _, tag in nodes.d_agent.take_notifications()) == sorted(
            notification_tag(f"c{i}", LEASE) for i in range(2))
        for i, p in enumerate(prompts):
            assert await started_tokens(nodes.decode, f"c{i}") == \
                await generate_tokens(nodes.engine(), f"ref{i}", p)

    asyncio.run(go())


def test_the_reply_does_not_wait_for_the_engine_step_in_progress(nodes):
    """A send's pages are released after its write, but its reply goes first: on a busy
    node the engine is then in another request's step (a whole prefill chunk), and the
    decode node's StartGeneration, the time to first token, waits for the reply."""
    reached, proceed, left = threading.Event(), threading.Event(), threading.Event()

    def hold_busy(layer: int, ranges) -> None:  # the engine thread, in "busy"'s forward
        if layer == 0 and any(r[0] == "busy" for r in ranges) and not reached.is_set():
            reached.set()
            proceed.wait(2 * WAIT_S)
            left.set()

    async def prefill_busy():
        async for _ in nodes.prefill.generate("busy", prompt_of(20, seed=3), GREEDY, prefill_only=True):
            pass

    async def go():
        role = nodes.role()
        expected = await generate_tokens(nodes.engine(), "local", PROMPT)
        res = await nodes.reserve("r")
        hold = nodes.p_agent.hold_writes()
        send = asyncio.ensure_future(role.remote_send(RemoteSend("r", PROMPT, END, nodes.window(res))))
        assert await asyncio.to_thread(hold.started.wait, WAIT_S)  # prefilled, its write posted
        nodes.prefill.add_layer_hook(hold_busy)
        busy = asyncio.ensure_future(prefill_busy())
        try:
            assert await asyncio.to_thread(reached.wait, WAIT_S)  # the engine is in busy's step
            engine_held_at_reply = []
            send.add_done_callback(lambda _: engine_held_at_reply.append(not left.is_set()))
            hold.release()
            await asyncio.wait([send], timeout=WAIT_S)
        finally:
            proceed.set()
            hold.release()
            await within(busy)
            nodes.prefill.remove_layer_hook(hold_busy)
            assert await nodes.prefill.run(lambda e: e.release("busy"))
        assert (await within(send)).num_tokens_sent == END
        assert engine_held_at_reply == [True], "RemoteSend answered only after the engine's step"
        assert await free_pages(nodes.prefill) == (P_PAGES, P_PAGES)  # released, in order
        assert await started_tokens(nodes.decode, "r") == expected

    asyncio.run(go())
