"""The Engine's one-thread rule (engine/owner_thread.py): an entry point called on any
thread but the owner raises, and the roles' paths, which reach the Engine only through
their AsyncEngine, never do."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from pdserve.decode.config import DecodeConfig
from pdserve.decode.requests import PrepareReceive, StartGeneration
from pdserve.decode.role import DecodeRole
from pdserve.engine import AsyncEngine, SamplingParams
from pdserve.prefill.requests import RemoteSend, Window
from tests.prefill.conftest import nodes  # noqa: F401 (the prefill tests' world, checked for leaks)
from tests.prefill.world import D_PAGE, END, GREEDY, PROMPT, generate_tokens, within

SHORT = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def on_another_thread(fn):
    """What `fn()` raised on a thread named "intruder" (None if nothing)."""
    raised = []

    def call():
        try:
            fn()
        except BaseException as err:
            raised.append(err)
    thread = threading.Thread(target=call, name="intruder")
    thread.start()
    thread.join()
    return raised[0] if raised else None


def test_a_second_thread_entering_an_engine_in_use_raises_naming_both_threads(make_engine, prompts_of_lengths):
    engine = make_engine("llama", page_size=4, num_pages=16)
    engine.add_request("a", prompts_of_lengths([6], seed=50)[0], SHORT)  # this thread owns it now
    for entry in (engine.step, lambda: engine.abort("a"), engine.num_free_pages):
        err = on_another_thread(entry)
        assert isinstance(err, AssertionError), err
        assert "on thread 'intruder', but thread 'MainThread' owns it" in str(err)
    while engine.has_unfinished():  # the owner is unaffected
        engine.step()


def test_an_async_engine_s_thread_owns_its_engine_until_shutdown(make_engine, prompts_of_lengths):
    engine = make_engine("llama", page_size=4, num_pages=16)
    engine.num_free_pages()  # built and first entered here, then handed over
    ae = AsyncEngine(engine)
    prompt = prompts_of_lengths([6], seed=51)[0]

    async def main():
        with pytest.raises(AssertionError, match=r"Engine\.add_request called on thread 'MainThread', "
                                                 r"but thread 'engine-loop' owns it"):
            ae.engine.add_request("x", prompt, SHORT)  # from the event loop: the broken rule
        outs = [out async for out in ae.generate("y", prompt, SHORT)]
        return outs[-1], await ae.run(lambda e: e.num_free_pages())

    try:
        last, free = asyncio.run(main())
        assert last.finished and len(last.token_ids) == 6 and free == 16
    finally:
        ae.shutdown()
    assert engine.num_free_pages() == 16  # the loop ended: this thread may enter it again


def test_the_roles_paths_never_enter_the_engine_from_the_event_loop(nodes):  # noqa: F811
    """A request through both roles, its KV sent layer by layer (the prefill role's hook
    installed through the AsyncEngine): no entry point raises, though the check is on."""
    async def go():
        prefill = nodes.role(kv_send="layerwise")
        vocab_size, max_model_len = await nodes.decode.run(lambda e: (e.vocab_size, e.max_model_len))
        decode = DecodeRole(nodes.decode, nodes.d_agent, DecodeConfig(), vocab_size, max_model_len,
                            page_size=D_PAGE)
        nodes.roles.append(decode)
        with pytest.raises(AssertionError, match="owns it"):
            nodes.decode.engine.num_free_pages()  # the check is on here

        expected = await generate_tokens(nodes.engine(), "local", PROMPT)
        prepared = await within(decode.prepare_receive(PrepareReceive("r", PROMPT, GREEDY, END)))
        lease = prepared.lease
        window = Window(lease.prefix_matched_length, prepared.kv_append_metadata, lease.lease_id,
                        nodes.peer(), time.monotonic() + 60)
        result = await within(prefill.remote_send(RemoteSend("r", PROMPT, END, window)))
        assert result.num_writes >= 1
        start = StartGeneration("r", lease.lease_id, lease.kv_window_end, expect_kv=True)
        outs = [out async for out in decode.start_generation(start)]
        assert outs[-1].finished and outs[-1].token_ids == expected

    asyncio.run(go())
