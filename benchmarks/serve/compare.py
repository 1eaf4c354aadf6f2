"""`pdserve bench serve --compare`: 1P1D against two colocated nodes on the same cores, and
with `--compare-peer vllm` against vLLM's OpenAI server on those cores too
(`benchmarks.serve.peer_server`), or with `--compare-peer vllm-pd` against vLLM as 1P1D,
prefill and decode servers joined by its NixlConnector (`benchmarks.serve.peer_pd`).

The two systems run one after the other, never at once, on the same two cores (see
`cluster`), against the same requests at the same rates (prompts differ between rates,
never between systems), serving the same `--model` (`benchmarks.model_choice`; the real
SmolLM2-135M-Instruct by default), which the JSON records with the workers' dtype.
Objectives come from the colocated system at the lowest rate (light load), so put a light
rate first:
- strict: TTFT <= 3x and TPOT <= 1.5x its median TTFT and median TPOT;
- loose: the same multiples of its p90s.
Each rate reports both systems and the ratios 1P1D / colocated of p90 TPOT
(`tpot_p90_ratio`, lower is better for 1P1D) and of goodput under each objective
(`goodput_ratio_strict`, `goodput_ratio_loose`, higher is better). Fixed objectives
(`--slo-*`) give each system's `goodput` and `goodput_fraction` and the ratio
`goodput_ratio_fixed`; unlike the derived ones, they compare across days. With a peer,
each rate also has `vs_vllm` (or `vs_vllm_pd`): each pdserve system's goodput (strict,
loose, fixed), request throughput and p90 TPOT over the peer's. A ratio whose
denominator is 0 (or missing) is null.
"""

from __future__ import annotations

import math
import os
import shlex
import tempfile
from dataclasses import asdict
from pathlib import Path

from pdserve.benchmarks.serve.metrics import RequestResult, distribution, goodput

NAMES = ("1p1d", "colocated")
PEERS = ("vllm", "vllm-pd")
TTFT_MULTIPLE = 3.0
TPOT_MULTIPLE = 1.5


def objectives(reference: list[RequestResult]) -> dict:
    """Strict and loose objectives (ms) from the light-load run of the baseline."""
    ok = [r for r in reference if r.ok]
    ttft = distribution([r.ttft for r in ok if r.ttft is not None])
    tpot = distribution([r.tpot for r in ok if r.tpot is not None])
    if ttft["median"] is None or tpot["median"] is None:
        raise RuntimeError("the light-load baseline run has no TTFT or TPOT to derive objectives "
                           "from (did every request fail, or have a single output token?)")
    return {
        kind: {"ttft_ms": TTFT_MULTIPLE * ttft[stat], "tpot_ms": TPOT_MULTIPLE * tpot[stat]}
        for kind, stat in (("strict", "median"), ("loose", "p90"))
    }


def ratio(x: float | None, y: float | None) -> float | None:
    return None if x is None or not y else x / y


def compare_rows(rows: dict[str, list[dict]], results: dict[str, list[list[RequestResult]]],
                 objs: dict) -> list[dict]:
    """One entry per rate: both systems' summaries with goodput under each objective,
    and the ratios first system / second; with a peer, each pdserve system over the peer.
    Rows carrying `goodput` (the fixed `--slo-*` objectives) get that ratio too."""
    a, b = NAMES
    peer = next((p for p in PEERS if p in rows), None)
    out = []
    for i, (row_a, row_b) in enumerate(zip(rows[a], rows[b])):
        entry = {"request_rate": row_a["request_rate"], a: row_a, b: row_b}
        for name in (a, b, *([peer] if peer else [])):
            row = entry[name] = rows[name][i]
            for kind, o in objs.items():
                row[f"goodput_{kind}"] = goodput(results[name][i], row["duration_s"],
                                                 o["ttft_ms"] / 1000, o["tpot_ms"] / 1000)
        kinds = ("strict", "loose", *(["fixed"] if "goodput" in row_a else []))
        entry["tpot_p90_ratio"] = ratio(row_a["tpot_ms"]["p90"], row_b["tpot_ms"]["p90"])
        entry.update(_goodput_ratios(row_a, row_b, kinds))
        if peer:
            entry[peer_key(peer)] = {name: {
                **_goodput_ratios(entry[name], entry[peer], kinds),
                "throughput_ratio": ratio(entry[name]["request_throughput"],
                                          entry[peer]["request_throughput"]),
                "tpot_p90_ratio": ratio(entry[name]["tpot_ms"]["p90"],
                                        entry[peer]["tpot_ms"]["p90"]),
            } for name in NAMES}
        out.append(entry)
    return out


