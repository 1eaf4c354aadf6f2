"""The OpenAI backend against a fake SSE server: what it sends, what it times."""

import asyncio

from pdserve.benchmarks.serve.backends import OpenAIBackend, completions_url
from pdserve.benchmarks.serve.load import run_load
from pdserve.benchmarks.serve.metrics import summarize
from pdserve.benchmarks.serve.workload import BenchRequest, synthetic
from tests.benchmarks.fake_openai import FakeOpenAI


def test_completions_url_accepts_a_base_or_the_endpoint():
    assert completions_url("http://h:8000") == "http://h:8000/v1/completions"
    assert completions_url("http://h:8000/v1/") == "http://h:8000/v1/completions"
    assert completions_url("http://h/v1/completions") == "http://h/v1/completions"


def test_openai_backend_streams_times_tokens_and_reads_the_model_name():
    async def go():
        async with FakeOpenAI(gap_s=0.02) as server:
            backend = OpenAIBackend(server.url)
            try:
                limits = await backend.limits()
                requests = synthetic(3, (4, 8), (5, 5), vocab_size=100, seed=0)
                run = await run_load(backend, requests, float("inf"))
                bad = await backend.send(BenchRequest([0], 1, 3))
            finally:
                await backend.close()
            return limits, run, bad, server.bodies

    limits, run, bad, bodies = asyncio.run(asyncio.wait_for(go(), 30))
    assert limits.model == "fake-model"
    body = bodies[0]
    assert body["model"] == "fake-model" and body["stream"] is True
    assert body["ignore_eos"] is True and body["temperature"] == 0.0
    assert body["max_tokens"] == 5 and all(isinstance(t, int) for t in body["prompt"])
    s = summarize(run.results)
    assert (s["completed"], s["output_tokens"]) == (3, 15)
    # Lower bounds only: the server sleeps 20 ms before each token, and a loaded machine
    # only adds to that.
    assert s["ttft_ms"]["median"] >= 15          # first token after one 20 ms gap
    for r in run.results:  # the fifth token came after five gaps
        assert r.ttft + r.tpot * (r.output_tokens - 1) >= 5 * 0.019
    assert not bad.ok and "HTTP 400" in bad.error and "bad prompt" in bad.error
