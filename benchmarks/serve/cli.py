"""`pdserve bench serve`: load a running router or node and measure what clients see.

Sends requests at a fixed or Poisson rate (or a fixed concurrency), from synthetic length
ranges or a ShareGPT file, over pdserve's gRPC API or any OpenAI-compatible completions
endpoint, and reports TTFT, TPOT, ITL and end-to-end latency (mean, median, p90, p99),
throughput and goodput: a progress bar while a run goes (plain lines when stderr is no
terminal), then a summary block per run as vLLM's benchmark_serving prints it. `--rates`
sweeps several rates (a table sets them side by side); `--compare` starts 1P1D and two
colocated nodes itself and compares them (see `benchmarks.serve.compare`).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import asdict

from pdserve import process_gc
from pdserve.benchmarks.model_choice import KNOWN, add_model_flag
from pdserve.benchmarks.serve import workload as wl
from pdserve.benchmarks.serve.runs import (emit, fixed_objectives, make_backend, make_workload,
                                          run_row, workload_info)

EXAMPLES = """examples:
  pdserve bench serve --server 127.0.0.1:50051 --num-prompts 50 --request-rate 0.5
  pdserve bench serve --rates 0.2,0.4,0.8 --plot sweep.png --output sweep.json
  pdserve bench serve --max-concurrency 8 --dataset ShareGPT_V3.json --tokenizer MODEL_DIR
  pdserve bench serve --backend openai --url http://127.0.0.1:8000
  pdserve bench serve --compare --rates 0.1,0.2,0.4 --output compare.json --plot compare.png
  pdserve bench serve --compare --model bench-random-100m --rates 0.5,1,2
  pdserve bench serve --compare --compare-peer vllm-pd --rates 0.5,1 --slo-ttft-s 60 --slo-tpot-ms 200
