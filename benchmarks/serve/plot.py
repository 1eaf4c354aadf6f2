"""Figures of a rate sweep: latency percentiles against request rate, and the 1P1D vs
colocated comparison. matplotlib runs headless (Agg); each function writes one PNG."""

from __future__ import annotations

LATENCIES = (("ttft_ms", "time to first token"), ("tpot_ms", "time per output token"),
             ("itl_ms", "inter-token latency"), ("e2e_ms", "end-to-end latency"))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _x(rows: list[dict]) -> tuple[list[float], str]:
    """The offered rate, or the achieved one where the offer was unbounded."""
    if all(r["request_rate"] is not None for r in rows):
        return [r["request_rate"] for r in rows], "request rate (req/s)"
    return [r["request_throughput"] for r in rows], "achieved throughput (req/s)"


def plot_sweep(rows: list[dict], path: str, title: str = "") -> None:
    plt = _pyplot()
    x, xlabel = _x(rows)
    fig, axes = plt.subplots(2, 2, figsize=(11, 8), sharex=True)
    for ax, (key, label) in zip(axes.flat, LATENCIES):
        for stat, style in (("median", "o-"), ("p90", "s--"), ("p99", "^:")):
            ax.plot(x, [r[key][stat] for r in rows], style, label=stat)
        ax.set_title(label)
        ax.set_ylabel("ms")
        ax.grid(alpha=0.3)
        ax.legend()
    for ax in axes[1]:
        ax.set_xlabel(xlabel)
    fig.suptitle(title or "pdserve bench serve: latency percentiles against request rate")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_compare(rows: list[dict], names: tuple[str, str], objectives: dict, path: str,
                 title: str = "") -> None:
    """p90 TTFT and TPOT (with the objectives drawn), and goodput under both objectives."""
    plt = _pyplot()
    x = [r["request_rate"] for r in rows]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8), sharex=True)
    panels = (("ttft_ms", "p90 time to first token (ms)"), ("tpot_ms", "p90 time per output token (ms)"),
              ("goodput_strict", "goodput, strict objective (req/s)"),
              ("goodput_loose", "goodput, loose objective (req/s)"))
    for ax, (key, label) in zip(axes.flat, panels):
        for name, style in zip(names, ("o-", "s--")):
            values = [r[name][key]["p90"] if key.endswith("_ms") else r[name][key] for r in rows]
            ax.plot(x, values, style, label=name)
        if key.endswith("_ms"):
            for kind, color in (("strict", "tab:red"), ("loose", "tab:orange")):
                ax.axhline(objectives[kind][key], color=color, lw=0.8, ls=":",
                           label=f"{kind} objective")
        ax.set_title(label)
        ax.grid(alpha=0.3)
        ax.legend()
    for ax in axes[1]:
        ax.set_xlabel("request rate (req/s, Poisson)")
    fig.suptitle(title or f"{names[0]} vs {names[1]}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
