"""500 concurrent streams through one router: every stream completes or ends with a clear
status, and no page is leaked. How many complete, and how fast, depends on the machine's
other load (a refusal after waiting for pages is correct then): printed with the peak
memory of every node, not asserted; time bounds belong to benchmarks."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

import grpc

from pdserve.client import AsyncClient
from tests.cluster.nodes import full, run, wait_pools_full

STREAMS = 500
CLEAR = {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE}


def peak_rss_mb(pids) -> float:
    """Sum of the peak resident memory (VmHWM) of these processes."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def test_500_concurrent_streams_through_one_router(fault_cluster):
    c = fault_cluster

    async def one(client, i):
        try:
            out = await client.generate(f"load {i} the river under the bridge", max_tokens=8,
                                        temperature=0.7, seed=i, ignore_eos=True, timeout=300)
            assert len(out.token_ids) == 8 and out.usage.completion_tokens == 8
            return "OK"
        except grpc.aio.AioRpcError as err:
            assert err.code() in CLEAR, (err.code(), err.details())
            assert err.details()
            return err.code().name

    async def go():
        async with AsyncClient(c.address("main")) as client:
            t0 = time.monotonic()
            outcomes = await asyncio.gather(*(one(client, i) for i in range(STREAMS)))
            wall = time.monotonic() - t0
        return Counter(outcomes), wall, await wait_pools_full(c.workers)

    outcomes, wall, reports = run(go(), timeout_s=420)
    names = ["main", "p1", "p2", "d1", "d2"]
    peaks = {n: peak_rss_mb(c.nodes[n].pids()) for n in names}
    print(f"\nload: {STREAMS} streams in {wall:.1f} s; outcomes {dict(outcomes)}; peak RSS MB "
          + ", ".join(f"{n} {peaks[n]:.0f}" for n in names))
    assert outcomes["OK"] > 0, outcomes
    assert all(full(r) for r in reports), reports
