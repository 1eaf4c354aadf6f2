"""Human-readable benchmark results (the JSON holds everything; these hold what a reader
compares first): one block per run in the layout of vLLM's `benchmark_serving`, so the
numbers read side by side with its, and tables across runs and systems."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table


def _f(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _rate(value) -> str:
    return "inf" if value is None else f"{value:g}"


BLOCK_WIDTH = 50
LATENCIES = (("ttft_ms", "TTFT", "Time to First Token"),
             ("tpot_ms", "TPOT", "Time per Output Token (excl. 1st token)"),
             ("itl_ms", "ITL", "Inter-token Latency"))


def summary_block(row: dict, target: str) -> str:
    """One run (a row of `runs.run_row`): requests, tokens and throughputs, then TTFT,
    TPOT and ITL mean, median and p99 in ms ("-": no value, e.g. no request completed)."""
    def line(name: str, value) -> str:
        text = "-" if value is None else f"{value:.2f}" if isinstance(value, float) else value
        return f"{name + ':':<40} {text}"

    lines = [f"{' Serving Benchmark Result ':=^{BLOCK_WIDTH}}",
             line("Target", target),
             line("Request rate (req/s)", _rate(row["request_rate"])),
             line("Max concurrency", row["max_concurrency"] or "-"),
             line("Successful requests", row["completed"]),
             line("Failed requests", row["failed"]),
             line("Benchmark duration (s)", float(row["duration_s"])),
             line("Total input tokens", row["input_tokens"]),
             line("Total generated tokens", row["output_tokens"]),
             line("Request throughput (req/s)", row["request_throughput"]),
             line("Output token throughput (tok/s)", row["output_throughput"]),
             line("Total token throughput (tok/s)", row["total_token_throughput"])]
    if "goodput" in row:
        lines.append(line("Request goodput (req/s)", row["goodput"]))
    if "good_requests" in row:
        lines.append(line("Requests meeting every objective",
                          f"{row['good_requests']} of {row['num_requests']}"))
    for key, short, name in LATENCIES:
        stats = row[key]
        lines += [f"{name:-^{BLOCK_WIDTH}}", line(f"Mean {short} (ms)", stats["mean"]),
                  line(f"Median {short} (ms)", stats["median"]),
                  line(f"P99 {short} (ms)", stats["p99"])]
    if row.get("errors"):
        lines += [f"{'Errors':-^{BLOCK_WIDTH}}", *row["errors"]]
    return "\n".join([*lines, "=" * BLOCK_WIDTH])


def sweep_table(rows: list[dict], title: str) -> Table:
    """One line per run: the offered rate, throughput, latency percentiles, goodput."""
    with_goodput = any("goodput" in r for r in rows)
    table = Table(title=title)
    for name in ("rate", "conc", "done", "req/s", "out tok/s", "TTFT ms med/p90/p99",
                 "TPOT ms med/p90/p99", "ITL ms p90", "E2E ms p90", "goodput")[:10 if with_goodput else 9]:
        table.add_column(name, justify="right")
    for r in rows:
        ttft, tpot = r["ttft_ms"], r["tpot_ms"]
        cells = (
            _rate(r["request_rate"]), str(r["max_concurrency"] or "-"),
            f"{r['completed']}/{r['num_requests']}", _f(r["request_throughput"], 3),
            _f(r["output_throughput"]),
            f"{_f(ttft['median'])} / {_f(ttft['p90'])} / {_f(ttft['p99'])}",
            f"{_f(tpot['median'])} / {_f(tpot['p90'])} / {_f(tpot['p99'])}",
            _f(r["itl_ms"]["p90"]), _f(r["e2e_ms"]["p90"]), _f(r.get("goodput"), 3))
        table.add_row(*cells[:10 if with_goodput else 9])
    return table


def compare_table(rows: list[dict], names: tuple[str, str]) -> Table:
    """Both systems side by side at each rate, with the ratios (first over second)."""
    a, b = names
    table = Table(title=f"{a} vs {b} (ratios are {a} / {b})")
    for name in ("rate", f"TTFT p90 ms {a}|{b}", f"TPOT p90 ms {a}|{b}",
                 f"goodput strict {a}|{b}", f"goodput loose {a}|{b}",
                 "tpot_p90_ratio", "goodput_ratio_strict", "goodput_ratio_loose"):
        table.add_column(name, justify="right")
    for r in rows:
        x, y = r[a], r[b]
        table.add_row(
            _rate(r["request_rate"]),
            f"{_f(x['ttft_ms']['p90'])} | {_f(y['ttft_ms']['p90'])}",
            f"{_f(x['tpot_ms']['p90'])} | {_f(y['tpot_ms']['p90'])}",
            f"{_f(x['goodput_strict'], 3)} | {_f(y['goodput_strict'], 3)}",
            f"{_f(x['goodput_loose'], 3)} | {_f(y['goodput_loose'], 3)}",
            _f(r["tpot_p90_ratio"], 2), _f(r["goodput_ratio_strict"], 2),
            _f(r["goodput_ratio_loose"], 2))
    return table


def peer_table(rows: list[dict], names) -> Table:
    """Every system at each rate in the units of the issue tables: seconds for TTFT and
    ITL p99, ms for TPOT; goodput against the fixed objectives, with its fraction."""
    table = Table(title="all systems (goodput: fixed --slo-* objectives)")
    for name in ("rate", "system", "done", "req/s", "TTFT s p50/p90", "TPOT ms p50/p90",
                 "ITL s p99", "goodput req/s", "good"):
        table.add_column(name, justify="right")
    s = lambda ms: None if ms is None else ms / 1000  # noqa: E731
    for r in rows:
        for name in names:
            x = r[name]
            ttft, tpot = x["ttft_ms"], x["tpot_ms"]
            table.add_row(_rate(r["request_rate"]), name, f"{x['completed']}/{x['num_requests']}",
                          _f(x["request_throughput"], 3),
                          f"{_f(s(ttft['median']))} / {_f(s(ttft['p90']))}",
                          f"{_f(tpot['median'], 0)} / {_f(tpot['p90'], 0)}",
                          _f(s(x["itl_ms"]["p99"]), 2), _f(x.get("goodput"), 3),
                          _f(x.get("goodput_fraction"), 2))
    return table


def show(*tables: Table) -> None:
    console = Console()
    if not console.is_terminal:  # a file or pipe: no reason to wrap at 80 columns
        console = Console(width=200)
    for table in tables:
        console.print(table)
