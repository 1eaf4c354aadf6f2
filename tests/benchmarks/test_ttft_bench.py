"""`pdserve bench ttft --busy N`: the measured request runs beside N others of its length,
each followed by another until it ends (the request itself is faked: the test is about the
load around it)."""

from __future__ import annotations

import asyncio
import random

from pdserve.benchmarks import ttft

WAIT_S = 10.0


def test_busy_requests_run_beside_the_measured_one_and_all_end(monkeypatch):
    """The measured request waits until its three others have started, lets them end, and
    waits until each was replaced: it ends only then, and the last three with it."""
    measured = list(range(7))
    running: set[int] = set()
    beside, prompts = [], []
    rng = random.Random(0)
    changed = permits = None  # each run's: an asyncio.Condition, and a queue whose items let busy requests end

    async def started(n: int) -> None:  # bounded only for a broken _beside, which never gets there
        async with changed:
            await asyncio.wait_for(changed.wait_for(lambda: len(prompts) >= n), WAIT_S)

    async def one(address, prompt):
        if prompt is measured:
            if others:
                base = len(prompts)
                await started(base + 3)
                beside.append(len(running))
                for _ in range(3):
                    permits.put_nowait(None)  # the first three end
                await started(base + 6)  # ... and each was followed by another
                beside.append(len(running))
                for _ in range(3):
                    permits.put_nowait(None)  # those end once the measured one has
            return {"ttft_s": 1.0}
        key = len(prompts)
        running.add(key)
        prompts.append(prompt)
        async with changed:
            changed.notify_all()
        await permits.get()
        running.discard(key)
        return {"ttft_s": 2.0}

    monkeypatch.setattr(ttft, "_one", one)

    async def go(n: int):
        nonlocal others, changed, permits
        others, changed, permits = n, asyncio.Condition(), asyncio.Queue()
        return await ttft._beside("router:1", measured, n, rng), set(running)

    others = 0
    assert asyncio.run(go(3)) == ({"ttft_s": 1.0}, set())  # the others ended with it
    assert beside == [3, 3] and len(prompts) == 6 and {len(p) for p in prompts} == {len(measured)}
    drawn = len(prompts)
    asyncio.run(go(3))  # the next measured request's others: prompts never seen before
    assert len(prompts) == 2 * drawn
    assert not {tuple(p) for p in prompts[drawn:]} & {tuple(p) for p in prompts[:drawn]}
    assert asyncio.run(go(0)) == ({"ttft_s": 1.0}, set()) and len(prompts) == 2 * drawn
