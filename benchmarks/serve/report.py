"""Human-readable tables of benchmark results (the JSON holds everything; these hold what
a reader compares first)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table


def _f(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _rate(value) -> str:
    return "inf" if value is None else f"{value:g}"


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


def show(*tables: Table) -> None:
    console = Console()
    if not console.is_terminal:  # a file or pipe: no reason to wrap at 80 columns
        console = Console(width=200)
    for table in tables:
        console.print(table)
