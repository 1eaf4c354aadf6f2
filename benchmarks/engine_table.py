"""The table `pdserve bench engine` prints without --json."""

from __future__ import annotations


def print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    m, peer = report["model"], report.get("peer")
    rows = report["workloads"]
    with_hf = "transformers_s" in rows[0]
    against = [*(["transformers generate"] if with_hf else []),
               *([f"vLLM {peer['version']}"] if peer else [])]
    title = (f"pdserve vs {' and '.join(against)}: {m['name']} ({m['parameters'] / 1e6:.0f}M params), "
             f"{report['dtype']}, {report['threads']} threads; start-up pdserve "
             f"{report['engine_startup_s']:.1f} s")
    if peer:
        title += f", vLLM {peer['startup_s']:.1f} s"
    columns = ["workload", "prompts", "generated", "pdserve tok/s"]
    if with_hf:
        columns += ["transformers tok/s", "speedup", "greedy match"]
    if peer:
        columns += ["vLLM tok/s", "pdserve/vLLM", "vLLM match"]
    table = Table(title=title)
    for col in columns:
        table.add_column(col, justify="right")
    for r in rows:
        cells = [r["workload"], str(r["num_prompts"]), str(r["generated_tokens"]),
                 f"{r['engine_tokens_per_s']:.1f}"]
        if with_hf:
            cells += [f"{r['transformers_tokens_per_s']:.1f}", f"{r['speedup']:.2f}x",
                      f"{r['greedy_match']:.0%}"]
        if peer:
            cells += [f"{r['peer_tokens_per_s']:.1f}", f"{r['peer_ratio']:.2f}x", f"{r['peer_match']:.0%}"]
        table.add_row(*cells)
    Console().print(table)


def print_tp_table(report: dict) -> None:
    """TP = N against TP = 1 (`benchmarks.engine_tp`), with the threads each ran."""
    from rich.console import Console
    from rich.table import Table

    m, (base, tp) = report["model"], report["runs"]
    n = tp["tensor_parallel_size"]
    title = (f"pdserve TP = {n} vs TP = 1: {m['name']} ({m['parameters'] / 1e6:.0f}M params), "
             f"{report['dtype']}, {report['cores']} cores; TP = 1: {base['threads_per_rank']} threads, "
             f"TP = {n}: {n} ranks x {tp['threads_per_rank']} threads; start-up "
             f"{base['engine_startup_s']:.1f} s and {tp['engine_startup_s']:.1f} s")
    table = Table(title=title, caption=f"ratio: TP = {n} over TP = 1, of tok/s (higher is better) "
                                       "and of decode step ms (lower is better)")
    for col in ("workload", "prompts", "generated", "TP = 1 tok/s", f"TP = {n} tok/s", "ratio", "greedy match"):
        table.add_column(col, justify="right")
    for r in report["workloads"]:
        table.add_row(r["workload"], str(r["num_prompts"]), str(r["generated_tokens"]),
                      f"{r['baseline_tokens_per_s']:.1f}", f"{r['tp_tokens_per_s']:.1f}",
                      f"{r['tp_ratio']:.2f}x", f"{r['greedy_match']:.0%}")
    for s in report.get("decode_steps", []):
        table.add_row(f"decode step at batch {s['batch']}", "", "", f"{s['baseline_median_ms']:.1f} ms",
                      f"{s['tp_median_ms']:.1f} ms", f"{s['tp_ratio']:.2f}x", "")
    Console().print(table)
