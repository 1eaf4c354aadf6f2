"""`pdserve bench trust`: what it would cost to close the two holes a compromised node
still has, measured against the KV write they would guard.

Any NIXL peer that holds a node's agent metadata can read and write every registered page:
today a node registers its whole KV pool once, and freed pages keep their last KV. Two
remedies, each timed per request on the model's KV geometry:
- **per-request registration**: the decode node registers only a reservation's pages, the
  prefill node loads that metadata, the write runs, then both drop it (register +
  metadata + load + invalidate + deregister), instead of the pool once at start;
- **clearing freed pages**: zero a request's pages when it frees them, so a reader of the
  pool finds no one's KV.
Baseline, in the same run and process: the NIXL WRITE of the same pages between two agents
over the pre-registered pool (the transfer itself, as a prefill node does it). Reported:
medians, and each cost as a ratio to the write (`*_vs_write`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
import torch

from pdserve import process_gc
from pdserve.arith import ceil_div
from pdserve.benchmarks.model_choice import add_model_flag, resolve_or_exit
from pdserve.benchmarks.transfer import fragmented_pages

PROG = "pdserve bench trust"
ATTACK_SETS = ("transport", "tenants")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    add_model_flag(p)
    p.add_argument("--tokens", type=int, default=512, help="tokens per request (default: %(default)s)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per page (default: %(default)s)")
    p.add_argument("--pool-pages", type=int, default=256, help="pages in each pool (default: %(default)s)")
    p.add_argument("--fragmentation", type=float, default=0.3,
                   help="share of page boundaries that break a run (default: %(default)s)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--reps", type=int, default=40, help="requests timed (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--attacks", nargs="*", choices=ATTACK_SETS, metavar="SET",
                   help="instead of the costs: replay issue 38's attacks, the SETs named or all: "
                        "transport (plain HTTP under TLS, 60 MB unauthenticated calls, slow "
                        "headers, listeners outside --host) against a router and a decode node "
                        "it starts (benchmarks/trust_transport.py); tenants (another tenant's "
                        "Abort, squatted ids, the prefix-cache probe, a flood) against a "
                        "router, prefill and decode with two tenants (benchmarks/trust_tenants.py)")
    return p


def page_bytes(model_dir: str, page_size: int, dtype: torch.dtype) -> int:
    """Bytes of one page over all layers, K and V (the engine's page-major pool)."""
    config = json.loads(open(f"{model_dir}/config.json").read())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", config["num_attention_heads"])
    per_token = config["num_hidden_layers"] * 2 * kv_heads * head_dim
    return per_token * page_size * torch.empty(0, dtype=dtype).element_size()


class Agents:
    """Two NIXL agents in this process: `d` (decode side) and `p` (prefill side), each with
    a pool; `p` writes into `d` over UCX as between nodes."""

    def __init__(self, pool_pages: int, page_nbytes: int) -> None:
        import nixl

        self.b = b = nixl._bindings
        self.page_nbytes = page_nbytes
        self.pools = {k: torch.zeros(pool_pages, page_nbytes, dtype=torch.uint8) for k in "dp"}
        self.pools["p"].fill_(7)  # what a write lands is told apart from a cleared page
        self.agents, self.backends = {}, {}
        for k in "dp":
            cfg = b.nixlAgentConfig()
            cfg.useProgThread, cfg.useListenThread = False, False
            cfg.syncMode = b.NIXL_THREAD_SYNC_STRICT
            self.agents[k] = b.nixlAgent(f"trust-{k}", cfg)
            self.backends[k] = self.agents[k].createBackend("UCX", {})
        self.register("p", [(0, pool_pages)])  # P's pool: registered once, as on a node

    def regions(self, k: str, runs: list[tuple[int, int]]):
        base = self.pools[k].data_ptr()
        return [(base + first * self.page_nbytes, count * self.page_nbytes, 0, "")
                for first, count in runs]

    def register(self, k: str, runs: list[tuple[int, int]]):
        reg = self.b.nixlRegDList(self.b.DRAM_SEG, self.regions(k, runs))
        self.agents[k].registerMem(reg, [self.backends[k]])
        return reg

    def write(self, runs: list[tuple[int, int]], remote: str) -> None:
        """p's pages [0, n) into d's `runs`, then wait for it to land."""
        b, n = self.b, self.page_nbytes
        cursor = self.pools["p"].data_ptr()
        dst_base = self.pools["d"].data_ptr()
        src, dst = [], []
        for first, count in runs:
            src.append((cursor, count * n, 0))
            dst.append((dst_base + first * n, count * n, 0))
            cursor += count * n
        p = self.agents["p"]
        handle = p.createXferReq(b.NIXL_WRITE, b.nixlXferDList(b.DRAM_SEG, np.array(src, np.uint64)),
                                 b.nixlXferDList(b.DRAM_SEG, np.array(dst, np.uint64)), remote,
                                 b"", [self.backends["p"]])
        status = p.postXferReq(handle)
        while status == b.NIXL_IN_PROG:
            self.agents["d"].getNotifs({})  # progress the target side too
            status = p.getXferStatus(handle)
        p.releaseXferReq(handle)
        if status != b.NIXL_SUCCESS:
            raise RuntimeError(f"NIXL WRITE failed: {status}")


def _holds(pages: torch.Tensor, value: int) -> bool:
    return bool((pages == value).all())


def runs_of(pages: list[int]) -> list[tuple[int, int]]:
    """(first page, count) of each run of consecutive pool pages."""
    runs: list[tuple[int, int]] = []
    for page in pages:
        if runs and runs[-1][0] + runs[-1][1] == page:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((page, 1))
    return runs


def measure(args) -> dict:
    dtype = getattr(torch, args.dtype)
    model = resolve_or_exit(args.model, PROG)
    nbytes = page_bytes(model.dir, args.page_size, dtype)
    num_pages = ceil_div(args.tokens, args.page_size)
    agents = Agents(args.pool_pages, nbytes)
    rng = np.random.default_rng(args.seed)
    d, p = agents.agents["d"], agents.agents["p"]
    whole_d = agents.register("d", [(0, args.pool_pages)])
    remote = p.loadRemoteMD(d.getLocalMD())  # the connection, as a node's start makes it
    times: dict[str, list[float]] = {"write": [], "per_request_registration": [], "clear": []}
    for _ in range(args.reps):
        pages, _span = fragmented_pages(num_pages, args.fragmentation, rng)
        offset = int(rng.integers(0, args.pool_pages - _span))
        runs = runs_of([offset + page for page in pages])
        t0 = time.perf_counter()
        agents.write(runs, remote)  # baseline: the whole pool is registered on both sides
        t1 = time.perf_counter()
        times["write"].append(t1 - t0)
        # Per request: D's pool is not registered; D registers only this window, P loads
        # its metadata, the write runs, then P forgets it and D deregisters it (timed:
        # everything but the write, which the baseline already counts).
        p.invalidateRemoteMD(remote)
        d.deregisterMem(whole_d, [agents.backends["d"]])
        t2 = time.perf_counter()
        reg = agents.register("d", runs)
        remote = p.loadRemoteMD(d.getLocalPartialMD(reg, True))
        t3 = time.perf_counter()
        agents.write(runs, remote)  # it must work, or the registration was not enough
        if not all(_holds(agents.pools["d"][f:f + c], 7) for f, c in runs):
            raise RuntimeError("the write through the per-request registration did not land")
        t4 = time.perf_counter()
        p.invalidateRemoteMD(remote)
        d.deregisterMem(reg, [agents.backends["d"]])
        times["per_request_registration"].append(time.perf_counter() - t4 + t3 - t2)
        whole_d = agents.register("d", [(0, args.pool_pages)])
        remote = p.loadRemoteMD(d.getLocalMD())
        t5 = time.perf_counter()
        for first, count in runs:  # a memset per run of pages
            agents.pools["d"][first:first + count].zero_()
        times["clear"].append(time.perf_counter() - t5)
        if not all(_holds(agents.pools["d"][f:f + c], 0) for f, c in runs):
            raise RuntimeError("a cleared page still holds KV")
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "benchmark": "trust", "model": model.record(args.dtype), "tokens": args.tokens,
        "page_size": args.page_size, "pages_per_request": num_pages, "page_bytes": nbytes,
        "request_bytes": num_pages * nbytes, "reps": args.reps,
        "median_ms": {k: round(v * 1000, 4) for k, v in med.items()},
        "per_request_registration_vs_write": round(med["per_request_registration"] / med["write"], 3),
        "clear_vs_write": round(med["clear"] / med["write"], 3),
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.attacks is not None:  # `--attacks` alone: every set
        return attacks(args)
    torch.set_num_threads(1)
    result = measure(args)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")
    return 0


def attacks(args) -> int:
    """Each attack, its configuration and its outcome; exit 1 if one was not refused."""
    from pdserve.benchmarks import trust_tenants, trust_transport

    model_dir = resolve_or_exit(args.model, PROG).dir
    runs = {"transport": trust_transport.run_attacks, "tenants": trust_tenants.run_attacks}
    rows = [row for name in ATTACK_SETS if name in (args.attacks or ATTACK_SETS)
            for row in runs[name](model_dir)]
    if args.json:
        print(json.dumps({"benchmark": "trust_attacks", "attacks": rows}))
    else:
        for row in rows:
            print(f"{'REFUSED' if row['refused'] else 'NOT REFUSED'}  {row['attack']}\n"
                  f"    configuration: {row['configuration']}\n    outcome: {row['outcome']}")
    return 0 if all(row["refused"] for row in rows) else 1


if __name__ == "__main__":
    process_gc.own_process()
    sys.exit(main())
