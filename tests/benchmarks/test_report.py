"""The summary block of one `bench serve` run, in vLLM's benchmark_serving layout, from
hand-built timelines whose numbers are worked out here."""

from pdserve.benchmarks.serve.load import Run
from pdserve.benchmarks.serve.metrics import RequestResult, summarize
from pdserve.benchmarks.serve.report import summary_block


def test_the_summary_block_carries_counts_throughputs_and_latencies_in_vllms_layout():
    results = [
        # TTFT 100 ms, then 3 more tokens 50 ms apart: TPOT 50 ms, ITLs 50, 50, 50
        RequestResult(ok=True, prompt_len=10, output_tokens=4, start=0.0, end=0.3,
                      token_times=[0.1, 0.15, 0.2, 0.25]),
        # TTFT 300 ms, one more token 100 ms later: TPOT 100 ms, ITL 100
        RequestResult(ok=True, prompt_len=30, output_tokens=2, start=0.5, end=1.0,
                      token_times=[0.8, 0.9]),
        RequestResult(ok=False, error="UNAVAILABLE: gone", prompt_len=5, start=0.2, end=0.4),
    ]
    row = {**Run(2.0, "poisson", 4, results).settings(), **summarize(results)}
    block = summary_block(row, "grpc 127.0.0.1:50051 (tiny)").splitlines()
    assert block[0] == "============ Serving Benchmark Result ============"
    assert block[-1] == "=" * 50
    values = dict(line.split(":", 1) for line in block if ":" in line and "127.0.0.1" not in line)
    got = {name: value.strip() for name, value in values.items()}
    assert got == {
        "Request rate (req/s)": "2", "Max concurrency": "4",
        "Successful requests": "2", "Failed requests": "1",
        "Benchmark duration (s)": "1.00",  # first send 0.0 to last end 1.0
        "Total input tokens": "40", "Total generated tokens": "6",
        "Request throughput (req/s)": "2.00", "Output token throughput (tok/s)": "6.00",
        "Total token throughput (tok/s)": "46.00",
        "Mean TTFT (ms)": "200.00", "Median TTFT (ms)": "200.00", "P99 TTFT (ms)": "298.00",
        "Mean TPOT (ms)": "75.00", "Median TPOT (ms)": "75.00", "P99 TPOT (ms)": "99.50",
        "Mean ITL (ms)": "62.50", "Median ITL (ms)": "50.00", "P99 ITL (ms)": "98.50",
        "UNAVAILABLE": "gone"}
    assert block[1] == f"{'Target:':<40} grpc 127.0.0.1:50051 (tiny)"
    for section in ("Time to First Token", "Time per Output Token (excl. 1st token)",
                    "Inter-token Latency", "Errors"):
        assert any(line.strip("-") == section for line in block), section


def test_goodput_shows_only_when_the_run_had_objectives():
    results = [RequestResult(ok=True, prompt_len=4, output_tokens=1, start=0.0, end=0.5,
                             token_times=[0.5])]
    row = {**Run(float("inf"), "poisson", None, results).settings(), **summarize(results)}
    assert "goodput" not in summary_block(row, "t")
    block = summary_block({**row, "goodput": 2.0}, "t")
    assert f"{'Request goodput (req/s):':<40} 2.00" in block.splitlines()
    assert f"{'Request rate (req/s):':<40} inf" in block.splitlines()
    assert f"{'Mean TPOT (ms):':<40} -" in block.splitlines()  # one token: no TPOT