"""


def parse_rates(text: str) -> list[float]:
    rates = [float(part) for part in text.split(",") if part.strip()]
    if not rates or any(r <= 0 or math.isnan(r) for r in rates):
        raise argparse.ArgumentTypeError(f"rates must be positive numbers or inf, got {text!r}")
    return rates


def parse_cores(text: str) -> tuple[frozenset[int], frozenset[int]]:
    """"A,B" (a core each side) or "LIST:LIST" (core lists as taskset takes them, "0-3,8").
    The two sides share no core."""
    def cpus(part: str) -> frozenset[int]:
        out = set()
        for item in part.split(","):
            low, _, high = item.partition("-")
            out.update(range(int(low), int(high or low) + 1))
        return frozenset(out)

    try:
        parts = text.split(":")
        sides = tuple(map(cpus, parts)) if len(parts) > 1 else tuple(frozenset({int(c)}) for c in text.split(","))
    except ValueError:
        sides = ()
    if len(sides) != 2 or not all(sides) or sides[0] & sides[1]:
        raise argparse.ArgumentTypeError(f"--cores takes two different cores A,B or two core lists with no core "
                                         f"in common, LIST:LIST (e.g. 0-7:8-15), got {text!r}")
    return sides


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench serve", description=__doc__.split("\n\n")[1],
                                epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("target")
    g.add_argument("--backend", choices=["grpc", "openai"], default="grpc",
                   help="grpc: pdserve's Generation API; openai: POST /v1/completions with "
                        "streaming (default: %(default)s)")
    g.add_argument("--server", default="127.0.0.1:50051",
                   help="gRPC HOST:PORT of a router or colocated node (default: %(default)s)")
    g.add_argument("--url", help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000")
    g.add_argument("--served-model", help="model name for --backend openai (default: the first "
                                          "one /v1/models lists)")
    g.add_argument("--timeout-s", type=float, default=600.0,
                   help="deadline of one request; past it the request counts as failed "
                        "(default: %(default)s)")

    g = p.add_argument_group("workload")
    g.add_argument("--dataset", help="ShareGPT-format JSON file (default: synthetic prompts)")
    g.add_argument("--num-prompts", type=int, default=100, help="requests per rate (default: %(default)s)")
    g.add_argument("--input-len", type=wl.parse_range, default=(512, 1536), metavar="LO:HI",
                   help="synthetic prompt length in tokens, uniform, inclusive (default: 512:1536)")
    g.add_argument("--output-len", type=wl.parse_range, default=(64, 128), metavar="LO:HI",
                   help="output length in tokens, uniform, inclusive (default: 64:128)")
    g.add_argument("--vocab-size", type=int,
                   help="synthetic prompt ids are drawn below this (default: the server's "
                        "vocabulary over gRPC; with --backend openai, the tokenizer's)")
    g.add_argument("--tokenizer", metavar="DIR|MODEL_ID",
                   help="the tokenizer that counts ShareGPT tokens and, with --backend "
                        "openai, gives the vocabulary (default: that of the model the server "
                        "names: its directory, a catalogue model in the cache, or a Hugging "
                        "Face model id)")
    g.add_argument("--sharegpt-output-len", type=int,
                   help="output length for every ShareGPT request (default: its answer's length)")
    g.add_argument("--seed", type=int, default=0, help="seed of prompts and arrivals (default: %(default)s)")

    g = p.add_argument_group("load")
    g.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second; inf sends all at once (default: inf)")
    g.add_argument("--rates", type=parse_rates,
                   help="comma-separated rates to sweep, lowest first (overrides --request-rate)")
    g.add_argument("--arrival", choices=["poisson", "fixed"], default="poisson",
                   help="gaps between requests: exponential or constant (default: %(default)s)")
    g.add_argument("--max-concurrency", type=int,
                   help="at most this many in flight; with rate inf, a fixed concurrency")
    g.add_argument("--warmup", type=int, default=1,
                   help="requests sent first and not measured (default: %(default)s)")

    g = p.add_argument_group("fixed objectives (goodput: requests per second meeting every "
                             "one given, and their fraction; with --compare, beside the "
                             "objectives derived from colocated)")
    g.add_argument("--slo-ttft-s", type=float, help="a request is good if its TTFT is at most this")
    g.add_argument("--slo-tpot-ms", type=float, help="... and its TPOT at most this")
    g.add_argument("--slo-itl-p99-ms", type=float,
                   help="... and the p99 of its own inter-token gaps at most this")
    g.add_argument("--ttft-slo-ms", type=float, help=argparse.SUPPRESS)  # older spellings
    g.add_argument("--tpot-slo-ms", type=float, help=argparse.SUPPRESS)

    g = p.add_argument_group("output")
    g.add_argument("--json", action="store_true", help="print the results as JSON instead of tables")
    g.add_argument("--output", metavar="FILE", help="also write the JSON results to FILE")
    g.add_argument("--plot", metavar="FILE.png", help="draw latency percentiles against rate")
    g.add_argument("--per-request", action="store_true",
                   help="include every request's TTFT, TPOT and latency in the JSON")

    g = p.add_argument_group("comparison (--compare)")
    g.add_argument("--compare", action="store_true",
                   help="start 1P1D and 2 colocated nodes on --cores, one after the other, "
                        "sweep --rates against each and compare")
    g.add_argument("--headline-rate", type=float, default=None,
                   help="the swept rate whose ratios are copied to the JSON's `headline`")
    add_model_flag(g, help="checkpoint directory or model name the --compare clusters serve: "
                           f"{', '.join(KNOWN)} (default: %(default)s, the real model; "
                           "bench-random-100m: the random-weight one of `bench engine`)")
    g.add_argument("--cores", type=parse_cores,
                   help="two CPU cores A,B, or two core lists A:B (e.g. 0-7:8-15): 1P1D prefill "
                        "on A, decode on B; colocated on both (default: the first two cores this "
                        "process may use; with --node-args naming a CUDA --device, half of its "
                        "cores each, as a GPU worker wants more than one)")
    g.add_argument("--colocated-nodes", type=int, choices=[1, 2], default=1,
                   help="colocated pdserve as one node on both cores with two threads, as "
                        "vLLM's server runs (default), or two nodes, one per core")
    g.add_argument("--node-args", default="", help="extra flags for every worker, one string "
                                                   "(e.g. \"--kv-cache-mb 1024\")")
    g.add_argument("--router-args", default="", help="extra flags for both routers, one string")
    g.add_argument("--log-dir", help="where node logs go (default: a temporary directory)")
    g.add_argument("--compare-peer", choices=["vllm", "vllm-pd"],
                   help="also run vLLM on the same cores, model and dtype, with the same "
                        "requests (its venv: `make bench-peers`): vllm, its OpenAI server on "
                        "both cores; vllm-pd, its prefill server on A and decode server on B "
                        "joined by its NixlConnector, behind our proxy")
    g.add_argument("--peer-python", help="the peer's interpreter (default: $PDSERVE_VLLM_PYTHON "
                                         "or .venv-peers/vllm/bin/python)")
    g.add_argument("--peer-kv-cache-gib", type=int, default=4,
                   help="KV space of the peer (VLLM_CPU_KVCACHE_SPACE), split between "
                        "vllm-pd's two servers (default: %(default)s)")
    return p


async def bench(args) -> dict:
    """Every run's results; each run's summary block prints as it ends (on stderr under
    --json, whose stdout is the JSON alone)."""
    from pdserve.benchmarks.serve.load import sweep
    from pdserve.benchmarks.serve.report import summary_block

    objectives = args.objectives
    backend = make_backend(args)
    target = args.url if args.backend == "openai" else args.server
    rows: list[dict] = []
    try:
        limits = await backend.limits()

        def report(run) -> None:
            rows.append(run_row(run, args, objectives))
            print(summary_block(rows[-1], f"{args.backend} {target} ({limits.model})"),
                  file=sys.stderr if args.json else sys.stdout, flush=True)

        await sweep(backend, make_workload(args, limits), args.rates, args.arrival,
                    args.max_concurrency, args.seed, args.warmup, on_run=report)
    finally:
        await backend.close()
    return {
        "backend": args.backend, "target": target, "model": limits.model,
        "workload": workload_info(args),
        "objectives": asdict(objectives),
        "runs": rows,
    }


def main(argv: list[str] | None = None) -> int:
    import grpc

    args = build_parser().parse_args(argv)
    args.rates = args.rates or [args.request_rate]
    args.objectives = fixed_objectives(args)  # a bad objective stops us before any server starts
    if args.compare_peer and not args.compare:
        raise SystemExit(f"pdserve bench serve: --compare-peer {args.compare_peer} needs --compare")
    try:
        if args.compare:
            from pdserve.benchmarks.serve.compare import main_compare

            return main_compare(args)
        return _bench_and_report(args)
    except (grpc.aio.AioRpcError, RuntimeError, OSError) as err:
        detail = f"{err.code().name}: {err.details()}" if isinstance(err, grpc.aio.AioRpcError) else err
        print(f"pdserve bench serve: {detail}", file=sys.stderr)
        return 1


def _bench_and_report(args) -> int:
    import uvloop

    from pdserve.benchmarks.serve.report import sweep_table

    result = uvloop.run(bench(args))
    rows = result["runs"]
    title = f"{args.backend} {result['target']} ({result['model']})"
    emit(result, args, [sweep_table(rows, title)] if len(rows) > 1 else [])  # runs side by side
    if args.plot:
        from pdserve.benchmarks.serve.plot import plot_sweep

        plot_sweep(rows, args.plot)
    return 1 if any(r["completed"] == 0 for r in rows) else 0


if __name__ == "__main__":
    process_gc.own_process()
    sys.exit(main())
