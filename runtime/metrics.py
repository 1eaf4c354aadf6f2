"""Prometheus metrics of every pdserve node (router, prefill, decode, both).

One process is one node, so every metric lives in prometheus_client's default registry and
carries the node's `role` as a label where several roles record it; Prometheus adds the
`instance`. Names (all prefixed `pdserve_`):

requests (router, decode, both; decode counts StartGeneration streams):
  requests_total{role,outcome}        outcome: "ok" or the gRPC status, lower case
  request_ttft_seconds{role}          arrival at this node -> first token (histogram)
  request_tpot_seconds{role}          mean time per output token after the first (histogram)
  request_e2e_seconds{role}           arrival -> stream end (histogram)
  prompt_tokens_total{role}, generation_tokens_total{role}
queues and KV pages (sampled when /metrics is scraped):
  queue_depth{role,queue}             router: in_flight, queued; workers: waiting, running,
                                      parked, page_line (decode: waiting for KV pages), remote_send
  queue_time_seconds{role}            router: admission wait; decode: wait for KV pages (histogram)
  kv_pages_used{role}, kv_pages_free{role}, kv_pages_total{role}
  prefix_cache_query_tokens_total{role}, prefix_cache_hit_tokens_total{role},
  prefix_cache_hit_rate{role}         hit tokens / looked-up tokens since start
KV transfer (prefill node, one observation per RemoteSend):
  kv_transfers_total{outcome}, kv_transfer_bytes_total, kv_transfer_descriptors_total,
  kv_transfer_tokens_total, kv_transfer_seconds, kv_transfer_descriptors,
  kv_transfer_bandwidth_bytes_per_second, prefill_seconds (histograms)
start (workers):
  c_kernels{state,reason}             1 on the path the CPU kernels take: state "c", "torch"
                                      or "partial" (reason: disabled, no_compiler, not_linux,
                                      build_failed), "unused" off the CPU
router:
  router_retries_total{call}, router_fallbacks_total{reason}   see `record_retry`, `record_fallback`
  router_remote_send_skipped_total, router_prefix_matched_tokens_total
  router_endpoint_in_flight{pool,endpoint}, router_endpoint_queue{pool,endpoint},
  router_endpoint_routable{pool,endpoint}
  http_requests_total{path,status}    the OpenAI-compatible HTTP API
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, Info, disable_created_metrics, generate_latest)

disable_created_metrics()  # no `*_created` series: Prometheus handles counter resets itself

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)
DESCRIPTOR_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
BANDWIDTH_BUCKETS = tuple(10.0 ** e for e in (6, 6.5, 7, 7.5, 8, 8.5, 9, 9.5, 10, 10.5, 11))

NODE = Info("pdserve_node", "Role and model of this node")
C_KERNELS = Gauge("pdserve_c_kernels", "1 on the path this node's CPU kernels take (C or the torch "
                  "fallback) and why", ["state", "reason"])

REQUESTS = Counter("pdserve_requests", "Requests finished, by outcome", ["role", "outcome"])
TTFT = Histogram("pdserve_request_ttft_seconds", "Time to first token at this node",
                 ["role"], buckets=TTFT_BUCKETS)
TPOT = Histogram("pdserve_request_tpot_seconds", "Mean time per output token after the first",
                 ["role"], buckets=TPOT_BUCKETS)
E2E = Histogram("pdserve_request_e2e_seconds", "Arrival to end of stream at this node",
                ["role"], buckets=E2E_BUCKETS)
PROMPT_TOKENS = Counter("pdserve_prompt_tokens", "Prompt tokens of finished requests", ["role"])
GENERATION_TOKENS = Counter("pdserve_generation_tokens", "Tokens generated", ["role"])

QUEUE_TIME = Histogram("pdserve_queue_time_seconds", "Time a request waited for its turn: "
                       "router admission, decode node's line for KV pages", ["role"],
                       buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
QUEUE_DEPTH = Gauge("pdserve_queue_depth", "Requests in each queue of this node", ["role", "queue"])
KV_PAGES_USED = Gauge("pdserve_kv_pages_used", "KV pages referenced by requests", ["role"])
KV_PAGES_FREE = Gauge("pdserve_kv_pages_free", "KV pages free (evictable cached pages count)", ["role"])
KV_PAGES_TOTAL = Gauge("pdserve_kv_pages_total", "KV pages in the pool", ["role"])
PREFIX_QUERY_TOKENS = Counter("pdserve_prefix_cache_query_tokens",
                              "Prompt tokens looked up in the prefix cache", ["role"])
PREFIX_HIT_TOKENS = Counter("pdserve_prefix_cache_hit_tokens",
                            "Prompt tokens found in the prefix cache (KV not recomputed)", ["role"])
PREFIX_HIT_RATE = Gauge("pdserve_prefix_cache_hit_rate",
                        "Prefix-cache hit tokens / looked-up tokens since start", ["role"])

KV_TRANSFERS = Counter("pdserve_kv_transfers", "RemoteSends (prefill + KV write), by outcome",
                       ["outcome"])
KV_TRANSFER_BYTES = Counter("pdserve_kv_transfer_bytes", "KV bytes written to decode nodes")
KV_TRANSFER_DESCRIPTORS = Counter("pdserve_kv_transfer_descriptors",
                                  "NIXL memory descriptors written")
KV_TRANSFER_TOKENS = Counter("pdserve_kv_transfer_tokens", "Token positions whose KV was sent")
KV_TRANSFER_SECONDS = Histogram("pdserve_kv_transfer_seconds", "Duration of one request's KV write",
                                buckets=TRANSFER_BUCKETS)
KV_TRANSFER_DESCRIPTORS_PER = Histogram("pdserve_kv_transfer_descriptors_per_transfer",
                                        "Descriptors in one request's KV write",
                                        buckets=DESCRIPTOR_BUCKETS)
KV_TRANSFER_BANDWIDTH = Histogram("pdserve_kv_transfer_bandwidth_bytes_per_second",
                                  "Bytes / seconds of one request's KV write",
                                  buckets=BANDWIDTH_BUCKETS)
PREFILL_SECONDS = Histogram("pdserve_prefill_seconds", "Prefill compute time of one RemoteSend",
                            buckets=TTFT_BUCKETS)
LEASES_EXPIRED = Gauge("pdserve_decode_leases_expired", "Reservations freed by lease expiry since start")
PREEMPTIONS = Gauge("pdserve_preemptions", "Sequences preempted since start (pages freed, KV recomputed "
                    "later): for room, or for a request of a better priority", ["role"])

ROUTER_RETRIES = Counter("pdserve_router_retries", "Calls the router retried on another node", ["call"])
ROUTER_FALLBACKS = Counter("pdserve_router_fallbacks", "Requests served by a fallback path", ["reason"])
ROUTER_SKIPPED_SENDS = Counter("pdserve_router_remote_send_skipped",
                               "Requests whose whole KV window was already on the decode node")
ROUTER_PREFIX_MATCHED = Counter("pdserve_router_prefix_matched_tokens",
                                "Prompt tokens the decode node found in its prefix cache")
ENDPOINT_IN_FLIGHT = Gauge("pdserve_router_endpoint_in_flight", "Router calls in flight per worker",
                           ["pool", "endpoint"])
ENDPOINT_QUEUE = Gauge("pdserve_router_endpoint_queue",
                       "Requests queued or running on a worker as the router sees them (its own "
                       "plus what the worker's last load report showed beyond them)",
                       ["pool", "endpoint"])
ENDPOINT_ROUTABLE = Gauge("pdserve_router_endpoint_routable", "1 if the router routes to the worker",
                          ["pool", "endpoint"])
HTTP_REQUESTS = Counter("pdserve_http_requests", "HTTP requests answered", ["path", "status"])


def record_retry(call: str) -> None:
    """Count one retry by the router: `call` is the RPC retried on another node
    ("RemoteSend", "PrepareReceive", ...). Call it once per extra attempt, where the
    dispatcher decides to try again (router/dispatch.py)."""
    ROUTER_RETRIES.labels(call=call).inc()


def record_fallback(reason: str) -> None:
    """Count one request served by a fallback path: reason="decode_prefill" when every
    RemoteSend attempt failed and the decode node prefills the prompt itself,
    "no_prefill" when no prefill node was routable for a request that needed one,
    "lease_ended" when its reservation's lease ended just before StartGeneration reached
    D. Call it once per request, where the dispatcher takes the fallback (router/dispatch.py)."""
    ROUTER_FALLBACKS.labels(reason=reason).inc()


_prefix_totals: dict[str, list[int]] = {}  # role -> [looked up, hit], for the rate gauge


def record_prefix_lookup(role: str, looked_up: int, hit: int) -> None:
    PREFIX_QUERY_TOKENS.labels(role=role).inc(looked_up)
    PREFIX_HIT_TOKENS.labels(role=role).inc(hit)
    totals = _prefix_totals.setdefault(role, [0, 0])
    totals[0] += looked_up
    totals[1] += hit
    PREFIX_HIT_RATE.labels(role=role).set(totals[1] / totals[0] if totals[0] else 0.0)


def record_transfer(num_bytes: int, num_descriptors: int, num_tokens: int, prefill_s: float,
                    transfer_s: float) -> None:
    """One successful RemoteSend on a prefill node."""
    KV_TRANSFERS.labels(outcome="ok").inc()
    KV_TRANSFER_BYTES.inc(num_bytes)
    KV_TRANSFER_DESCRIPTORS.inc(num_descriptors)
    KV_TRANSFER_TOKENS.inc(num_tokens)
    KV_TRANSFER_SECONDS.observe(transfer_s)
    KV_TRANSFER_DESCRIPTORS_PER.observe(num_descriptors)
    if transfer_s > 0:
        KV_TRANSFER_BANDWIDTH.observe(num_bytes / transfer_s)
    PREFILL_SECONDS.observe(prefill_s)


def set_c_kernels(state: str, reason: str) -> None:
    """Once at a worker's start: "c", "torch", "partial" (with why) or "unused"."""
    C_KERNELS.labels(state=state, reason=reason).set(1)


def set_pages(role: str, free: int, total: int) -> None:
    KV_PAGES_FREE.labels(role=role).set(free)
    KV_PAGES_TOTAL.labels(role=role).set(total)
    KV_PAGES_USED.labels(role=role).set(total - free)


def exposition() -> tuple[bytes, str]:
    """The text exposition of every metric of this process, and its content type."""
    return generate_latest(), CONTENT_TYPE_LATEST
