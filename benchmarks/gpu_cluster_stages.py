"""The stages of the GPU cluster check (benchmarks/gpu_cluster.py says what each measures):
`exact`, `ttft` and `faults`, each a coroutine over a running `local_cluster.Cluster` that
returns its figures and `ok`."""

from __future__ import annotations

import asyncio
import random
import signal
import statistics
import uuid

from pdserve.benchmarks.local_cluster import (Cluster, bytes_per_token, frozen, is_full, load, open_gate, until,
                                     wait_full)

FIRST_ID = 17  # prompts are random ids above the tokenizer's special tokens
GATED = "gcf-"  # the exact cluster's prefill node stops these at its test gates
FREEZES = GATED + "sigstop-"  # ... and freezes after the first WRITE of these (runtime/gates.py)
GREEDY = dict(temperature=0.0, ignore_eos=True)


def random_ids(n: int, vocab: int, rng: random.Random) -> list[int]:
    return [rng.randrange(FIRST_ID, vocab) for _ in range(n)]


def route_of(out) -> dict:
    r = out.usage.route
    return {"prefill": r.prefill_endpoint, "skipped": r.remote_send_skipped, "skip_reason": r.skip_reason,
            "kv_window": [r.kv_window_begin, r.kv_window_end]}


def first_mismatch(got: list[int], want: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b),
                None if len(got) == len(want) else min(len(got), len(want)))


# ---- stage a: exact -----------------------------------------------------------------------
async def exact(cluster: Cluster, prompts: list[list[int]], expected: list[list[int]], n: int) -> dict:
    from pdserve.client import AsyncClient

    p, d = cluster.address("prefill"), cluster.address("decode")
    before = await load(p)
    async with AsyncClient(cluster.address("router")) as client:
        pd = await asyncio.gather(*(client.generate(ids, request_id=f"exact-{i}", max_tokens=n, **GREEDY)
                                    for i, ids in enumerate(prompts)))
        local = await asyncio.gather(*(client.generate(ids, request_id=f"exact-local-{i}", kv_window_end=0,
                                                       max_tokens=n, **GREEDY) for i, ids in enumerate(prompts)))
    after = await load(p)
    pools = await wait_full([p, d], timeout_s=20)
    per_token = bytes_per_token(after)
    requests = [{"prompt_tokens": len(ids), "matches": out.token_ids == want,
                 "local_matches": loc.token_ids == want, "first_mismatch": first_mismatch(out.token_ids, want),
                 "route": route_of(out)}
                for ids, want, out, loc in zip(prompts, expected, pd, local)]
    remote = all(r["route"]["prefill"] == p and not r["route"]["skipped"] for r in requests)
    sent = after.kv_bytes_sent_total - before.kv_bytes_sent_total
    windows = sum(e - b for b, e in (r["route"]["kv_window"] for r in requests))
    decode_report = await load(d)
    out = {"requests": requests, "matches": sum(r["matches"] for r in requests),
           "local_matches": sum(r["local_matches"] for r in requests), "of": len(requests),
           "remote": remote, "kv_bytes_sent": sent, "kv_bytes_expected": windows * per_token,
           "kv_bytes_per_token": per_token, "remote_sends": after.remote_sends_total - before.remote_sends_total,
           "pools": {"prefill": pools[0], "decode": pools[1]},
           "pool_devices": {"prefill": after.identity.layout.device,
                            "decode": decode_report.identity.layout.device}}
    out["ok"] = (out["matches"] == len(requests) and remote and sent == windows * per_token
                 and out["remote_sends"] == len(requests) and all(is_full(x) for x in pools))
    if out["matches"] < len(requests):
        out["diagnosis"] = ("the decode node's own prefill matches: the disaggregated path differs"
                            if out["local_matches"] == len(requests) else
                            "the decode node's own prefill differs too: kernel numerics, not the transfer")
    return out


# ---- stage b: time to first token ---------------------------------------------------------
async def _local_one(address: str, prompt: list[int]) -> dict:
    """The request `benchmarks.ttft._one` times, prefilled by the decode node itself."""
    from pdserve.client import AsyncClient

    loop, request_id = asyncio.get_running_loop(), uuid.uuid4().hex
    async with AsyncClient(address, timeout=600) as client:
        start, first, usage = loop.time(), None, None
        async for delta in client.stream(prompt, max_tokens=1, kv_window_end=0, request_id=request_id, **GREEDY):
            if first is None and delta.token_ids:
                first = loop.time()
            usage = delta.usage or usage
    if not usage.route.remote_send_skipped:
        raise RuntimeError("a kv_window_end=0 request used the prefill node")
    return {"ttft_s": first - start, "prefill_s": usage.prefill_time_s, "request_id": request_id}


