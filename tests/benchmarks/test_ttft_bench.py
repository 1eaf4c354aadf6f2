"""`pdserve bench ttft --busy N`: the measured request runs beside N others of its length,
each followed by another until it ends (the request itself is faked: the test is about the
load around it)."""

from __future__ import annotations

import asyncio
import random

from pdserve.benchmarks import ttft


def test_busy_requests_run_beside_the_measured_one_and_all_end(monkeypatch):
    measured = list(range(7))
    running: set[int] = set()
    beside, prompts, started = [], [], []
    rng = random.Random(0)

    async def one(address, prompt):
        key = len(started)
        started.append(key)
        running.add(key)
        try:
            if prompt is measured:
                for _ in range(5):  # the others come and go meanwhile
                    await asyncio.sleep(0)
                    beside.append(len(running) - 1)
                return {"ttft_s": 1.0}
            prompts.append(prompt)
            await asyncio.sleep(0)
            return {"ttft_s": 2.0}
        finally:
            running.discard(key)

    monkeypatch.setattr(ttft, "_one", one)

    async def go():
        result = await ttft._beside("router:1", measured, 3, rng)
        return result, set(running)

    result, left = asyncio.run(go())
    assert result == {"ttft_s": 1.0} and left == set()  # the others ended with it
    assert beside and min(beside) == 3  # three others at every point of the measured one
    assert len(prompts) > 3 and {len(p) for p in prompts} == {len(measured)}  # replaced as they end
    assert asyncio.run(ttft._beside("router:1", measured, 0, rng)) == {"ttft_s": 1.0}
    drawn = len(prompts)
    asyncio.run(ttft._beside("router:1", measured, 3, rng))  # the next measured request's others:
    assert not {tuple(p) for p in prompts[drawn:]} & {tuple(p) for p in prompts[:drawn]}  # all new
