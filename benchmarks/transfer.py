"""``pdserve bench transfer``: KV window transfer vs raw NIXL vs local memcpy.

Two real processes: this one (the sender, like a prefill node) and a spawned receiver
(like a decode node), each with a KV pool and a ``TransferAgent``. Each repetition times,
over the same number of bytes: a local ``memcpy`` (one thread), a raw NIXL WRITE of one
contiguous descriptor, and the KV window written through ``plan_transfer`` between
fragmented page lists. Pools are page-major by default (``--layout``), the layout the
engine is moving to: a run of consecutive pages is then one descriptor over all layers.
``efficiency = kv_gbps / raw_nixl_gbps``; the raw and KV writes go
through the same ``TransferAgent.write`` (notification included) and alternate, so load
from other processes on the machine hits both alike. Medians are reported.
With ``--link RATE[,DELAY]`` sender and receiver run on two hosts joined by a shaped link
and NIXL uses TCP over it (``transfer_link.py``), instead of shared memory on one host.
With ``--tp A:B`` both are tensor-parallel nodes, one pool per rank (``transfer_tp.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

from pdserve import process_gc
from pdserve.benchmarks import transfer_tp as tp
from pdserve.kvtransfer.agent import PROGRESS_DELAY_US
from pdserve.kvtransfer.layout import LAYOUT_KINDS, PAGE_MAJOR
from pdserve.kvtransfer.plan import TransferPlan, plan_transfer

DTYPES = ("float32", "float16", "bfloat16")


def fragmented_pages(num_pages: int, fragmentation: float, rng: np.random.Generator) -> tuple[list[int], int]:
    """Page ids (token order) for ``num_pages`` pages, and the pool size they need.

    ``fragmentation`` is the share of page boundaries that are breaks: the page after a
    break is not the next page in the pool. The pages form runs, placed in random order
    with a free page between neighbours, so every break is a real discontinuity.
    """
    if not 0.0 <= fragmentation <= 1.0:
        raise ValueError(f"fragmentation must be in [0, 1], got {fragmentation}")
    if num_pages <= 0:
        return [], 0
    k = round(fragmentation * (num_pages - 1))
    breaks = np.sort(rng.choice(np.arange(1, num_pages), size=k, replace=False)) if k else np.zeros(0, np.int64)
    bounds = np.concatenate(([0], breaks, [num_pages]))
    runs = [(int(a), int(b - a)) for a, b in zip(bounds[:-1], bounds[1:])]  # (first token page, length)
    order = rng.permutation(len(runs))
    pages = np.empty(num_pages, dtype=np.int64)
    cursor = 0
    for i in order:
        first, length = runs[i]
        pages[first : first + length] = np.arange(cursor, cursor + length)
        cursor += length + 1  # the free page keeps this run from touching the next one
    return pages.tolist(), cursor


def pages_to_slots(pages: list[int], page_size: int, tokens: int) -> list[int]:
    arr = np.asarray(pages, dtype=np.int64)[:, None] * page_size + np.arange(page_size)
    return arr.reshape(-1)[:tokens].tolist()


def _fill_pattern(pool: Any, salt: int = 0) -> None:
    """Distinct cheap contents per word, a block of the first dimension (a layer or a page)
    at a time (random fill of GiBs is slow); ``salt`` keeps equal-shaped pools apart."""
    import torch

    words = pool.view(torch.uint8).view(pool.shape[0], -1).view(torch.int32)
    for block in range(words.shape[0]):
        torch.arange(words.shape[1], dtype=torch.int32, out=words[block])
        words[block].mul_(-1640531535).add_(block * 97 + 1 + salt * 7919)


def _link_arg(text: str) -> tuple[str, float]:
    from pdserve.benchmarks.link import parse_link

    try:
        return parse_link(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve bench transfer", description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="tokens in the KV window (default 4096)")
    p.add_argument("--page-size", type=int, default=16, help="sender page size in slots (default 16)")
    p.add_argument("--dst-page-size", type=int, default=None, help="receiver page size (default: --page-size)")
    p.add_argument("--layers", type=int, default=32, help="model layers (default 32)")
    p.add_argument("--kv-heads", type=int, default=8, help="KV heads (default 8)")
    p.add_argument("--head-dim", type=int, default=128, help="head dimension (default 128)")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="KV dtype (default bfloat16)")
    p.add_argument("--layout", choices=LAYOUT_KINDS, default=PAGE_MAJOR,
                   help="sender KV pool layout: page-major [pages, layers, 2, page_size, heads, dim] or "
                        "layer-major [layers, 2, slots, heads, dim] (default page-major)")
    p.add_argument("--dst-layout", choices=LAYOUT_KINDS, default=None,
                   help="receiver KV pool layout (default: --layout)")
    p.add_argument("--fragmentation", type=float, default=0.5,
                   help="share of pages allocated non-consecutively, 0..1, on each side (default 0.5)")
    p.add_argument("--repeats", type=int, default=7, help="timed repetitions (default 7; medians reported)")
    p.add_argument("--seed", type=int, default=0, help="seed of the page allocation (default 0)")
    p.add_argument("--progress-thread", action="store_true",
                   help="use NIXL's UCX progress thread instead of the agent's own slow poller")
    p.add_argument("--progress-delay-us", type=int, default=PROGRESS_DELAY_US,
                   help="NIXL progress thread poll delay (pthrDelay) in microseconds (default "
                        f"{PROGRESS_DELAY_US}, a decode node's)")
    p.add_argument("--receiver-poll-ms", type=float, default=None,
                   help="poll the receiver agent itself at this interval in ms instead of NIXL's progress "
                        "thread (a decode node's agent); over TCP (--link) the receiver's progress paces "
                        "the transfer")
    p.add_argument("--ucx-param", action="append", default=[], metavar="KEY=VALUE",
                   help="NIXL UCX backend parameter for both agents (repeatable), e.g. num_threads=2")
    p.add_argument("--raw-chunks", type=int, default=1,
                   help="split the raw contiguous transfer into N equal descriptors (default 1); "
                        "with --ucx-param num_threads=N this gives raw the same parallelism as the KV plan")
    p.add_argument("--huge-pages", action="store_true",
                   help="allocate both pools page-aligned with MADV_HUGEPAGE (transparent huge pages)")
    p.add_argument("--timeout", type=float, default=60.0, help="per-transfer timeout in seconds (default 60)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("--link", type=_link_arg, default=None, metavar="RATE[,DELAY]",
                   help="run sender and receiver in two network namespaces joined by a veth shaped "
                        "to RATE (tc units: 200mbit, 1gbit, 25gbit) with an optional DELAY (1ms, 500us); "
                        "NIXL then uses TCP over it (needs root, ip and tc); see --receiver-poll-ms")
    p.add_argument("--receiver-netns", default=None, help=argparse.SUPPRESS)  # set by --link's sender
    p.add_argument("--plot", metavar="FILE.png", default=None,
                   help="also sweep window sizes and plot bandwidth against transfer size")
    p.add_argument("--tp", type=tp.parse_tp, default=None, metavar="A:B",
                   help="sender with A tensor-parallel ranks, receiver with B, one KV pool per rank "
                        "holding its share of the heads; adds tp, expected_bytes and per_rank to the "
                        "result (default: one pool a side, as without tensor parallelism)")
    a = p.parse_args(argv)
    if a.dst_page_size is None:
        a.dst_page_size = a.page_size
    if a.dst_layout is None:
        a.dst_layout = a.layout
    for name in ("tokens", "page_size", "dst_page_size", "layers", "kv_heads", "head_dim", "repeats", "raw_chunks"):
        if getattr(a, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(a, name)}")
    try:
        a.backend_params = dict(kv.split("=", 1) for kv in a.ucx_param)
    except ValueError:
        p.error(f"--ucx-param takes KEY=VALUE, got {a.ucx_param}")
    if a.receiver_poll_ms is not None and a.receiver_poll_ms <= 0:
        p.error(f"--receiver-poll-ms must be positive, got {a.receiver_poll_ms}")
    if not 0.0 <= a.fragmentation <= 1.0:
        p.error(f"--fragmentation must be in [0, 1], got {a.fragmentation}")
    if a.tp is not None and (problem := tp.tp_problem(a.tp, a.kv_heads)):
        p.error(problem)
    return a


class _Session:
    """The sender's pools and agent plus a receiver process, sized for the largest window."""

    def __init__(self, a: argparse.Namespace, max_tokens: int) -> None:

        from pdserve.kvtransfer.agent import TransferAgent
        from pdserve.benchmarks.kv_receiver import PoolSpec, ReceiverProcess

        self.a = a
        rng = np.random.default_rng(a.seed)
        self.src_pages, src_need = fragmented_pages(math.ceil(max_tokens / a.page_size), a.fragmentation, rng)
        self.dst_pages, dst_need = fragmented_pages(math.ceil(max_tokens / a.dst_page_size), a.fragmentation, rng)
        dst_spec = PoolSpec(a.layers, a.kv_heads, a.head_dim, a.dst_page_size, max(dst_need, 1), a.dtype,
                            a.dst_layout)
        ucx_env = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}  # --link: TCP on pd0
        # The receiver's agent is a decode node's (worker/app.py): NIXL's progress thread,
        # unless --receiver-poll-ms asks for the agent's own poll at that interval.
        receiver_kwargs = {**self.agent_kwargs(a), "progress_thread": a.receiver_poll_ms is None} \
            if a.receiver_poll_ms is None else {**self.agent_kwargs(a), "poll_interval_s": a.receiver_poll_ms / 1e3}
        self.receiver = ReceiverProcess("bench-decode", dst_spec, huge_pages=a.huge_pages, netns=a.receiver_netns,
                                        env=ucx_env, ranks=(a.tp or (1, 1))[1], **receiver_kwargs)
        try:
            self.pools, self.shards = tp.sender_pools(a, max_tokens, src_need)
            for rank, pool in enumerate(self.pools):
                _fill_pattern(pool, rank)
            memory = self.pools[0] if len(self.pools) == 1 else self.shards.regions()  # one agent, every pool
            self.agent = TransferAgent("bench-prefill", memory, **self.agent_kwargs(a))
            self.remote = self.agent.add_remote(self.receiver.metadata)
        except BaseException:
            self.receiver.close()
            raise
        self.seq = 0

    @staticmethod
    def agent_kwargs(a: argparse.Namespace) -> dict[str, Any]:
        return {"progress_thread": a.progress_thread, "progress_delay_us": a.progress_delay_us,
                "backend_params": a.backend_params}

    def plan(self, tokens: int) -> tuple[TransferPlan, list[int], list[int], float]:
        src_slots = pages_to_slots(self.src_pages, self.a.page_size, tokens)
        dst_slots = pages_to_slots(self.dst_pages, self.a.dst_page_size, tokens)
        t = time.perf_counter()
        plan = plan_transfer(tp.as_side(self.shards), src_slots, tp.as_side(self.receiver.shards), dst_slots)
        return plan, src_slots, dst_slots, time.perf_counter() - t

    def write(self, descs: Any) -> float:
        self.seq += 1
        tag = f"bench-{self.seq}".encode()
        t = time.perf_counter()
        self.agent.write(self.remote, descs, tag, timeout_s=self.a.timeout)
        return time.perf_counter() - t

    def memcpy(self, sent: list[int]) -> float:
        """Each sender pool copies the bytes it sends within itself, one pool after another."""
        import torch

        spans = [(raw[:n], raw[n : 2 * n]) for pool, n in zip(self.pools, sent)
                 for raw in [pool.view(torch.uint8).view(-1)] if n]
        t = time.perf_counter()
        for src, dst in spans:
            dst.copy_(src)
        return time.perf_counter() - t

    def measure(self, tokens: int, repeats: int, bar: Any) -> dict[str, Any]:
        plan, src_slots, dst_slots, plan_s = self.plan(tokens)
        nbytes = plan.total_bytes
        checked = tp.check_window(plan, self.shards, src_slots, self.receiver.shards, dst_slots) if self.a.tp else 0
        pairs = tp.pair_bytes(plan, self.shards, self.receiver.shards)
        raw = tp.raw_descriptors(pairs, self.shards, self.receiver.shards, self.a.raw_chunks)
        self.write(raw)  # warm-up: connection setup and first touch on both sides
        self.write(plan)
        times: dict[str, list[float]] = {"memcpy": [], "raw": [], "kv": []}
        for r in range(repeats):
            times["memcpy"].append(self.memcpy(pairs.sum(axis=1).tolist()))
            # alternate which goes first so drifting background load hits both alike
            for kind in (("raw", "kv") if r % 2 == 0 else ("kv", "raw")):
                times[kind].append(self.write(raw if kind == "raw" else plan))
            bar.update(1)
        verified = self.verify(plan, src_slots, dst_slots)
        med = {k: statistics.median(v) for k, v in times.items()}
        gbps = {k: nbytes / v / 1e9 for k, v in med.items()}
        extra = tp.tp_fields(self.a, plan, self.shards, self.receiver.shards, med["kv"], checked) if self.a.tp else {}
        return {
            "tokens": tokens,
            "bytes": nbytes,
            "descriptors": plan.num_descriptors,
            "slot_runs": plan.num_runs,
            "avg_descriptor_bytes": nbytes // max(plan.num_descriptors, 1),
            "kv_gbps": round(gbps["kv"], 6),
            "raw_nixl_gbps": round(gbps["raw"], 6),
            "memcpy_gbps": round(gbps["memcpy"], 6),
            "efficiency": round(gbps["kv"] / gbps["raw"], 4),
            "kv_gbps_best": round(nbytes / min(times["kv"]) / 1e9, 3),
            "raw_nixl_gbps_best": round(nbytes / min(times["raw"]) / 1e9, 3),
            "efficiency_paired_median": round(
                statistics.median(r / k for r, k in zip(times["raw"], times["kv"])), 3
            ),
            "plan_seconds": round(plan_s, 6),
            "kv_seconds_median": round(med["kv"], 6),
            "raw_seconds_median": round(med["raw"], 6),
            "memcpy_seconds_median": round(med["memcpy"], 6),
            "verified": verified,
            **extra,
        }

    def verify(self, plan: TransferPlan, src_slots: list[int], dst_slots: list[int]) -> bool:
        """Rewrite the window, then compare per-head checksums of a sample of positions."""
        self.seq += 1
        tag = f"verify-{self.seq}".encode()
        self.agent.write(self.remote, plan, tag, timeout_s=self.a.timeout)
        if not self.receiver.wait(tag, 10.0):
            return False
        rng = np.random.default_rng(1)
        pick = rng.choice(len(src_slots), size=min(64, len(src_slots)), replace=False)
        return tp.heads_arrived(self.pools, self.shards, self.receiver, [src_slots[i] for i in pick],
                                [dst_slots[i] for i in pick])

    def close(self) -> None:
        try:
            self.agent.close()
        finally:
            self.receiver.close()


