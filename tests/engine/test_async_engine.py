"""AsyncEngine: streams from its own thread, runs commands between steps, aborts on
request and when the consumer goes away, and sleeps when idle."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from pdserve.engine import AsyncEngine, EngineConfig, SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture
def async_engine(make_engine):
    ae = AsyncEngine(make_engine("llama", page_size=4, num_pages=64))
    yield ae
    ae.shutdown()


def test_concurrent_streams_match_the_sync_engine(async_engine, prompts_of_lengths):
    prompts = prompts_of_lengths([5, 12, 20], seed=41)

    async def collect(i, p):
        return [out async for out in async_engine.generate(f"r{i}", p, GREEDY)]

    async def main():
        return await asyncio.gather(*(collect(i, p) for i, p in enumerate(prompts)))

    streams = asyncio.run(main())
    for stream in streams:
        assert stream[-1].finished and len(stream[-1].token_ids) == 6
        assert [t for d in stream for t in d.outputs[0].new_token_ids] == stream[-1].token_ids

    async def reference():
        return await async_engine.run(lambda e: e.num_free_pages() == e.num_total_pages())

    assert asyncio.run(reference())


def test_run_propagates_exceptions(async_engine):
    async def main():
        with pytest.raises(ValueError, match="empty"):
            await async_engine.run(lambda e: e.add_request("x", [], GREEDY))
        with pytest.raises(ValueError, match="empty"):
            async for _ in async_engine.generate("y", [], GREEDY):
                pass

    asyncio.run(main())


def test_post_runs_in_order_without_a_wait_and_logs_what_it_raises(async_engine, caplog):
    ran = []

    def fails(engine):
        ran.append("fails")
        raise RuntimeError("posted and broken")

    async def main():
        async_engine.post(fails)
        async_engine.post(lambda e, x: ran.append(x), "after")
        return await async_engine.run(lambda e: list(ran))

    with caplog.at_level("ERROR", logger="pdserve.engine"):
        assert asyncio.run(main()) == ["fails", "after"]  # run came later: it saw both
    assert "posted and broken" in caplog.text


def test_a_posted_command_outlives_a_step_that_fails(async_engine, prompts_of_lengths):
    """A release posted while a step runs still runs when the step raises: the failure
    ends the streams and what their callers wait for, not what nobody waits for."""
    a, b = prompts_of_lengths([9, 7], seed=5)

    def breaks(layer, ranges):
        if layer == 0 and any(r[0] == "b" for r in ranges):
            async_engine.post(lambda e: e.release("a"))
            raise RuntimeError("a broken step")

    async def main():
        async for _ in async_engine.generate("a", a, GREEDY, prefill_only=True):
            pass  # prefilled: its pages pinned until released
        async_engine.add_layer_hook(breaks)
        with pytest.raises(RuntimeError, match="a broken step"):
            async for _ in async_engine.generate("b", b, GREEDY, prefill_only=True):
                pass
        async_engine.remove_layer_hook(breaks)
        return await async_engine.run(lambda e: (list(e.requests), e.num_free_pages() == e.num_total_pages()))

    assert asyncio.run(main()) == ([], True)


def test_abort_ends_the_stream_and_frees_pages(async_engine, prompts_of_lengths):
    prompt = prompts_of_lengths([10], seed=42)[0]
    long = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)

    async def main():
        outs = []
        async for out in async_engine.generate("a", prompt, long):
            outs.append(out)
            if len(outs) == 2:
                assert await async_engine.abort("a")
        return outs

    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].finish_reason == "abort"


def test_consumer_going_away_aborts_the_request(async_engine, prompts_of_lengths):
    prompt = prompts_of_lengths([10], seed=43)[0]
    long = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)

    async def main():
        async for _ in async_engine.generate("a", prompt, long):
            break  # closes the generator
        for _ in range(200):
            if await async_engine.run(lambda e: not e.has_unfinished()):
                return True
            await asyncio.sleep(0.01)
        return False

    assert asyncio.run(main())


def thread_cpu_s(native_id: int) -> float:
    """CPU time of one thread of this process (ns in schedstat): the engine thread's alone,
    whatever other threads earlier tests left in the process do meanwhile."""
    return int(open(f"/proc/self/task/{native_id}/schedstat").read().split()[0]) / 1e9


def test_idle_engine_thread_uses_no_cpu(async_engine):
    engine_thread = asyncio.run(async_engine.run(lambda e: threading.get_native_id()))
    time.sleep(0.1)
    before = thread_cpu_s(engine_thread)
    time.sleep(0.5)
    assert thread_cpu_s(engine_thread) - before < 0.005


def test_prefill_only_then_start_generation_through_async(make_engine, prompts_of_lengths):
    prefill = AsyncEngine(make_engine("llama", page_size=4, num_pages=64))
    decode = AsyncEngine(make_engine("llama", page_size=4, num_pages=64))
    prompt = prompts_of_lengths([15], seed=44)[0]

    async def main():
        local = [o async for o in decode.generate("local", prompt, GREEDY)][-1].token_ids
        await decode.run(lambda e: e.prefix_cache.clear())
        res = await decode.run(lambda e: e.prepare_receive("r", prompt, GREEDY, 14))
        done = [o async for o in prefill.generate("r", prompt[:14], GREEDY, prefill_only=True)][-1]
        assert done.finish_reason == "prefilled"
        slots = await prefill.run(lambda e: e.slots_of("r"))
        # kv_cache is page-major [pages, layers, 2, page_size, Hkv, D] (page size 4 here).
        kv = await prefill.run(lambda e: e.kv_cache[[s // 4 for s in slots], :, :, [s % 4 for s in slots]].clone())

        def put(e):
            e.kv_cache[[s // 4 for s in res.slots], :, :, [s % 4 for s in res.slots]] = kv
        await decode.run(put)
        await prefill.run(lambda e: e.release("r"))
        out = [o async for o in decode.start_generation("r")][-1]
        return local, out.token_ids

    try:
        local, remote = asyncio.run(main())
        assert local == remote
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_built_from_a_config_the_engine_loads_on_its_own_thread(checkpoint_dirs, monkeypatch):
    """Loading runs OpenMP work, and OpenMP keeps a pool of threads per thread that starts
    it: built on the caller's thread, the process would hold a second pool, and the engine's
    workers would sleep and wake at every parallel region (AsyncEngine._build)."""
    import pdserve.engine.async_engine as module

    built_on = []

    class Recording(module.Engine):
        def __init__(self, config):
            built_on.append(threading.current_thread())
            super().__init__(config)

    monkeypatch.setattr(module, "Engine", Recording)
    ae = AsyncEngine(EngineConfig(model_dir=checkpoint_dirs("llama"), page_size=4, num_pages=16))
    try:
        assert built_on == [ae._thread] and ae._thread is not threading.current_thread()
        assert isinstance(ae.engine, Recording)
    finally:
        ae.shutdown()


def test_an_engine_that_fails_to_build_raises_to_the_caller_and_leaves_no_thread(tmp_path):
    before = set(threading.enumerate())
    with pytest.raises(ValueError, match="config.json"):
        AsyncEngine(EngineConfig(model_dir=str(tmp_path), page_size=4, num_pages=16))
    for thread in set(threading.enumerate()) - before:
        thread.join(timeout=10)
        assert not thread.is_alive(), f"{thread.name} still runs"
