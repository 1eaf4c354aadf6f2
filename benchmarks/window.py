"""`pdserve bench window`: one layer's decode attention under a sliding window, the C
kernel (which skips the pages before the window) against the torch path's SDPA under a
window mask (what a sliding layer ran before the kernel took a window), and against the
kernel over the whole context (a layer without a window), in one process, same cores.

Pages of every sequence lie scattered over a page-major pool, as the engine's do; each
figure is the median of `--repeats` timed calls after warm-up. The default geometry is
gemma-3-1b's attention (4 query heads over 1 KV head of 256, a 512-token window) at batch
32; `--contexts` gives the context lengths measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench window", description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=32, help="decodes attended together (default 32)")
    p.add_argument("--contexts", default="512,2048,8192", help="context lengths, comma-separated")
    p.add_argument("--window", type=int, default=512, help="the sliding window (default 512)")
    p.add_argument("--heads", default="4,1,256", help="query heads, KV heads, head_dim (default 4,1,256)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=20, help="timed calls per figure (default 20)")
    p.add_argument("--json", action="store_true", help="print the report as JSON (else a summary)")
    return p


def _median_ms(fn, repeats: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return round(statistics.median(times) * 1000, 3)


def _pool(num_kv_heads, head_dim, page_size, lens, dtype, g):
    """One layer's K and V views of a page-major pool, each sequence's pages scattered."""
    import torch

    num_pages = sum(-(-n // page_size) for n in lens) + 1
    pool = torch.randn(num_pages, 2, page_size, num_kv_heads, head_dim, generator=g).to(dtype)
    order = torch.randperm(num_pages, generator=g).tolist()
    pages, used = [], 0
    for n in lens:
        need = -(-n // page_size)
        pages.append(order[used:used + need])
        used += need
    return pool[:, 0], pool[:, 1], pages


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    from pdserve.engine.attention import cpu_ops

    dtype = getattr(torch, args.dtype)
    heads, kv_heads, head_dim = (int(x) for x in args.heads.split(","))
    g = torch.Generator().manual_seed(0)
    rows = []
    for ctx in (int(x) for x in args.contexts.split(",")):
        lens = [ctx] * args.batch
        k, v, pages = _pool(kv_heads, head_dim, args.page_size, lens, dtype, g)
        q = torch.randn(args.batch, heads, head_dim, generator=g).to(dtype)

        def timed(kv_dtype, window):
            plan = cpu_ops.plan_attention([1] * args.batch, lens, pages, args.page_size, "cpu", kv_dtype, window)
            return _median_ms(lambda: cpu_ops.attend(q, k, v, plan, head_dim**-0.5), args.repeats)

        row = {"context": ctx, "kernel_window_ms": timed(dtype, args.window),
               "sdpa_window_mask_ms": timed(None, args.window), "kernel_whole_context_ms": timed(dtype, 0)}
        row["sdpa_over_kernel"] = round(row["sdpa_window_mask_ms"] / row["kernel_window_ms"], 2)
        row["whole_over_window"] = round(row["kernel_whole_context_ms"] / row["kernel_window_ms"], 2)
        rows.append(row)
    report = {"batch": args.batch, "window": args.window, "heads": [heads, kv_heads, head_dim],
              "dtype": args.dtype, "page_size": args.page_size, "threads": torch.get_num_threads(), "rows": rows}
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        for r in rows:
            print(f"context {r['context']}: window kernel {r['kernel_window_ms']} ms, masked SDPA "
                  f"{r['sdpa_window_mask_ms']} ms ({r['sdpa_over_kernel']}x), whole context "
                  f"{r['kernel_whole_context_ms']} ms ({r['whole_over_window']}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
