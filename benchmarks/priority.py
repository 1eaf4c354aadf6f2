"""``pdserve bench priority``: what a request's `priority` buys its requests under load.

Router + prefill + decode run on this host (the real model by default), the router
dispatching `--max-concurrent` requests at once, so the rest wait in its line; or, with
`--decode-pages N` and a `--max-concurrent` above what N pages hold, in the decode node's
line for KV pages, where a better priority preempts worse running requests. A burst of
`--background` requests (priority 1) is sent, and right behind it `--foreground` ones
(priority 0: the interactive kind). The same burst with every request at priority 0, first
come first served, is the baseline, measured in the same run: the modes alternate, round
after round, so drift hits both. Every request is greedy with `ignore_eos` and the same
`--max-tokens`, and its prompt is new (no prefix cached), so both modes do the same work.

Printed (as JSON with `--json`): each class's median time to first token (TTFT) and to its last token, per
mode, and the decode node's preemptions (its `pdserve_preemptions`) over each mode's bursts; `foreground_ttft_ratio`, the foreground's TTFT with priority over without (below 1 is
what priority buys it); `background_ttft_ratio` (what the background pays); and
`makespan_ratio`, the whole burst's time with over without (about 1: priority reorders the
line, it adds no work).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from pdserve import process_gc
from pdserve.benchmarks import served_bench
from pdserve.benchmarks.model_choice import resolve_or_exit
from pdserve.client import AsyncClient

MODES = ("fifo", "priority")
WORDS = ("river", "stone", "light", "garden", "winter", "paper", "signal", "orbit", "copper", "meadow")


def _parse(argv):
    p = argparse.ArgumentParser(prog="pdserve bench priority", description=__doc__.split("\n\n")[0])
    served_bench.add_flags(p)
    p.add_argument("--max-concurrent", type=int, default=2,
                   help="the router's --max-concurrent-requests (default %(default)s)")
    p.add_argument("--decode-pages", type=int, default=None,
                   help="the decode node's --num-pages (default: as its memory allows)")
    p.add_argument("--background", type=int, default=8, help="priority 1 requests per burst (default %(default)s)")
    p.add_argument("--foreground", type=int, default=2,
                   help="priority 0 requests per burst, sent after the background (default %(default)s)")
    p.add_argument("--prompt-words", type=int, default=64, help="words per prompt (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens each request generates (default %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="bursts per mode (default %(default)s)")
    return p.parse_args(argv)


async def _one(client: AsyncClient, prompt: str, priority: int, max_tokens: int) -> dict:
    sent = time.perf_counter()
    first = None
    async for _ in client.stream(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                 priority=priority):
        first = first or time.perf_counter() - sent
    return {"ttft_s": first, "done_s": time.perf_counter() - sent}


def _preemptions(metrics_url: str) -> float:
    """The decode node's `pdserve_preemptions` (its /metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(metrics_url, timeout=30) as reply:
        text = reply.read().decode()
    return next((s.value for family in text_string_to_metric_families(text) for s in family.samples
                 if s.name == "pdserve_preemptions" and s.labels.get("role") == "decode"), 0.0)


async def _burst(client: AsyncClient, args, rng: random.Random, mode: str) -> dict:
    """One burst: the background requests, then the foreground ones once the router holds
    them all (a gap of a few milliseconds puts them in line in that order)."""
    def prompt() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(args.prompt_words)) + f" {rng.random()}"

    started = time.perf_counter()
    background = [asyncio.ensure_future(_one(client, prompt(), 1 if mode == "priority" else 0, args.max_tokens))
                  for _ in range(args.background)]
    await asyncio.sleep(0.05)
    foreground = [asyncio.ensure_future(_one(client, prompt(), 0, args.max_tokens))
                  for _ in range(args.foreground)]
    results = await asyncio.gather(*background, *foreground)
    return {"makespan_s": time.perf_counter() - started, "background": results[:args.background],
            "foreground": results[args.background:]}


def _median(bursts: list[dict], kind: str, key: str) -> float:
    return statistics.median(r[key] for b in bursts for r in b[kind])


def summary(bursts: dict[str, list[dict]]) -> dict:
    """Each class's medians per mode and the ratios the docstring names."""
    out = {}
    for mode in MODES:
        for kind in ("foreground", "background"):
            out[f"{mode}_{kind}_ttft_s"] = _median(bursts[mode], kind, "ttft_s")
            out[f"{mode}_{kind}_done_s"] = _median(bursts[mode], kind, "done_s")
        out[f"{mode}_makespan_s"] = statistics.median(b["makespan_s"] for b in bursts[mode])
        out[f"{mode}_decode_preemptions"] = sum(b["preemptions"] for b in bursts[mode])
    for kind in ("foreground", "background"):
        out[f"{kind}_ttft_ratio"] = out[f"priority_{kind}_ttft_s"] / out[f"fifo_{kind}_ttft_s"]
    out["makespan_ratio"] = out["priority_makespan_s"] / out["fifo_makespan_s"]
    return out


async def _measure(address: str, metrics_url: str, args) -> dict[str, list[dict]]:
    rng = random.Random(0)
    bursts: dict[str, list[dict]] = {mode: [] for mode in MODES}
    async with AsyncClient(address, timeout=600) as client:
        await served_bench.first_answer(client, 300)
        for _ in range(args.rounds):
            for mode in MODES:
                before = await asyncio.to_thread(_preemptions, metrics_url)
                burst = await _burst(client, args, rng, mode)
                burst["preemptions"] = await asyncio.to_thread(_preemptions, metrics_url) - before
                bursts[mode].append(burst)
    return bursts


def main(argv=None) -> int:
    from pdserve.benchmarks.local_cluster import Cluster, stop
    from pdserve.procs import free_port

    args = _parse(argv)
    model = resolve_or_exit(args.model, "pdserve bench priority")
    metrics_port = free_port()
    pool = [] if args.decode_pages is None else ["--num-pages", str(args.decode_pages)]
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-priority-") as logs:
        cluster = Cluster("priority", model.dir, ["--dtype", args.dtype, "--num-threads", "1"], Path(logs),
                          router_flags=["--max-concurrent-requests", str(args.max_concurrent)],
                          decode_flags=[*pool, "--metrics-port", str(metrics_port)])
        try:
            cluster.start().wait(time.monotonic() + 300)
            bursts = asyncio.run(_measure(cluster.address("router"), f"http://127.0.0.1:{metrics_port}/metrics",
                                          args))
        finally:
            stop([cluster])
    report = {"bench": "priority", "model": model.record(args.dtype), "max_concurrent": args.max_concurrent,
              "decode_pages": args.decode_pages,
              "background": args.background, "foreground": args.foreground, "prompt_words": args.prompt_words,
              "max_tokens": args.max_tokens, "rounds": args.rounds, **summary(bursts)}
    served_bench.emit(report, args, _readable)
    return 0


def _readable(r: dict) -> str:
    rows = [("foreground (priority 0) TTFT", "foreground_ttft_s", "foreground_ttft_ratio"),
            ("background (priority 1) TTFT", "background_ttft_s", "background_ttft_ratio"),
            ("whole burst", "makespan_s", "makespan_ratio")]
    return "\n".join([*(f"{name}: {r['fifo_' + key]:.2f} s first come first served, {r['priority_' + key]:.2f} s "
                         f"with priority ({r[ratio]:.2f}x)" for name, key, ratio in rows),
                      f"decode node preemptions: {r['fifo_decode_preemptions']:.0f} first come first served, "
                      f"{r['priority_decode_preemptions']:.0f} with priority"])


if __name__ == "__main__":
    process_gc.own_process()
    sys.exit(main())