def _goodput_ratios(x: dict, y: dict, kinds) -> dict:
    key = lambda kind: "goodput" if kind == "fixed" else f"goodput_{kind}"  # noqa: E731
    return {f"goodput_ratio_{kind}": ratio(x[key(kind)], y[key(kind)]) for kind in kinds}


def peer_key(peer: str) -> str:
    """Where each rate keeps the ratios over the peer: `vs_vllm`, `vs_vllm_pd`."""
    return "vs_" + peer.replace("-", "_")


def default_cores(node_args: list[str]) -> tuple[frozenset[int], frozenset[int]]:
    """The first two cores this process may use, one a side; for GPU workers, half of them
    a side: a GPU node's engine thread, gRPC threads and NIXL progress each want a core,
    where a CPU node's one core is the fair share it is compared on."""
    from pdserve.benchmarks.model_choice import node_device

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("pdserve bench serve --compare needs two cores; this process may use "
                         f"only {cores}")
    half = len(cores) // 2 if node_device(node_args).startswith("cuda") else 1
    return frozenset(cores[:half]), frozenset(cores[half:2 * half])


def where(cores) -> str:
    """'core 3' or 'cores 0-7'."""
    from pdserve.benchmarks.peer import cpu_list

    return f"core{'s' if len(cores) > 1 else ''} {cpu_list(sorted(cores))}"


def run_system(name: str, args, model: str, cores, log_dir: Path):
    """Start `name`, sweep the rates against it, stop it. Returns (rows, per-run results)."""
    import uvloop

    from pdserve.benchmarks.serve.backends import GrpcBackend
    from pdserve.benchmarks.serve.cluster import start_cluster
    from pdserve.benchmarks.serve.load import sweep
    from pdserve.benchmarks.serve.runs import make_workload, run_row

    if name in PEERS:
        from pdserve.benchmarks.serve.backends import OpenAIBackend
        from pdserve.benchmarks.serve.peer_pd import start_vllm_pd
        from pdserve.benchmarks.serve.peer_server import SERVED_NAME, start_vllm_server

        start = start_vllm_pd if name == "vllm-pd" else start_vllm_server
        server = start(args.peer_python, model, args.peer_dtype, cores, log_dir,
                       args.peer_kv_cache_gib, args.peer_max_model_len)
        connect = lambda url: OpenAIBackend(url, SERVED_NAME, args.timeout_s)  # noqa: E731
    else:
        server = start_cluster(name, model, cores, log_dir, shlex.split(args.node_args),
                               shlex.split(args.router_args),
                               colocated_nodes=args.colocated_nodes)
        connect = lambda address: GrpcBackend(address, args.timeout_s)  # noqa: E731
    with server as address:
        async def go():
            backend = connect(address)
            try:
                workload_for = make_workload(args, await backend.limits())
                return await sweep(backend, workload_for, args.rates, args.arrival,
                                   args.max_concurrency, args.seed, args.warmup, label=name)
            finally:
                await backend.close()

        runs = uvloop.run(go())
    return [run_row(r, args, args.objectives) for r in runs], [r.results for r in runs]


def headline(table: list[dict], rate: float | None) -> dict | None:
    """The three ratios at the rate the headline is read at (`--headline-rate`)."""
    if rate is None:
        return None
    row = next((r for r in table if r["request_rate"] == rate), None)
    if row is None:
        raise SystemExit(f"--headline-rate {rate:g} is not one of the swept rates")
    return {k: row[k] for k in ("request_rate", "tpot_p90_ratio", "goodput_ratio_strict",
                                 "goodput_ratio_loose", "goodput_ratio_fixed",
                                 *map(peer_key, PEERS)) if k in row}


