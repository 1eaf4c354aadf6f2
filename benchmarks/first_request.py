"""`pdserve bench ttft --first-request`: is the first request after a node's ready line as
fast as the ones after it?

A cold `pdserve serve` node (its kernel cache empty, as on a fresh machine or container, so
everything is compiled at this start) is started and, once it prints its ready line, sent
`--repeats` requests one after another, each a fresh random prompt of the same length (no
prefix shared, nothing cached) with `max_tokens=1`. The client's time to first token of
each is printed as one JSON object: the first against the median of the rest, and the
node's ready line (which says whether its C kernels run). The node's start-up, compile
included, is the `ready_s` it took to print that line.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from pdserve.client import AsyncClient
from pdserve.models_cli import resolve_model
from pdserve.procs import NodeProcess


async def _ttft(address: str, prompt: list[int]) -> float:
    loop = asyncio.get_running_loop()
    async with AsyncClient(address, timeout=600) as client:
        start = loop.time()
        async for delta in client.stream(prompt, max_tokens=1, temperature=0.0, ignore_eos=True):
            if delta.token_ids:
                return loop.time() - start
    raise RuntimeError("the stream ended without a token")


def measure(a) -> dict:
    model_dir = resolve_model(a.model)  # fetched into the user's cache, not the empty one
    work = Path(tempfile.mkdtemp(prefix="pdserve-first-request-"))
    env = {**os.environ, "PDSERVE_CACHE": str(work / "cache")}  # no kernel built yet
    start = time.monotonic()
    node = NodeProcess(["serve", "--model", model_dir, "--dtype", a.dtype, "--num-threads", str(a.threads),
                        "--host", "127.0.0.1", "--port", "0", "--kv-cache-mb", str(a.kv_cache_mb)],
                       log=work / "serve.log", env=env)
    try:
        node.wait_ready(600)
        ready_s = time.monotonic() - start
        rng = random.Random(0)
        vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
        ttfts = [asyncio.run(_ttft(node.address, [rng.randrange(vocab) for _ in range(a.prompt_tokens)]))
                 for _ in range(a.repeats)]
    finally:
        node.stop()
    later = statistics.median(ttfts[1:])
    return {"model": a.model, "dtype": a.dtype, "threads": a.threads, "prompt_tokens": a.prompt_tokens,
            "ready_line": node.ready_line, "ready_s": round(ready_s, 3), "first_ttft_s": round(ttfts[0], 4),
            "second_ttft_s": round(ttfts[1], 4), "later_median_ttft_s": round(later, 4),
            "first_over_later": round(ttfts[0] / later, 3), "ttfts_s": [round(t, 4) for t in ttfts],
            "log": str(work / "serve.log")}


def main(a) -> int:
    """`a`: the parsed flags of `pdserve bench ttft` (--model, --dtype, --threads,
    --kv-cache-mb, --first-request-prompt; --repeats, at least 5 here)."""
    a.prompt_tokens = a.first_request_prompt
    a.repeats = max(a.repeats, 5)
    print(json.dumps(measure(a)), flush=True)
    return 0
