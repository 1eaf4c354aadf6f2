"""`--log-format json`: every line a node writes parses as JSON, and one request leaves
exactly one `pdserve.request` line on each node it passed through, with its id, outcome
and phase timings."""

from __future__ import annotations

import json

from pdserve.client import AsyncClient
from tests.cluster.nodes import run
from tests.cluster.nodes import wait_until


def request_lines(cluster, node: str, request_id: str) -> list[dict]:
    lines = [json.loads(line) for line in cluster.log_lines(node) if line.startswith("{")]
    return [r for r in lines if r["logger"] == "pdserve.request" and r["request_id"] == request_id]


def test_json_logs_parse_and_hold_one_line_per_request_per_node(cluster):
    c = cluster

    async def ask():
        async with AsyncClient(c.grpc) as client:
            return await client.generate("logs of one request", request_id="log-me-1",
                                         temperature=0.0, max_tokens=3, ignore_eos=True)

    run(ask())
    for node in ("router", "prefill", "decode"):
        wait_until(lambda: request_lines(c, node, "log-me-1"), f"the {node}'s line for log-me-1")
    for node in ("router", "prefill", "decode"):
        lines = c.log_lines(node)
        records = [json.loads(line) for line in lines if line.strip()]  # every line is JSON
        assert all({"ts", "level", "logger", "message"} <= r.keys() for r in records)

    (router,) = request_lines(c, "router", "log-me-1")
    assert router["outcome"] == "length" and router["role"] == "router"
    assert 0 < router["ttft_s"] <= router["e2e_s"] and router["completion_tokens"] == 3
    assert router["decode"] == c.address("decode")
    (prefill,) = request_lines(c, "prefill", "log-me-1")
    assert prefill["outcome"] == "ok" and prefill["transfer_s"] >= 0 and prefill["kv_bytes"] > 0
    (decode,) = request_lines(c, "decode", "log-me-1")
    assert decode["outcome"] == "length" and decode["prepare_receive_s"] > 0
    assert 0 < decode["ttft_s"] <= decode["e2e_s"]
