"""`pdserve bench chaos`: a soak of 2 prefill + 2 decode workers and a router under steady
load while nodes die, freeze, lose their link and the router restarts.

Order: a colocated oracle node (role `both`) computes every prompt's greedy output once and
exits; the cluster starts; a closed loop measures its capacity (unless `--rate`); then a
Poisson load at `--load-fraction` of it runs for `--minutes` while faults strike every
`--fault-every-s`; then the load stops, the pools settle, and the verdict is printed
(benchmarks/chaos/report.py). Exit status 1 when a must-be-0 figure is not 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from pdserve.benchmarks.chaos import firewall, plan, pools, report, traffic
from pdserve.benchmarks.chaos.cluster import ChaosCluster
from pdserve.benchmarks.chaos.faults import FaultInjector, FaultTimes
from pdserve.benchmarks.model_choice import add_model_flag, node_dtype, resolve_or_exit
from pdserve.benchmarks.serve.workload import parse_range
from pdserve.client import AsyncClient
from pdserve.launch import set_parent_death_signal
from pdserve.procs import NodeProcess

PROG = "pdserve bench chaos"
EXAMPLES = """examples:
  pdserve bench chaos --minutes 20 --json > chaos.json
  pdserve bench chaos --minutes 2 --fault-every-s 10,20 --model bench-random-tiny
  pdserve bench chaos --faults kill,stop --rate 2 --seed 3
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0], epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flag(p)
    p.add_argument("--minutes", type=float, default=20.0, help="soak length (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of prompts, arrivals, faults and victims (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--log-dir", help="keep every node's log here (default: a temporary "
                                     "directory, kept and named in the report if a check fails)")
    g = p.add_argument_group("load")
    g.add_argument("--rate", type=float, help="requests per second (default: --load-fraction "
                                              "of the capacity measured first)")
    g.add_argument("--load-fraction", type=float, default=0.7,
                   help="share of the measured capacity sent (default: %(default)s)")
    g.add_argument("--capacity-s", type=float, default=10.0,
                   help="how long capacity is measured (default: %(default)s)")
    g.add_argument("--capacity-concurrency", type=int, default=8,
                   help="closed-loop clients while measuring capacity (default: %(default)s)")
    g.add_argument("--deadline-s", type=float, default=30.0,
                   help="client deadline of every request (default: %(default)s)")
    g.add_argument("--num-prompts", type=int, default=32,
                   help="distinct prompts the requests draw from (default: %(default)s)")
    g.add_argument("--input-len", type=parse_range, default=(16, 200), metavar="LO:HI",
                   help="prompt length in tokens (default: 16:200)")
    g.add_argument("--output-len", type=parse_range, default=(8, 64), metavar="LO:HI",
                   help="max_tokens of each prompt, with ignore_eos (default: 8:64)")
    g = p.add_argument_group("faults")
    g.add_argument("--fault-every-s", type=plan.parse_every, default=(15.0, 30.0),
                   metavar="MIN,MAX", help="seconds between fault starts, uniform "
                                           "(default: 15,30)")
    g.add_argument("--faults", default=",".join(plan.FAULT_KINDS),
                   help="kinds to inject, comma-separated; link needs root and iptables "
                        "(default: %(default)s)")
    g.add_argument("--restart-after-s", type=float, default=3.0,
                   help="kill: seconds dead before the restart (default: %(default)s)")
    g.add_argument("--stop-s", type=float, default=None,
                   help="stop: seconds frozen (default: the lease plus 2)")
    g.add_argument("--link-s", type=float, default=4.0,
                   help="link: seconds the port is blocked (default: %(default)s)")
    g.add_argument("--router-down-s", type=float, default=1.0,
                   help="router: seconds down before the restart (default: %(default)s)")
    g = p.add_argument_group("nodes")
    g.add_argument("--lease-ms", type=int, default=2000,
                   help="the router's reservation lease (default: %(default)s)")
    g.add_argument("--quarantine-grace-ms", type=int, default=2000,
                   help="the decode nodes' quarantine grace (default: %(default)s)")
    g.add_argument("--num-pages", type=int, default=256,
                   help="KV pages per worker (default: %(default)s)")
    g.add_argument("--page-size", type=int, default=8, help="tokens per page (default: %(default)s)")
    return p


def _kinds(text: str) -> tuple[list[str], dict[str, str]]:
    """The fault kinds to inject and, for each left out, why."""
    kinds = [k for k in text.split(",") if k]
    unknown = set(kinds) - set(plan.FAULT_KINDS)
    if unknown or not kinds:
        raise SystemExit(f"{PROG}: error: --faults takes kinds from {plan.FAULT_KINDS}, "
                         f"got {text!r}")
    left_out = {}
    if "link" in kinds and (why := firewall.available()):
        kinds.remove("link")
        left_out["link"] = why
    return kinds, left_out


