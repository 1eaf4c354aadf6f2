"""`pdserve bench load`: what an engine's start costs, in memory and seconds, on one rank
(the baseline) and on `--tensor-parallel-size` ranks, against the weights it must hold.

Each start runs in a fresh process of its own, as a node's (pdserve's garbage-collector
policy, `process_gc`, included): its anonymous memory, summed over it and its ranks, is
sampled every 10 ms while the engine starts (`peak`) and read once it serves (`serving`,
after the node's own hand-back of freed memory). The checkpoint's pages that the kernel
caches are not counted: they are shared and the kernel may drop them. `weights_bytes` is
the checkpoint's every tensor in `--dtype`; each figure's ratio to it is beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

from pdserve.procs import descendants


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench load", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a Hugging Face checkpoint directory")
    p.add_argument("--tensor-parallel-size", type=int, default=2, help="ranks of the run beside the baseline's one")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the engine's (default float32)")
    p.add_argument("--json", action="store_true", help="print the report as JSON (else a summary)")
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)  # one start, in its own process
    return p


def tree_anon_bytes(pid: int) -> int:
    """RssAnon of `pid` and its descendants (0 for any gone meanwhile)."""
    total = 0
    for p in descendants(pid):
        try:
            with open(f"/proc/{p}/status") as f:
                total += next((int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:")), 0)
        except OSError:
            pass
    return total


def one_start(model: str, ranks: int, dtype: str) -> dict:
    """Runs in the child: start the engine, measure, close it."""
    from pdserve import process_gc

    process_gc.own_process(server=True)
    from pdserve.engine import LLM

    peak, done = [0], threading.Event()

    def sample():
        while not done.wait(0.01):
            peak[0] = max(peak[0], tree_anon_bytes(os.getpid()))

    before = tree_anon_bytes(os.getpid())
    threading.Thread(target=sample, daemon=True).start()
    t0 = time.perf_counter()
    llm = LLM(model, tensor_parallel_size=ranks, dtype=dtype, num_threads=1, num_pages=16, page_size=16)
    start_s = time.perf_counter() - t0
    process_gc.serving()
    serving = tree_anon_bytes(os.getpid())
    done.set()
    llm.close()
    return {"ranks": ranks, "start_s": round(start_s, 3), "peak_bytes": max(peak[0], serving) - before,
            "serving_bytes": serving - before}


def weights_bytes(model: str, dtype: str) -> int:
    """Every tensor of the checkpoint at `dtype`'s size: the weights a node must hold once."""
    import torch
    from safetensors import safe_open

    from pdserve.engine.model.weights import safetensors_files

    size, total = getattr(torch, dtype).itemsize, 0
    for path in safetensors_files(model):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                shape = f.get_slice(name).get_shape()
                total += size * int(torch.Size(shape).numel())
    return total


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.child is not None:
        print(json.dumps(one_start(args.model, args.child, args.dtype)))
        return 0
    if args.tensor_parallel_size < 2:
        print("pdserve bench load: error: --tensor-parallel-size must be at least 2 (1 is the baseline's)",
              file=sys.stderr)
        return 2
    weights = weights_bytes(args.model, args.dtype)
    runs = []
    for ranks in (1, args.tensor_parallel_size):
        out = subprocess.run([sys.executable, "-m", "pdserve.benchmarks.load", "--model", args.model, "--dtype",
                              args.dtype, "--child", str(ranks)], capture_output=True, text=True)
        if out.returncode:
            print(f"pdserve bench load: the start on {ranks} rank(s) failed:\n{out.stderr[-3000:]}", file=sys.stderr)
            return 1
        run = json.loads(out.stdout.strip().splitlines()[-1])
        run |= {"peak_over_weights": round(run["peak_bytes"] / weights, 3),
                "serving_over_weights": round(run["serving_bytes"] / weights, 3)}
        runs.append(run)
    base, tp = runs
    report = {"model": args.model, "dtype": args.dtype, "weights_bytes": weights, "baseline": base, "tp": tp,
              # the TP start's memory over the one-rank start's: 1 when the ranks hold the model once
              "tp_peak_over_baseline": round(tp["peak_bytes"] / base["peak_bytes"], 3),
              "tp_serving_over_baseline": round(tp["serving_bytes"] / base["serving_bytes"], 3)}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{args.model}: weights {weights / 2**30:.2f} GiB in {args.dtype}")
    for run in runs:
        print(f"  {run['ranks']} rank(s): peak {run['peak_bytes'] / 2**30:.2f} GiB ({run['peak_over_weights']}x), "
              f"serving {run['serving_bytes'] / 2**30:.2f} GiB ({run['serving_over_weights']}x), "
              f"started in {run['start_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
