"""``pdserve bench ttft``: time to first token with whole-window and layer-wise KV sends.

For each prompt length, on the real model (default SmolLM2-135M-Instruct in bfloat16):
the prefill time alone, the time to first token through router + prefill + decode with
`--kv-send whole` and with `--kv-send layerwise`, and the transfer time each leaves
exposed (TTFT minus the prefill alone). With `--link RATE[,DELAY]` the prefill nodes run
in one network namespace and the decode node and routers in another, joined by a veth
shaped by tc (benchmarks/link.py), and NIXL's UCX moves the KV over TCP across it; without
it, everything runs on this host and the KV moves through shared memory.

Layout: two prefill nodes (one per mode) on host A, one decode node and two routers (one
per prefill node) on host B; the client reaches the routers through a relay. Each
measurement is one streamed request of a fresh random prompt (no prefix shared with any
other, so nothing is cached) and `max_tokens=1`; the modes alternate, so drift hits both.
`prefill_s` is the median prefill time the whole-window runs report (`usage.prefill_time_s`:
the prefill node's engine time plus the decode node's last position), measured while no
transfer runs beside it; TTFT is the client's, from sending to the first token. A mode's
exposed time is the median over its requests of TTFT minus that request's own prefill time:
a prefill of thousands of tokens varies by more than the transfer it hides, so subtracting
another request's would measure noise. What layer-wise sends cost the prefill itself (CPU
for the sends beside it) shows in `ttft_layerwise_s` against `ttft_whole_s`. With `--busy N`,
N other requests of the same length keep the nodes busy while each measured one runs: its
exposed time then also holds whatever waits for another request's step after its prefill.

`--first-request` measures something else: a cold node's first request after its ready
line against the next ones (benchmarks/first_request.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import uuid
from pathlib import Path

from pdserve import process_gc
from pdserve.benchmarks.link import Link, parse_link, rate_bits
from pdserve.client import AsyncClient
from pdserve.procs import NodeProcess, stop_all

MODES = ("whole", "layerwise")


def _parse(argv):
    p = argparse.ArgumentParser(prog="pdserve bench ttft", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="model directory or known name")
    p.add_argument("--dtype", default="bfloat16", help="model dtype (default bfloat16)")
    p.add_argument("--prompts", default="512,1024,2048,4096,8191",
                   help="prompt lengths in tokens, comma-separated (default 512,1024,2048,4096,8191)")
    p.add_argument("--link", default=None, metavar="RATE[,DELAY]",
                   help="put prefill and decode on two hosts joined by this link (e.g. 1gbit, 10gbit); "
                        "default: one host, shared memory")
    p.add_argument("--kv-send", choices=(*MODES, "both"), default="both", help="modes to measure (default both)")
    p.add_argument("--repeats", type=int, default=2, help="requests per length and mode (default 2; medians)")
    p.add_argument("--threads", type=int, default=2, help="threads of each node's engine (default 2)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="the prefill nodes' step budget (default: the engine's)")
    p.add_argument("--busy", type=int, default=0,
                   help="other requests of the same length that keep the nodes busy while each measured "
                        "one runs (each followed by another until it ends; default 0)")
    p.add_argument("--kv-cache-mb", type=int, default=1024, help="KV cache of each node (default 1024)")
    p.add_argument("--kv-layout", choices=("page-major", "layer-major"), default="page-major",
                   help="memory order of every node's KV pool (default page-major)")
    p.add_argument("--log-dir", default=None, help="node logs (default: a temporary directory)")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt length")
    p.add_argument("--first-request", action="store_true",
                   help="instead: a cold `serve` node's first request after its ready line against "
                        "the next ones, one JSON object (benchmarks/first_request.py)")
    p.add_argument("--first-request-prompt", type=int, default=128,
                   help="prompt tokens of each --first-request request (default 128)")
    return p.parse_args(argv)


class Nodes:
    """Prefill nodes on host A, decode node and routers on host B (one host without a link)."""

    def __init__(self, a, link: Link | None, logs: Path, modes: list[str]) -> None:
        self.link, self.modes, self.nodes = link, modes, []
        self.a, self.b = link.hosts if link is not None else (None, None)
        common = ["--model", a.model]
        worker = [*common, "--dtype", a.dtype, "--num-threads", str(a.threads), "--kv-cache-mb", str(a.kv_cache_mb),
                  "--kv-layout", a.kv_layout]
        budget = ["--max-num-batched-tokens", str(a.max_num_batched_tokens)] if a.max_num_batched_tokens else []
        # A prefill of 8k tokens takes longer than the default lease: leases and deadlines of minutes.
        prefills = {m: self._start(self.a, f"prefill-{m}", ["prefill", *worker, *budget, "--kv-send", m,
                                                             "--transfer-timeout-s", "600"], logs)
                    for m in modes}
        decode = self._start(self.b, "decode", ["decode", *worker], logs)
        for node in (*prefills.values(), decode):
            node.wait_ready(600)
        self.routers = {}
        for m in modes:
            router = self._start(self.b, f"router-{m}", ["router", *common, "--prefill", prefills[m].address,
                                                         "--decode", decode.address, "--lease-ms", "120000"], logs)
            router.wait_ready(120)
            port = link.forward(self.b, router.port) if link is not None else router.port
            self.routers[m] = f"127.0.0.1:{port}"

    def _start(self, host, name: str, args: list[str], logs: Path) -> NodeProcess:
        env = {**os.environ, **(host.ucx_env() if host is not None else {})}
        address = host.address if host is not None else "127.0.0.1"
        node = NodeProcess([*args, "--host", address, "--port", "0"], log=logs / f"{name}.log", env=env,
                           netns=host.ns if host is not None else None)
        self.nodes.append(node)
        return node

    def stop(self) -> None:
        stop_all(self.nodes[::-1])


async def _one(address: str, prompt: list[int]) -> dict:
    loop, request_id = asyncio.get_running_loop(), uuid.uuid4().hex  # the nodes log it
    async with AsyncClient(address, timeout=600) as client:
        start, first, usage = loop.time(), None, None
        async for delta in client.stream(prompt, max_tokens=1, temperature=0.0, ignore_eos=True,
                                         request_id=request_id):
            if first is None and delta.token_ids:
                first = loop.time()
            usage = delta.usage or usage
    route = usage.route
    if route.remote_send_skipped or route.kv_window_end <= route.kv_window_begin:
        raise RuntimeError(f"the prefill node did not send this prompt's KV ({route.skip_reason or 'skipped'})")
    return {"ttft_s": first - start, "prefill_s": usage.prefill_time_s, "tail_s": usage.kv_transfer_time_s,
            "request_id": request_id}


def _prompt(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(200, 40000) for _ in range(n)]


async def _beside(address: str, prompt: list[int], others: int, rng: random.Random) -> dict:
    """`_one(prompt)` while `others` requests of its length keep the nodes busy, with fresh
    prompts from `rng` (the run's: a prompt seen before would be a prefix-cache hit): the
    prefill node is then in another request's step when this one's KV has landed."""
    done = False

    async def keep_busy():
        while not done:
            await _one(address, _prompt(len(prompt), rng))

    busy = [asyncio.ensure_future(keep_busy()) for _ in range(others)]
    try:
        return await _one(address, prompt)
    finally:
        done = True
        await asyncio.gather(*busy)


def measure(nodes: Nodes, lengths: list[int], repeats: int, link_gbit: float | None, emit,
            busy: int = 0) -> list[dict]:
    rng = random.Random(0)
    rows = []
    for mode in nodes.modes:  # warm-up: connections, first-step costs
        asyncio.run(_one(nodes.routers[mode], _prompt(64, rng)))
    for n in lengths:
        runs = {m: [] for m in nodes.modes}
        for _ in range(repeats):
            for mode in nodes.modes:
                runs[mode].append(asyncio.run(_beside(nodes.routers[mode], _prompt(n, rng), busy, rng)))
        row = {"prompt_tokens": n, "link_gbit": link_gbit, "busy": busy}
        alone = runs.get("whole") or runs["layerwise"]
        row["prefill_s"] = statistics.median(r["prefill_s"] for r in alone)
        for mode in MODES:
            got = runs.get(mode)
            ttft = statistics.median(r["ttft_s"] for r in got) if got else None
            row[f"ttft_{mode}_s"] = ttft
            row[f"exposed_{mode}_s"] = statistics.median(r["ttft_s"] - r["prefill_s"] for r in got) if got else None
            row[f"transfer_tail_{mode}_s"] = statistics.median(r["tail_s"] for r in got) if got else None
        whole, layer = row["exposed_whole_s"], row["exposed_layerwise_s"]
        row["exposed_ratio"] = layer / whole if whole and layer is not None else None
        rows.append(row)
        emit(row)
    return rows


def main(argv=None) -> int:
    a = _parse(argv)
    if a.first_request:
        from pdserve.benchmarks import first_request

        return first_request.main(a)
    lengths = [int(x) for x in a.prompts.split(",") if x.strip()]
    modes = list(MODES) if a.kv_send == "both" else [a.kv_send]
    rate, delay_ms = parse_link(a.link) if a.link else (None, 0.0)
    link_gbit = rate_bits(rate) / 1e9 if rate else None
    logs = Path(a.log_dir or tempfile.mkdtemp(prefix="pdserve-ttft-"))
    logs.mkdir(parents=True, exist_ok=True)

    def emit(row):
        row["kv_layout"] = a.kv_layout
        if a.json:
            print(json.dumps(row), flush=True)
        else:
            cells = [f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()]
            print("  ".join(cells), flush=True)

    with (Link(rate, delay_ms) if rate else contextlib.nullcontext()) as link:
        nodes = Nodes(a, link, logs, modes)
        try:
            measure(nodes, lengths, a.repeats, link_gbit, emit, a.busy)
        finally:
            nodes.stop()
    if not a.json:
        print(f"node logs: {logs}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    process_gc.own_process()
    sys.exit(main())
