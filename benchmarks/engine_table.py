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
