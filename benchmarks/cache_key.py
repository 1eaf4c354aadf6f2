"""``pdserve bench cache-key``: what a `prompt_cache_key` buys conversations whose turns
reach different routers, as behind a load balancer.

Two prefill and two decode nodes and two routers (each `prefix_aware` on both pools, the
best a router does alone) run on this host, the real model by default. `--conversations`
conversations each take `--turns` turns: a turn's prompt is the conversation so far (a
`--system-words` text unique to it, then every earlier question) plus a new question, and turn t of conversation c goes to router (c + t) % 2. The same turns without
a key are the baseline, measured in the same run: the modes alternate round by round (each
round a fresh set of conversations, so nothing is cached from the last), so drift hits
both. Every answer is greedy, `--max-tokens` long with `ignore_eos`.

Printed (as JSON with `--json`): per mode, the share of the later turns' prompt tokens
each found cached on its decode node (`route.prefix_matched_length`, what the decode node
need not receive or compute), how many of those turns went to the decode node of the
conversation's first turn, and the later turns' median time to first token (TTFT);
`ttft_ratio`, keyed over unkeyed (below 1 is what the key buys).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from pdserve import process_gc
from pdserve.benchmarks import served_bench
from pdserve.benchmarks.model_choice import resolve_or_exit
from pdserve.client import AsyncClient

MODES = ("unkeyed", "keyed")
WORDS = ("river", "stone", "light", "garden", "winter", "paper", "signal", "orbit", "copper", "meadow")


def _parse(argv):
    p = argparse.ArgumentParser(prog="pdserve bench cache-key", description=__doc__.split("\n\n")[0])
    served_bench.add_flags(p)
    p.add_argument("--conversations", type=int, default=4, help="conversations per round (default %(default)s)")
    p.add_argument("--turns", type=int, default=4, help="turns per conversation (default %(default)s)")
    p.add_argument("--system-words", type=int, default=300, help="words of each system text (default %(default)s)")
    p.add_argument("--question-words", type=int, default=20, help="words per question (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens each answer generates (default %(default)s)")
    p.add_argument("--rounds", type=int, default=2, help="rounds per mode (default %(default)s)")
    return p.parse_args(argv)


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)) + f" {rng.random():.6f}"


async def _turn(client: AsyncClient, prompt: str, key: str, max_tokens: int) -> dict:
    sent = time.perf_counter()
    first, usage = None, None
    async for delta in client.stream(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                     prompt_cache_key=key):
        first = first or time.perf_counter() - sent
        usage = delta.usage or usage
    return {"ttft_s": first, "prompt_tokens": usage.prompt_tokens,
            "decode_cached": usage.route.prefix_matched_length, "decode": usage.route.decode_endpoint}


async def _conversation(clients: list[AsyncClient], c: int, args, rng: random.Random, mode: str) -> list[dict]:
    conversation = _text(rng, args.system_words)
    key = f"conversation-{rng.random():.9f}" if mode == "keyed" else ""
    turns = []
    for t in range(args.turns):  # a plain text prompt: any checkpoint, with a chat template or none
        conversation += f"\nQ{t}: {_text(rng, args.question_words)}"
        turns.append(await _turn(clients[(c + t) % 2], conversation, key, args.max_tokens))
    return turns


def summary(rounds: dict[str, list[list[list[dict]]]]) -> dict:
    """Per mode: the later turns' cached share, their stickiness and median TTFT."""
    out = {}
    for mode in MODES:
        later = [(conv[0], turn) for rnd in rounds[mode] for conv in rnd for turn in conv[1:]]
        out[f"{mode}_decode_cached_share"] = sum(t["decode_cached"] for _, t in later) / \
            sum(t["prompt_tokens"] for _, t in later)
        out[f"{mode}_same_decode_share"] = sum(t["decode"] == first["decode"] for first, t in later) / len(later)
        out[f"{mode}_later_turn_ttft_s"] = statistics.median(t["ttft_s"] for _, t in later)
        out[f"{mode}_first_turn_ttft_s"] = statistics.median(conv[0]["ttft_s"] for rnd in rounds[mode] for conv in rnd)
    out["ttft_ratio"] = out["keyed_later_turn_ttft_s"] / out["unkeyed_later_turn_ttft_s"]
    return out


async def _measure(routers: list[str], args) -> dict[str, list]:
    rng = random.Random(0)
    rounds: dict[str, list] = {mode: [] for mode in MODES}
    async with AsyncClient(routers[0], timeout=600) as a, AsyncClient(routers[1], timeout=600) as b:
        for client in (a, b):
            await served_bench.first_answer(client, 300)
        for _ in range(args.rounds):
            for mode in MODES:  # conversations side by side, each turn after the last
                rounds[mode].append(await asyncio.gather(
                    *(_conversation([a, b], c, args, rng, mode) for c in range(args.conversations))))
    return rounds


def main(argv=None) -> int:
    from pdserve.procs import NodeProcess, free_port, stop_all

    args = _parse(argv)
    model = resolve_or_exit(args.model, "pdserve bench cache-key")
    worker = ["--model", model.dir, "--host", "127.0.0.1", "--dtype", args.dtype, "--num-threads", "1"]
    ports = {name: free_port() for name in ("p1", "p2", "d1", "d2")}
    nodes: list[NodeProcess] = []
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-cache-key-") as logs:
        try:
            for name, port in ports.items():
                role = "prefill" if name[0] == "p" else "decode"
                nodes.append(NodeProcess([role, *worker, "--port", str(port)], log=Path(logs) / f"{name}.log"))
            for node in nodes:  # loaded: the routers find every node up from their first health check
                node.wait_ready(300)
            pools = [f"--{role}={','.join(f'127.0.0.1:{ports[n]}' for n in names)}"
                     for role, names in (("prefill", ("p1", "p2")), ("decode", ("d1", "d2")))]
            routers = [NodeProcess(["router", "--model", model.dir, "--host", "127.0.0.1", "--port", "0", *pools,
                                    "--prefill-policy", "prefix_aware", "--decode-policy", "prefix_aware",
                                    "--health-interval-s", "0.3"], log=Path(logs) / f"r{i}.log") for i in (1, 2)]
            nodes += routers
            addresses = [r.wait_ready(300) for r in routers]
            rounds = asyncio.run(_measure(addresses, args))
        finally:
            stop_all(nodes)
    report = {"bench": "cache-key", "model": model.record(args.dtype), "routers": 2, "prefill_nodes": 2,
              "decode_nodes": 2, "policy": "prefix_aware", **{k: getattr(args, k) for k in (
                  "conversations", "turns", "system_words", "question_words", "max_tokens", "rounds")},
              **summary(rounds)}
    served_bench.emit(report, args, _readable)
    return 0


def _readable(r: dict) -> str:
    return "\n".join(f"{mode}: later turns found {r[f'{mode}_decode_cached_share']:.0%} of their prompt cached on "
                     f"their decode node, {r[f'{mode}_same_decode_share']:.0%} on their first turn's node, "
                     f"median TTFT {r[f'{mode}_later_turn_ttft_s']:.3f} s" for mode in MODES) + \
        f"\nlater turns' TTFT keyed over unkeyed: {r['ttft_ratio']:.2f}x"


if __name__ == "__main__":
    process_gc.own_process()
    sys.exit(main())
