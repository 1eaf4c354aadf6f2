"""On a GPU the engine reports a prefill done without waiting for its kernels: the
"prefilled" output carries a CUDA event (`kv_ready`) that completes once the prompt's KV is
in memory. The role writes nothing that event covers before it has completed: the whole
window, or in a layer-wise send what no layer's own event covers (a prefix this node had
cached). Here the event is a stand-in the test completes by hand, so the order is checked
exactly. The set-up: tests/prefill/world.py.
"""

from __future__ import annotations

import asyncio

import torch

from pdserve.prefill.requests import RemoteSend
from tests.prefill.test_layerwise import CHUNK, FakeCudaEvent
from tests.prefill.world import (
    D_PAGE,
    END,
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


class ReadyLater(PrefillWatch):
    """The prefill engine, its "prefilled" outputs carrying `event` as their `kv_ready`."""

    def __init__(self, engine, event: FakeCudaEvent) -> None:
        super().__init__(engine)
        self.ready = event

    async def generate(self, request_id, prompt, params, **options):
        async for out in super().generate(request_id, prompt, params, **options):
            if out.finish_reason == "prefilled":
                out.kv_ready = self.ready
            yield out


async def sent_kv(engine, request_id: str, begin: int) -> torch.Tensor:
    src = await engine.run(lambda e: e.slots_of(request_id))
    return at_slots(await kv_of(engine), src[begin:END], P_PAGE)


def test_a_whole_window_is_written_only_once_the_prefill_event_has_completed(nodes):
    async def go():
        await fill_pools(nodes)
        event = FakeCudaEvent()
        role = nodes.role(node=(ReadyLater(nodes.prefill, event), nodes.p_agent, nodes.p_layout), kv_send="whole")
        expected = await generate_tokens(nodes.engine(), "local", PROMPT)
        res = await nodes.reserve("w")
        before = await kv_of(nodes.decode)
        send = asyncio.ensure_future(role.remote_send(RemoteSend("w", PROMPT, END, nodes.window(res))))
        assert await asyncio.to_thread(event.waited.wait, WAIT_S), "the writer did not wait for the event"
        assert nodes.p_agent.writes == [], "KV was written before the prefill's kernels had stored it"
        sent = await sent_kv(nodes.prefill, "w", res.prefix_matched_length)
        event.done.set()
        await within(send)
        assert len(nodes.p_agent.writes) == 1
        assert torch.equal(await kv_of(nodes.decode), with_slots(before, res.slots, D_PAGE, sent))
        assert await started_tokens(nodes.decode, "w") == expected

    asyncio.run(go())


def test_layer_wise_the_cached_prefix_is_written_only_once_the_prefill_event_has_completed(nodes):
    """The prefill node has the prompt's full pages cached: it computes [24, 28) (layer by
    layer, each layer written at once), and positions [0, 24) wait for the event."""
    async def go():
        await fill_pools(nodes)
        engine, agent, layout = nodes.prefill_node("layers-agent", max_num_batched_tokens=CHUNK)
        expected = await generate_tokens(engine, "warm", PROMPT)  # caches the prompt's full pages
        event = FakeCudaEvent()
        role = nodes.role(node=(ReadyLater(engine, event), agent, layout), kv_send="layerwise")
        res = await nodes.reserve("g")
        assert res.prefix_matched_length == 0
        before = await kv_of(nodes.decode)
        send = asyncio.ensure_future(role.remote_send(RemoteSend("g", PROMPT, END, nodes.window(res))))
        assert await asyncio.to_thread(event.waited.wait, WAIT_S), "the sender did not wait for the event"
        cached = (END - 1) // P_PAGE * P_PAGE
        computed = (END - cached) * layout.bytes_per_token
        assert sum(w.num_bytes for w in agent.writes) == computed, "only the computed positions went first"
        sent = await sent_kv(engine, "g", 0)
        event.done.set()
        result = await within(send)
        assert result.prefill_cached_tokens == cached
        assert result.num_bytes == sum(w.num_bytes for w in agent.writes) == END * layout.bytes_per_token
        assert torch.equal(await kv_of(nodes.decode), with_slots(before, res.slots, D_PAGE, sent))
        assert await started_tokens(nodes.decode, "g") == expected

    asyncio.run(go())