async def ttft(cluster: Cluster, n: int, repeats: int, vocab: int) -> dict:
    from pdserve.benchmarks.ttft import _one

    router, rng = cluster.address("router"), random.Random(1)
    await _one(router, random_ids(n, vocab, rng))  # warm-up: connections, kernels, first steps
    await _local_one(router, random_ids(n, vocab, rng))
    pd, alone = [], []
    for _ in range(repeats):  # alternating, so drift hits both
        pd.append(await _one(router, random_ids(n, vocab, rng)))
        alone.append(await _local_one(router, random_ids(n, vocab, rng)))
    ttft_s = statistics.median(r["ttft_s"] for r in pd)
    alone_s = statistics.median(r["ttft_s"] for r in alone)
    usage_s = statistics.median(r["prefill_s"] for r in pd)
    exposed_s = statistics.median(r["ttft_s"] - r["prefill_s"] for r in pd)
    pools = await wait_full([cluster.address("prefill"), cluster.address("decode")], timeout_s=10)
    # How the prefill node sent each window: WRITEs and descriptors (its request log lines).
    sends = [r for r in cluster.request_records("prefill")
             if r.get("outcome") == "ok" and str(r.get("kv_window", "")).endswith(f":{n - 1}")][-repeats:]
    decodes, routed = cluster.request_records("decode"), cluster.request_records("router")
    parts = breakdown(sends, decodes, n, repeats, ttft_s, alone_s)
    parts["legs"] = legs(pd, routed, cluster.request_records("prefill"), decodes)
    parts["legs_alone"] = legs(alone, routed, [], decodes)
    return {"ok": all(is_full(x) for x in pools), "prompt_tokens": n, "repeats": repeats,
            "breakdown": parts,
            "kv_writes": statistics.median(r["kv_writes"] for r in sends) if sends else None,
            "kv_descriptors": statistics.median(r["kv_descriptors"] for r in sends) if sends else None,
            "ttft_s": ttft_s, "prefill_alone_s": alone_s, "transfer_added_fraction": (ttft_s - alone_s) / alone_s,
            "usage_prefill_s": usage_s, "usage_prefill_alone_s": statistics.median(r["prefill_s"] for r in alone),
            "exposed_s": exposed_s, "exposed_fraction": exposed_s / usage_s,
            "transfer_tail_s": statistics.median(r["tail_s"] for r in pd),
            "runs": {"disaggregated": pd, "prefill_alone": alone},
            "pools": {"prefill": pools[0], "decode": pools[1]}}


def breakdown(sends: list[dict], decodes: list[dict], n: int, repeats: int, ttft_s: float,
              alone_s: float) -> dict:
    """Where a disaggregated TTFT goes, from the nodes' request log lines (medians of the
    measured requests): the prefill node's RemoteSend (`p_prefill_s`, then `p_transfer_s`
    until its last WRITE and notification), the decode node's time from StartGeneration to
    its first token (`d_first_token_s`; `d_alone_s` for the whole prompt), and what is left
    of the client's TTFT (`rest_s`: gRPC trips, the router, the client; `rest_alone_s`)."""
    def median(rows, key):
        return statistics.median(r[key] for r in rows) if rows else None

    received = [r for r in decodes if r.get("prompt_tokens") == n and r.get("kv_expected")][-repeats:]
    local = [r for r in decodes if r.get("prompt_tokens") == n and r.get("kv_expected") is False][-repeats:]
    out = {"p_prefill_s": median(sends, "prefill_s"), "p_transfer_s": median(sends, "transfer_s"),
           "p_remote_send_s": median(sends, "remote_send_s"), "d_first_token_s": median(received, "ttft_s"),
           "d_alone_s": median(local, "ttft_s")}
    if out["p_remote_send_s"] is not None and out["d_first_token_s"] is not None:
        out["rest_s"] = ttft_s - out["p_remote_send_s"] - out["d_first_token_s"]
    if out["d_alone_s"] is not None:
        out["rest_alone_s"] = alone_s - out["d_alone_s"]
    return out


