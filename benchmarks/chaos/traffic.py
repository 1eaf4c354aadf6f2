"""The soak's clients: greedy requests with a deadline, as a closed loop (capacity), an open
Poisson loop (the soak), and one pass over the prompt set (the oracle).

Every request is greedy (`temperature=0`, `ignore_eos`, so its length is `max_tokens`) and
carries a client deadline; its `Outcome` records the status the client saw (`OK` or the
gRPC status name), its elapsed time on the client's clock, and the tokens it received.
A stream that ends without an error is *completed*, whatever it carried: a truncated one
then differs from the oracle and is counted as wrong, never as a failure.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import grpc

from pdserve.benchmarks.chaos.plan import Prompt
from pdserve.client import AsyncClient


@dataclass
class Outcome:
    request_id: str
    prompt_index: int
    sent_s: float              # seconds from the soak's start
    elapsed_s: float = 0.0     # client-side, call to last message or error
    status: str = "OK"         # "OK" or the gRPC status name
    detail: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    route: dict = field(default_factory=dict)  # where the router sent it (final message)

    @property
    def completed(self) -> bool:
        return self.status == "OK"


async def send(client: Client, prompt: Prompt, index: int, request_id: str, deadline_s: float,
               sent_s: float = 0.0) -> Outcome:
    """One greedy request; never raises for a failed call (its status is the outcome)."""
    out = Outcome(request_id, index, sent_s)
    start = time.monotonic()
    try:
        async for msg in client.responses(list(prompt.token_ids), request_id=request_id,
                                       timeout=deadline_s, temperature=0.0, ignore_eos=True,
                                       max_tokens=prompt.max_tokens):
            if msg.HasField("usage"):
                r = msg.usage.route
                out.route = {"prefill": r.prefill_endpoint, "decode": r.decode_endpoint,
                             "prefix_matched": r.prefix_matched_length,
                             "kv_window_end": r.kv_window_end, "skip_reason": r.skip_reason}
            elif msg.index == 0:
                out.token_ids.extend(msg.token_ids)
                out.finish_reason = msg.finish_reason or out.finish_reason
    except grpc.aio.AioRpcError as err:
        out.status, out.detail = err.code().name, (err.details() or "")[:300]
    except Exception as err:  # a client-side fault is still an outcome, not a crash
        out.status, out.detail = f"CLIENT_{type(err).__name__}", str(err)[:300]
    out.elapsed_s = time.monotonic() - start
    return out


async def oracle(address: str, prompts: list[Prompt], deadline_s: float,
                 concurrency: int = 4) -> list[list[int]]:
    """Each prompt's greedy output from a colocated (role `both`) node; raises RuntimeError
    if any request fails, since a soak without its oracle proves nothing."""
    limit = asyncio.Semaphore(concurrency)

    async def one(client: Client, i: int) -> Outcome:
        async with limit:
            return await send(client, prompts[i], i, f"oracle-{i}", deadline_s)

    async with AsyncClient(address) as client:
        outs = await asyncio.gather(*(one(client, i) for i in range(len(prompts))))
    failed = [o for o in outs if not o.completed]
    if failed:
        raise RuntimeError(f"the oracle failed {len(failed)} of {len(outs)} prompts; first: "
                           f"{failed[0].status} {failed[0].detail}")
    return [o.token_ids for o in outs]


async def capacity(address: str, prompts: list[Prompt], duration_s: float, concurrency: int,
                   deadline_s: float) -> tuple[float, list[Outcome]]:
    """Requests per second the undisturbed cluster completes with `concurrency` clients in a
    closed loop for about `duration_s` (in-flight ones finish), and their outcomes."""
    outcomes: list[Outcome] = []
    next_index = iter(range(10**9))  # bounded by the clock below
    start = time.monotonic()
    stop_at = start + duration_s

    async def worker(client: Client) -> None:
        while time.monotonic() < stop_at:
            n = next(next_index)
            outcomes.append(await send(client, prompts[n % len(prompts)], n % len(prompts),
                                       f"capacity-{n}", deadline_s))

    async with AsyncClient(address) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    elapsed = time.monotonic() - start
    done = sum(o.completed for o in outcomes)
    return done / elapsed, outcomes


def picks(num: int, num_prompts: int, seed: int) -> list[int]:
    """Which prompt each soak request sends: uniform, seeded, independent of arrivals."""
    rng = random.Random(f"pdserve-chaos-picks-{seed}")
    return [rng.randrange(num_prompts) for _ in range(num)]


async def open_loop(address: str, prompts: list[Prompt], arrivals: list[float], seed: int,
                    deadline_s: float, soak_start: float) -> list[Outcome]:
    """Send request i at `soak_start + arrivals[i]` (monotonic clock) whatever the earlier
    ones do, and gather every outcome (each ends by its deadline)."""
    chosen = picks(len(arrivals), len(prompts), seed)
    tasks: list[asyncio.Task] = []
    async with AsyncClient(address) as client:
        for i, (at, k) in enumerate(zip(arrivals, chosen)):
            await asyncio.sleep(max(0.0, soak_start + at - time.monotonic()))
            sent = time.monotonic() - soak_start
            tasks.append(asyncio.create_task(
                send(client, prompts[k], k, f"chaos-{i}", deadline_s, sent)))
        return list(await asyncio.gather(*tasks))
