"""`pdserve bench serve --compare`: 1P1D against two colocated nodes on the same cores, and
with `--compare-peer vllm` against vLLM's OpenAI server on those cores too
(`benchmarks.serve.peer_server`).

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
(`goodput_ratio_strict`, `goodput_ratio_loose`, higher is better). With the peer,
each rate also has `vs_vllm`: each pdserve system's goodput (strict, loose) and request
throughput over vLLM's. A ratio whose denominator is 0 (or missing) is null.
"""

from __future__ import annotations

import math
import os
import shlex
import tempfile
from pathlib import Path

from pdserve.benchmarks.serve.metrics import RequestResult, distribution, goodput

NAMES = ("1p1d", "colocated")
PEER = "vllm"
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
    and the ratios first system / second."""
    a, b = NAMES
    out = []
    for i, (row_a, row_b) in enumerate(zip(rows[a], rows[b])):
        for name, row in ((a, row_a), (b, row_b)):
            for kind, o in objs.items():
                row[f"goodput_{kind}"] = goodput(results[name][i], row["duration_s"],
                                                 o["ttft_ms"] / 1000, o["tpot_ms"] / 1000)
        entry = {
            "request_rate": row_a["request_rate"],
            "tpot_p90_ratio": ratio(row_a["tpot_ms"]["p90"], row_b["tpot_ms"]["p90"]),
            "goodput_ratio_strict": ratio(row_a["goodput_strict"], row_b["goodput_strict"]),
            "goodput_ratio_loose": ratio(row_a["goodput_loose"], row_b["goodput_loose"]),
            a: row_a, b: row_b,
        }
        if PEER in rows:
            peer = entry[PEER] = rows[PEER][i]
            for kind, o in objs.items():
                peer[f"goodput_{kind}"] = goodput(results[PEER][i], peer["duration_s"],
                                                  o["ttft_ms"] / 1000, o["tpot_ms"] / 1000)
            entry["vs_vllm"] = {name: {
                "goodput_ratio_strict": ratio(entry[name]["goodput_strict"], peer["goodput_strict"]),
                "goodput_ratio_loose": ratio(entry[name]["goodput_loose"], peer["goodput_loose"]),
                "throughput_ratio": ratio(entry[name]["request_throughput"],
                                          peer["request_throughput"]),
            } for name in NAMES}
        out.append(entry)
    return out


def default_cores() -> tuple[int, int]:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("pdserve bench serve --compare needs two cores; this process may use "
                         f"only {cores}")
    return cores[0], cores[1]


def run_system(name: str, args, model: str, cores, log_dir: Path):
    """Start `name`, sweep the rates against it, stop it. Returns (rows, per-run results)."""
    import uvloop

    from pdserve.benchmarks.serve.backends import GrpcBackend
    from pdserve.benchmarks.serve.cluster import start_cluster
    from pdserve.benchmarks.serve.load import sweep
    from pdserve.benchmarks.serve.runs import make_workload, run_row

    if name == PEER:
        from pdserve.benchmarks.serve.backends import OpenAIBackend
        from pdserve.benchmarks.serve.peer_server import SERVED_NAME, start_vllm_server

        server = start_vllm_server(args.peer_python, model, args.peer_dtype, cores, log_dir,
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
    return [run_row(r, args) for r in runs], [r.results for r in runs]


def headline(table: list[dict], rate: float | None) -> dict | None:
    """The three ratios at the rate the headline is read at (`--headline-rate`)."""
    if rate is None:
        return None
    row = next((r for r in table if r["request_rate"] == rate), None)
    if row is None:
        raise SystemExit(f"--headline-rate {rate:g} is not one of the swept rates")
    return {k: row[k] for k in ("request_rate", "tpot_p90_ratio", "goodput_ratio_strict",
                                 "goodput_ratio_loose", "vs_vllm") if k in row}


def main_compare(args) -> int:
    from pdserve.benchmarks.model_choice import node_dtype, resolve_or_exit
    from pdserve.benchmarks.serve.report import compare_table, sweep_table
    from pdserve.benchmarks.serve.runs import emit, workload_info

    if args.backend != "grpc":
        raise SystemExit("pdserve bench serve --compare starts pdserve clusters; it speaks gRPC only")
    if sorted(args.rates) != args.rates:
        raise SystemExit(f"--rates must go from light to heavy load, got {args.rates}")
    # Resolved once here, so the four processes never convert it at once; the nodes serve
    # the directory under the name its card gives.
    model = resolve_or_exit(args.model, "pdserve bench serve")
    cores = args.cores or default_cores()
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pdserve-compare-"))
    names = NAMES + ((PEER,) if args.compare_peer else ())
    if args.compare_peer:
        _peer_settings(args, model.dir)
    rows, results = {}, {}
    for name in names:
        rows[name], results[name] = run_system(name, args, model.dir, cores, log_dir)
    objs = objectives(results["colocated"][0])
    table = compare_rows(rows, results, objs)
    out = {
        "mode": "compare", "systems": {
            "1p1d": f"prefill on core {cores[0]}, decode on core {cores[1]}, router on both",
            "colocated": (f"role both on cores {cores[0]} and {cores[1]}, router on both"
                          if args.colocated_nodes == 2 else
                          f"one role-both node on cores {cores[0]},{cores[1]} with 2 threads, "
                          "router on both"),
            **({PEER: f"vLLM's OpenAI server ({args.peer_dtype}) on cores {cores[0]},{cores[1]}, "
                      f"{args.peer_kv_cache_gib} GiB KV"} if args.compare_peer else {})},
        "model": model.record(node_dtype(shlex.split(args.node_args))), "cores": list(cores),
        "workload": {**workload_info(args), "arrival": args.arrival,
                     "rates": [r if math.isfinite(r) else None for r in args.rates],
                     "max_concurrency": args.max_concurrency},
        "node_args": args.node_args, "router_args": args.router_args, "log_dir": str(log_dir),
        "objectives": {"reference": f"colocated at {args.rates[0]:g} req/s",
                       "ttft_multiple": TTFT_MULTIPLE, "tpot_multiple": TPOT_MULTIPLE, **objs},
        "headline": headline(table, args.headline_rate),
        "results": table,
    }
    emit(out, args, [compare_table(table, NAMES),
                     *(sweep_table([r[n] for r in table], n) for n in names)])
    if args.plot:
        from pdserve.benchmarks.serve.plot import plot_compare

        plot_compare(table, NAMES, objs, args.plot)
    return 1 if any(r[n]["completed"] == 0 for r in table for n in names) else 0


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