def main_compare(args) -> int:
    from pdserve.benchmarks.model_choice import node_dtype, resolve_or_exit
    from pdserve.benchmarks.serve.report import compare_table, peer_table, sweep_table
    from pdserve.benchmarks.serve.runs import emit, workload_info

    if args.backend != "grpc":
        raise SystemExit("pdserve bench serve --compare starts pdserve clusters; it speaks gRPC only")
    if sorted(args.rates) != args.rates:
        raise SystemExit(f"--rates must go from light to heavy load, got {args.rates}")
    # Resolved once here, so the four processes never convert it at once; the nodes serve
    # the directory under the name its card gives.
    model = resolve_or_exit(args.model, "pdserve bench serve")
    cores = args.cores or default_cores(shlex.split(args.node_args))
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pdserve-compare-"))
    names = NAMES + ((args.compare_peer,) if args.compare_peer else ())
    if args.compare_peer:
        _peer_settings(args, model.dir)
    rows, results = {}, {}
    for name in names:
        rows[name], results[name] = run_system(name, args, model.dir, cores, log_dir)
    objs = objectives(results["colocated"][0])
    table = compare_rows(rows, results, objs)
    out = {
        "mode": "compare", "systems": {
            "1p1d": f"prefill on {where(cores[0])}, decode on {where(cores[1])}, router on both",
            "colocated": (f"role both on {where(cores[0])} and on {where(cores[1])}, router on both"
                          if args.colocated_nodes == 2 else
                          f"one role-both node on {where(cores[0] | cores[1])} with "
                          f"{len(cores[0] | cores[1])} threads, router on both"),
            **({args.compare_peer: _peer_system(args, cores)} if args.compare_peer else {})},
        "model": model.record(node_dtype(shlex.split(args.node_args))), "cores": [sorted(side) for side in cores],
        "workload": {**workload_info(args), "arrival": args.arrival,
                     "rates": [r if math.isfinite(r) else None for r in args.rates],
                     "max_concurrency": args.max_concurrency},
        "node_args": args.node_args, "router_args": args.router_args, "log_dir": str(log_dir),
        "objectives": {"reference": f"colocated at {args.rates[0]:g} req/s",
                       "ttft_multiple": TTFT_MULTIPLE, "tpot_multiple": TPOT_MULTIPLE, **objs,
                       "fixed": asdict(args.objectives)},
        "headline": headline(table, args.headline_rate),
        "results": table,
    }
    emit(out, args, [compare_table(table, NAMES),
                     *(sweep_table([r[n] for r in table], n) for n in names),
                     *([peer_table(table, names)] if args.compare_peer or args.objectives.given() else [])])
    if args.plot:
        from pdserve.benchmarks.serve.plot import plot_compare

        plot_compare(table, NAMES, objs, args.plot)
    return 1 if any(r[n]["completed"] == 0 for r in table for n in names) else 0


def _peer_system(args, cores) -> str:
    kv = f"{args.peer_dtype}, {args.peer_kv_cache_gib} GiB KV"
    if args.compare_peer == "vllm-pd":
        return (f"vLLM 1P1D ({kv} split): prefill server on {where(cores[0])}, decode server on "
                f"{where(cores[1])}, NixlConnector, our proxy on both (benchmarks.serve.peer_pd)")
    return f"vLLM's OpenAI server ({kv}) on {where(cores[0] | cores[1])}"


def _peer_settings(args, model_dir: str) -> None:
    """What the peer needs that pdserve's gRPC tells by itself: the interpreter, the dtype
    the workers serve, the vocabulary for the synthetic prompts (the same prompts for every
    system) and a context length."""
    import json

    from pdserve.benchmarks.model_choice import node_dtype
    from pdserve.benchmarks.peer import peer_python

    config = json.loads((Path(model_dir) / "config.json").read_text())
    args.peer_python = peer_python(args.peer_python)
    args.peer_dtype = node_dtype(shlex.split(args.node_args))
    args.vocab_size = args.vocab_size or config["vocab_size"]
    args.peer_max_model_len = config.get("max_position_embeddings", 8192)