async def _oracle(model: str, worker_flags: list[str], args, logs: Path):
    """The prompt set and each prompt's greedy output, from a colocated node started for
    the purpose and stopped after."""
    node = NodeProcess(["serve", "--model", model, "--host", "127.0.0.1", "--port", "0",
                        *worker_flags], log=logs / "oracle.log", threads=1)
    try:
        address = await asyncio.to_thread(node.wait_ready, 180)
        async with AsyncClient(address) as client:
            vocab = (await client.models())[0].vocab_size
        prompts = plan.prompt_set(args.num_prompts, vocab, args.seed, args.input_len,
                                  args.output_len)
        return prompts, await traffic.oracle(address, prompts, args.deadline_s)
    finally:
        node.stop()


async def _soak(cluster: ChaosCluster, prompts, expected, kinds: list[str], args) -> dict:
    router = cluster.address("router")
    capacity, undisturbed = None, []
    if args.rate:
        rate = args.rate
    else:
        capacity, undisturbed = await traffic.capacity(
            router, prompts, args.capacity_s, args.capacity_concurrency, args.deadline_s)
        if capacity <= 0:
            raise RuntimeError("the undisturbed cluster completed no request; see the logs")
        rate = round(capacity * args.load_fraction, 3)
    duration = args.minutes * 60
    arrivals = plan.poisson_arrivals(rate, duration, args.seed)
    quiet_tail_s = 5.0  # no fault starts this close to the load's end
    faults = plan.fault_plan(tuple(kinds), duration, args.fault_every_s, args.seed,
                             quiet_tail_s) if kinds else []
    stop_s = args.stop_s if args.stop_s is not None else args.lease_ms / 1000 + 2.0
    injector = FaultInjector(cluster, FaultTimes(args.restart_after_s, stop_s,
                                                 args.router_down_s, link_s=args.link_s))
    cluster.begin_soak()
    soak_start = time.monotonic()
    injecting = asyncio.create_task(injector.run(faults, soak_start, duration - quiet_tail_s))
    try:
        outcomes = await traffic.open_loop(router, prompts, arrivals, args.seed,
                                           args.deadline_s, soak_start)
        await injecting
    finally:
        injecting.cancel()
    settle_s = (args.lease_ms + args.quarantine_grace_ms) / 1000 + 10.0
    pages = await pools.settle(cluster.workers, settle_s)
    cluster.close_incarnations()
    return {"nodes": {n: node.address for n, node in cluster.nodes.items()},
            "rate_rps": rate, "rate_source": "flag" if args.rate else "measured",
            "capacity_rps": None if capacity is None else round(capacity, 3),
            "capacity_requests": report.requests(undisturbed, expected, args.deadline_s, []),
            "requests": report.requests(outcomes, expected, args.deadline_s, injector.records),
            "pages": pages, "memory": cluster.memory(), "faults": injector.records}


def run(args) -> dict:
    model = resolve_or_exit(args.model, PROG)
    kinds, left_out = _kinds(args.faults)
    if "link" in kinds:
        firewall.clear(mine_only=False)  # rules a soak that died could not remove
    logs = Path(args.log_dir or tempfile.mkdtemp(prefix="pdserve-chaos-"))
    logs.mkdir(parents=True, exist_ok=True)
    worker_flags = ["--num-threads", "1", "--num-pages", str(args.num_pages),
                    "--page-size", str(args.page_size)]
    prompts, expected = asyncio.run(_oracle(model.dir, worker_flags, args, logs))
    cluster = ChaosCluster(
        model.dir, logs, worker_flags,
        decode_flags=["--quarantine-grace-ms", str(args.quarantine_grace_ms)],
        router_flags=["--lease-ms", str(args.lease_ms), "--health-interval-s", "0.5"])
    try:
        cluster.build()
        soak = asyncio.run(_soak(cluster, prompts, expected, kinds, args))
    finally:
        cluster.stop()
        firewall.clear()
    result = {"benchmark": "chaos", "model": model.record(node_dtype(worker_flags)),
              "seed": args.seed, "minutes": args.minutes, "load_fraction": args.load_fraction,
              "deadline_s": args.deadline_s, "lease_ms": args.lease_ms,
              "quarantine_grace_ms": args.quarantine_grace_ms,
              "fault_every_s": list(args.fault_every_s), "fault_kinds": kinds,
              "faults_left_out": left_out, **soak,
              "fault_counts": report.fault_counts(soak["faults"])}
    result["checks"] = report.checks(result)
    result["ok"] = not any(result["checks"].values())
    if result["ok"] and not args.log_dir:
        shutil.rmtree(logs, ignore_errors=True)
    else:
        result["logs"] = str(logs)
    return result


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the `finally`s stop the nodes and remove our rules;
    # a soak whose parent (a test, `pdserve bench`) dies gets one too, never runs orphaned.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    set_parent_death_signal(signal.SIGTERM)
    result = run(args)
    print(json.dumps(result, indent=2) if args.json else report.table(result))
    return 0 if result["ok"] else 1