def _plot(points: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [p["bytes"] / 2**20 for p in points]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, label in (("memcpy_gbps", "local memcpy"), ("raw_nixl_gbps", "raw NIXL (1 descriptor)"),
                       ("kv_gbps", "KV window (planned)")):
        ax.plot(xs, [p[key] for p in points], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("transfer size (MiB)")
    ax.set_ylabel("bandwidth (GB/s)")
    ax.set_title("pdserve KV transfer")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    a = _parse(argv)
    if a.link is not None and a.receiver_netns is None:  # this process makes the link
        from pdserve.benchmarks.transfer_link import run_over_link

        return run_over_link(a, argv)
    import torch
    from tqdm import tqdm

    torch.set_num_threads(1)  # memcpy on one thread, like the NIXL copy it is compared with
    sizes = [a.tokens]
    if a.plot:
        sizes = sorted({max(a.page_size, a.tokens >> s) for s in (6, 4, 2)} | {a.tokens})
    session = _Session(a, a.tokens)
    try:
        with tqdm(total=a.repeats * len(sizes), desc="bench transfer", unit="rep", file=sys.stderr) as bar:
            points = [session.measure(t, a.repeats, bar) for t in sizes]
    finally:
        session.close()
    result = dict(points[-1])
    result.update({
        "layout": a.layout, "dst_layout": a.dst_layout,
        "page_size": a.page_size, "dst_page_size": a.dst_page_size, "layers": a.layers,
        "kv_heads": a.kv_heads, "head_dim": a.head_dim, "dtype": a.dtype,
        "fragmentation": a.fragmentation, "repeats": a.repeats,
        "progress_thread": a.progress_thread, "progress_delay_us": a.progress_delay_us, "ucx_params": a.backend_params,
        "huge_pages": a.huge_pages,
        "raw_chunks": a.raw_chunks, "receiver_poll_ms": a.receiver_poll_ms,
    })
    if a.plot:
        _plot(points, a.plot)
        result["sweep"] = points
        result["plot"] = a.plot
    if a.json:
        print(json.dumps(result))
    else:
        for k in ("bytes", "descriptors", "memcpy_gbps", "raw_nixl_gbps", "kv_gbps", "efficiency", "verified"):
            print(f"{k:>16}: {result[k]}")
    return 0 if result["verified"] else 1


if __name__ == "__main__":
    process_gc.own_process()
    raise SystemExit(main())
