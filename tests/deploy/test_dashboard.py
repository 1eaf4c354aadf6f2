"""The Grafana dashboard in deploy/ is valid JSON and every metric it queries is one that
pdserve exports (a renamed metric would otherwise leave an empty panel)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.metrics import MetricWrapperBase

from pdserve.runtime import metrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "pdserve-dashboard.json"
SUFFIXES = {"counter": ["_total"], "histogram": ["_bucket", "_count", "_sum"], "gauge": [""],
            "info": ["_info"]}


def exported_names() -> set[str]:
    names = set()
    for obj in vars(metrics).values():
        if isinstance(obj, MetricWrapperBase):
            for family in obj.describe():
                names.update(family.name + s for s in SUFFIXES[family.type])
    return names


def test_dashboard_queries_only_exported_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    queried = {m for e in exprs for m in re.findall(r"\bpdserve_\w+", e)}
    assert len(exprs) >= 20
    assert queried - exported_names() == set()
    # the list: latency, outcomes, queues, pages, prefix hits, transfer, retries
    for name in ("pdserve_request_ttft_seconds_bucket", "pdserve_request_tpot_seconds_bucket",
                 "pdserve_request_e2e_seconds_bucket", "pdserve_requests_total",
                 "pdserve_queue_depth", "pdserve_kv_pages_used", "pdserve_kv_pages_free",
                 "pdserve_prefix_cache_hit_tokens_total", "pdserve_kv_transfer_bytes_total",
                 "pdserve_kv_transfer_seconds_bucket", "pdserve_kv_transfer_descriptors_total",
                 "pdserve_kv_transfer_bandwidth_bytes_per_second_bucket",
                 "pdserve_router_retries_total", "pdserve_router_fallbacks_total"):
        assert name in queried, name
