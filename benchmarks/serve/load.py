"""Drives a workload against a backend: open-loop arrivals, optionally capped in flight.

Each request is sent at its own offset from the run's start (offsets are absolute, so a
slow send never shifts the ones after it). With `max_concurrency`, a request that arrives
while that many are in flight waits for one to finish, and its latencies count from when
it was actually sent; an infinite rate with a cap is a closed loop of fixed concurrency.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.benchmarks.serve.metrics import RequestResult, run_duration
from pdserve.benchmarks.serve.progress import RunProgress
from pdserve.benchmarks.serve.workload import BenchRequest, arrival_offsets


@dataclass
class Run:
    """One run at one request rate: the settings and every request's result."""

    request_rate: float
    arrival: str
    max_concurrency: int | None
    results: list[RequestResult] = field(default_factory=list)

    @property
    def duration_s(self) -> float:
        return run_duration(self.results)

    def settings(self) -> dict:
        rate = None if math.isinf(self.request_rate) else self.request_rate
        return {"request_rate": rate, "arrival": self.arrival, "max_concurrency": self.max_concurrency}


async def run_load(backend, requests: list[BenchRequest], rate: float, arrival: str = "poisson",
                   max_concurrency: int | None = None, seed: int = 0,
                   desc: str = "bench serve") -> Run:
    offsets = arrival_offsets(len(requests), rate, arrival, seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    loop = asyncio.get_running_loop()
    progress = RunProgress(len(requests), desc)
    start = loop.time()

    async def one(req: BenchRequest, offset: float) -> RequestResult:
        await asyncio.sleep(max(0.0, start + offset - loop.time()))
        if limit is None:
            result = await backend.send(req)
        else:
            async with limit:
                result = await backend.send(req)
        progress.add(result.ok)
        return result

    try:
        results = await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets)))
    finally:
        progress.close()
    return Run(rate, arrival, max_concurrency, list(results))


async def warm_up(backend, requests: list[BenchRequest], count: int) -> None:
    """Send `count` requests one at a time (short outputs), outside any measurement, so
    one-time costs (connections, first-call allocations) stay out of the results. Their
    prompts must not be measured later, or prefix caches would serve those for free.
    Raises RuntimeError if one fails: a server that cannot answer one request is not
    worth measuring."""
    for req in requests[:count]:
        short = BenchRequest(req.prompt, req.prompt_len, min(req.output_len, 4))
        result = await backend.send(short)
        if not result.ok:
            raise RuntimeError(f"warm-up request failed: {result.error}")


async def sweep(backend, workload_for, rates: list[float], arrival: str = "poisson",
                max_concurrency: int | None = None, seed: int = 0, warmup: int = 1,
                label: str = "bench serve", on_run: Callable[[Run], None] | None = None
                ) -> list[Run]:
    """Warm up once, then one run per rate, one after the other (each drains before the
    next starts). `workload_for(key)` gives the requests: key "warmup", then the rate's
    index, so every run gets prompts of its own that no prefix cache has seen. `on_run`
    sees each run as it ends (a report that should not wait for the whole sweep)."""
    if warmup:
        await warm_up(backend, workload_for("warmup"), warmup)
    runs = []
    for i, rate in enumerate(rates):
        desc = f"{label} @ {rate:g} req/s" + (f", <= {max_concurrency} in flight" if max_concurrency else "")
        runs.append(await run_load(backend, workload_for(i), rate, arrival, max_concurrency,
                                   seed, desc))
        if on_run is not None:
            on_run(runs[-1])
    return runs