def legs(runs: list[dict], routed: list[dict], sends: list[dict], decodes: list[dict]) -> dict:
    """The path of each measured request's first token (`runs`: the client's TTFT and
    request id), leg by leg, from its lines in the three nodes' logs, joined by that id (as
    the client sent it: with tenants on, the nodes log `id@tenant` and nothing joins).
    Medians over the requests. A line is written as its call ends (`ts`), so the call began
    `e2e_s` (`remote_send_s`) before. `client_s`: the client's TTFT less the router's own
    (the connection, the trips to the router and back); `to_prefill_s` (`to_decode_s` for
    a prompt prefilled alone): from the router's receipt to the node's call; `prefill_s`:
    the prefill node's RemoteSend; `relay_s`: from its end to the decode node's
    StartGeneration (the reply, the router, the call); `first_token_s`: from there to its
    first token; `to_router_s`: that token's way to the router. Each request's legs add up
    to its TTFT exactly; their medians, roughly."""
    router, prefill, decode = ({r["request_id"]: r for r in rows} for rows in (routed, sends, decodes))
    rows = []
    for run in runs:
        r, p, d = router.get(run["request_id"]), prefill.get(run["request_id"]), decode.get(run["request_id"])
        if r is None or d is None or "ttft_s" not in r or "ttft_s" not in d:
            continue
        arrived, d_start = r["ts"] - r["e2e_s"], d["ts"] - d["e2e_s"]
        row = {"client_s": run["ttft_s"] - r["ttft_s"], "first_token_s": d["ttft_s"],
               "to_router_s": arrived + r["ttft_s"] - (d_start + d["ttft_s"])}
        if p is not None:
            row.update(to_prefill_s=p["ts"] - p["remote_send_s"] - arrived, prefill_s=p["remote_send_s"],
                       relay_s=d_start - p["ts"])
        elif not r.get("remote_send_skipped"):
            continue  # a RemoteSend whose line is missing
        else:
            row["to_decode_s"] = d_start - arrived
        rows.append(row)
    keys = [k for k in (rows[0] if rows else ()) if all(k in row for row in rows)]
    return {k: round(statistics.median(row[k] for row in rows), 6) for k in keys}


# ---- stage c: faults ----------------------------------------------------------------------
async def _frozen_mid_write(cluster: Cluster, client, request_id: str, prompt: list[int], n: int):
    """A request whose prefill node freezes after its window's first WRITE, and that node."""
    prefill = cluster.nodes["prefill"]
    await open_gate(cluster.address("prefill"), "prefill", request_id)
    task = asyncio.ensure_future(client.generate(prompt, request_id=request_id, max_tokens=n, **GREEDY))

    async def stopped():
        if task.done():
            task.result()  # raises what ended it; an answer means the node never froze
            raise RuntimeError(f"{request_id} was answered without its prefill node freezing")
        return frozen(prefill)

    await until(stopped, "the prefill node frozen mid-window", 60)
    return task


async def _remote_again(cluster: Cluster, client, vocab: int) -> None:
    """Wait until the router sends prompts to the prefill node again (it may have marked it
    unhealthy while it was frozen)."""
    rng = random.Random(2)

    async def remote():
        out = await client.generate(random_ids(40, vocab, rng), max_tokens=1, **GREEDY)
        return out.usage.route.prefill_endpoint == cluster.address("prefill")

    await until(remote, "a request through the prefill node", 20)


async def faults(cluster: Cluster, prompt: list[int], expected: list[int], vocab: int) -> dict:
    from pdserve.client import AsyncClient

    p, d = cluster.address("prefill"), cluster.address("decode")
    n = len(expected)
    out: dict = {}
    async with AsyncClient(cluster.address("router")) as client:
        await _remote_again(cluster, client, vocab)
        # (1) the client cancels while the KV is in flight
        task = await _frozen_mid_write(cluster, client, f"{FREEZES}cancel", prompt[::-1], n)
        parked = (await load(d)).num_parked
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Exception):
            pass
        # the router aborts the decode node's reservation: it waits in quarantine for proof
        quarantined = await until(lambda: _quarantined(d), "the reservation quarantined", 10)
        cluster.nodes["prefill"].send_signal(signal.SIGCONT)
        pools = await wait_full([p, d], timeout_s=20)
        out["cancel"] = {"ok": parked == 1 and quarantined == 1 and all(is_full(x) for x in pools),
                         "parked_while_frozen": parked, "quarantined_after_cancel": quarantined,
                         "pools": {"prefill": pools[0], "decode": pools[1]}}
        # (2) the prefill node dies while the KV is in flight
        await _remote_again(cluster, client, vocab)
        task = await _frozen_mid_write(cluster, client, f"{FREEZES}kill", prompt, n)
        cluster.nodes["prefill"].kill()
        answer = await task
        pools = await wait_full([d], timeout_s=20)
        out["kill"] = {"ok": answer.token_ids == expected and all(is_full(x) for x in pools),
                       "matches": answer.token_ids == expected,
                       "first_mismatch": first_mismatch(answer.token_ids, expected),
                       "route": route_of(answer), "pools": {"decode": pools[0]}}
    out["ok"] = out["cancel"]["ok"] and out["kill"]["ok"]
    return out


async def _quarantined(address: str) -> int:
    report = await load(address)
    return report.num_quarantined if report.num_parked == 0 else 0
