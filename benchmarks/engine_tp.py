"""`pdserve bench engine --tensor-parallel-size N`: pdserve's engine with the model split
over N ranks against the same engine on one rank (its baseline), on the same workloads, in
the same run; transformers and peers stay out of it.

Both runs use the whole machine: TP = 1 runs `cores` torch threads, TP = N runs
`max(1, cores // N)` threads in each rank. The runs go one after the other, each engine
closed before the next is built (one tensor-parallel engine per process at a time: its
ranks join the process's one torch.distributed group).
"""

from __future__ import annotations

import os
import random
import sys
import time

from pdserve.benchmarks.engine_table import print_tp_table


def thread_counts(cores: int, tp_size: int) -> list[tuple[int, int]]:
    """(ranks, threads per rank) of the baseline and of the TP run: each fills the cores."""
    return [(1, cores), (tp_size, max(1, cores // tp_size))]


def compare_tp(args, model, config, workloads, warmup, kv_bytes: int, step_batches: list[int], *,
               run_engine, match, steps: int) -> int:
    """`bench engine --tensor-parallel-size N`; the engine benchmark's own runners come in
    as arguments (benchmarks/engine.py imports this file)."""
    if args.peer or args.transformers or args.device != "cpu":
        print("pdserve bench engine: error: --tensor-parallel-size measures pdserve against itself, on the "
              "CPU: drop --peer, --transformers and --device", file=sys.stderr)
        return 2
    cores = len(os.sched_getaffinity(0))
    runs, outputs = [], []
    for ranks, threads in thread_counts(cores, args.tensor_parallel_size):
        run, tokens = measure_run(args, model, workloads, warmup, kv_bytes, step_batches, ranks, threads,
                                  run_engine, steps)
        runs.append(run)
        outputs.append(tokens)
    (base, tp), (base_tokens, tp_tokens) = runs, outputs
    rows = []
    for w, b, t, ours, theirs in zip(workloads, base["workloads"], tp["workloads"], tp_tokens, base_tokens):
        generated = sum(w.output_lens)
        rows.append({"workload": w.name, "num_prompts": len(w.prompts),
                     "prompt_tokens": sum(map(len, w.prompts)), "generated_tokens": generated,
                     "baseline_s": b["seconds"], "baseline_tokens_per_s": round(generated / b["seconds"], 2),
                     "tp_s": t["seconds"], "tp_tokens_per_s": round(generated / t["seconds"], 2),
                     # throughput of TP = N over TP = 1: above 1, the split pays
                     "tp_ratio": round(b["seconds"] / t["seconds"], 4),
                     "greedy_match": match(ours, theirs)})
    report = {
        "model": model.described(args.dtype, config),
        "dtype": args.dtype,
        "device": args.device,
        "cores": cores,
        "tensor_parallel_size": args.tensor_parallel_size,
        "quick": args.quick,
        "prefill_only": args.prefill_only,
        "prefix_cache": True,
        "runs": runs,
        "workloads": rows,
    }
    if step_batches:
        # decode step time of TP = N over TP = 1: below 1, the split pays
        report["decode_steps"] = [
            {"batch": b["batch"], "baseline_median_ms": b["median_ms"], "tp_median_ms": t["median_ms"],
             "tp_ratio": round(t["median_ms"] / b["median_ms"], 4)}
            for b, t in zip(base["decode_steps"], tp["decode_steps"])]
    if args.json:
        import json

        print(json.dumps(report, indent=2))
    else:
        print_tp_table(report)
    return 0


def measure_run(args, model, workloads, warmup, kv_bytes, step_batches, ranks: int, threads: int,
                run_engine, steps: int):
    """One engine's figures ({ranks, threads, start-up, seconds per workload[, decode
    steps]}) and its tokens per workload; the engine is closed on the way out."""
    from tqdm import tqdm

    from pdserve.engine import LLM

    print(f"[bench] TP = {ranks}: {ranks} rank(s) x {threads} thread(s)", file=sys.stderr, flush=True)
    start = time.perf_counter()
    llm = LLM(model.dir, page_size=args.page_size, dtype=args.dtype, kv_cache_memory_bytes=kv_bytes,
              device=args.device, max_num_seqs=max([64, *step_batches]), tensor_parallel_size=ranks,
              num_threads=threads)
    try:
        run = {"tensor_parallel_size": ranks, "threads_per_rank": threads,
               "engine_startup_s": round(time.perf_counter() - start, 3), "workloads": []}
        run_engine(llm, warmup)
        tokens = []
        with tqdm(total=sum(len(w.prompts) for w in workloads), desc=f"bench engine TP={ranks}",
                  unit="prompt", file=sys.stderr) as progress:
            for w in workloads:
                seconds, out = run_engine(llm, w)
                run["workloads"].append({"workload": w.name, "seconds": round(seconds, 4)})
                tokens.append(out)
                progress.update(len(w.prompts))
        if step_batches:  # decode steps alone (step_report's bandwidth limits are a GPU's)
            from pdserve.benchmarks.gpu_engine import decode_steps

            rng = random.Random(0)
            decode_steps(llm.engine, step_batches[0], 128, 2, rng, args.device)  # warm-up
            run["decode_steps"] = [decode_steps(llm.engine, b, 128, steps, rng, args.device)
                                   for b in step_batches]
    finally:
        llm.close()
    return run, tokens
