"""Router configuration: one dataclass; its fields are the `pdserve router` flags."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.runtime.options import option
from pdserve.router.turns import parse_weights
from pdserve.runtime.server import ServerConfig

POLICY_NAMES = ("round_robin", "least_loaded", "prefix_aware")


def window_end(value: str) -> int | str:
    """`--kv-window-end`: an int (-k) or `auto`."""
    return value if value == "auto" else int(value)


@dataclass
class RouterConfig:
    """Everything the router needs; defaults work on one laptop.

    `prefill` and `decode` are static lists of Worker endpoints (HOST:PORT, or
    dns:///NAME:PORT, comma-separated lists allowed); with `etcd`, the workers registered
    under `etcd_prefix` join them (router/etcd_discovery.py). The router never runs a
    model: `model` is only read for its tokenizer and config. Routing rules:
    router/policies.py; when D prefills by itself: router/selective.py.
    """

    model: str
    served_model_name: list[str] | None = None  # what clients call it, its own name first (None:
    # models.catalogue.served_name)
    chat_template: str | None = None  # --chat-template's text, instead of the model's (None: its own)
    tool_call_parser: str = "auto"  # --tool-call-parser: a router/tool_dialects.py dialect, or auto
    server: ServerConfig = field(default_factory=ServerConfig)
    lora_modules: list[str] = option(
        help="LoRA adapters the workers serve (their --lora-modules, NAME=DIR): a request may name "
             "one as its model, and /v1/models lists them", metavar="NAME=DIR", nargs="+",
        default_factory=list)
    prefill: list[str] = option(
        help="prefill worker endpoint (repeat or comma-separate for several)",
        metavar="HOST:PORT", default_factory=list)
    decode: list[str] = option(
        help="decode worker endpoint (repeat or comma-separate for several); required "
             "unless --etcd finds them", metavar="HOST:PORT", default_factory=list)
    http_port: int | None = option(
        None, "serve the OpenAI-compatible API (/v1/completions, /v1/chat/completions, "
              "/v1/models) and Prometheus /metrics over HTTP on this port; 0 picks a free one "
              "(default: no HTTP server)", type=int)
    peer_router: list[str] = option(
        help="another router's HTTP port (repeat or comma-separate; dns:///NAME:PORT for every "
             "address NAME has), asked for the stored responses this router lacks (router/peers.py)",
        metavar="HOST:PORT", default_factory=list)
    etcd: str = option("", "watch the workers registered in this etcd server, live, in "
                           "addition to --prefill/--decode (default: none)", metavar="HOST:PORT")
    etcd_prefix: str = option("/pdserve/workers", "key prefix the workers register under")
    kv_window_end: int | str = option(
        -1, "end of the KV window the prefill node computes, Python-style: -1 = all but the "
            "last prompt token, -k = the decode node prefills the last k; auto = pick k from "
            "the load: the longer prefill queues are relative to decode queues, the more of "
            "the tail the decode node prefills (router/selective.py)", type=window_end)
    prefill_policy: str = option(
        "round_robin", "how to pick a prefill node: in turn, fewest queued requests, or "
                       "longest cached prefix weighed against load (router/policies.py)",
        choices=POLICY_NAMES)
    decode_policy: str = option("round_robin", "how to pick a decode node (choices as "
                                               "--prefill-policy)", choices=POLICY_NAMES)
    prefix_load_tokens: int = option(
        128, "prefix_aware: one queued request on a node weighs as much as this many prompt "
             "tokens it would have to prefill")
    shared_prefix_cache: bool = option(
        False, "let tenants share cached prompt prefixes (salted by the request's cache_salt "
               "only); by default each tenant's prefix cache is its own, so no tenant can "
               "learn another's prompts from cache hits (router/cache_salt.py)")
    min_remote_prefill_tokens: int = option(
        0, "selective disaggregation: when the decode node lacks at most this many tokens of "
           "the KV window (after its cached prefix), it prefills the prompt itself instead "
           "of a RemoteSend")
    prefill_saturated_queue: int = option(
        64, "when every prefill node has at least this many requests queued, the decode "
            "node prefills the prompt itself; 0 = never")
    prefill_saturated_wait_fraction: float = option(
        0.5, "a prefill node whose recent RemoteSends took at least this share of the lease, "
             "and that has work queued, is saturated: the decode node prefills instead; 0 = never")
    disagg_policy: str = option(
        "steady", "when every prefill node is saturated: steady = the decode node prefills a "
                  "prompt only while no stream runs there and it would finish no later than a "
                  "prefill node, else the request waits here; throughput = the decode node "
                  "always takes it (more requests per second; its streams' token gaps grow up "
                  "to its --decode-itl-target-ms) (router/selective.py)",
        choices=["steady", "throughput"])
    auto_max_tail: float = option(
        0.5, "--kv-window-end auto: largest fraction of the prompt the decode node prefills "
             "itself")
    overlap_prefill: bool = option(
        True, "send RemoteSend only after PrepareReceive answered (default: send them "
              "together so the prefill node computes while the decode node reserves)")
    load_interval_s: float = option(
        0.1, "how often every node's load is polled while requests flow (see "
             "--load-idle-interval-s)")
    load_idle_interval_s: float = 5.0  # the same while the router serves nothing
    lease_ms: int = option(30_000, "lease of a decode node's reservation")
    prepare_timeout_s: float = 10.0  # deadline of a PrepareReceive (and DeliverWindow)
    remote_send_timeout_s: float = option(
        60.0, "deadline of a RemoteSend call (never past the lease)")
    abort_timeout_s: float = 2.0
    generation_timeout_s: float = option(
        0.0, "longest one generation may run on a decode node (from StartGeneration on); "
             "then it ends as if max_tokens were reached: finish_reason \"length\", with the "
             "text so far; 0 = no limit: a request runs as long as its max_tokens and its "
             "own deadline allow")
    max_prefill_attempts: int = option(
        2, "prefill nodes tried for one request before the decode node prefills it itself")
    full_retry_s: float = option(
        5.0, "while every decode node is full, retry this long before RESOURCE_EXHAUSTED")
    max_concurrent_requests: int = option(256, "requests dispatched at once")
    max_queued_requests: int = option(
        4096, "requests waiting for a turn; more get RESOURCE_EXHAUSTED")
    max_queue_wait_s: float = option(
        60.0, "longest a request waits for its turn (a dispatch slot here, KV pages on a decode "
              "node), within its own deadline; then RESOURCE_EXHAUSTED (HTTP 429, Retry-After)")
    max_queued_requests_per_tenant: int = option(
        0, "requests of one tenant (its API key, --api-key-file) waiting for a turn; more get "
           "RESOURCE_EXHAUSTED; 0 = no bound but --max-queued-requests. Turns go round the "
           "tenants with requests waiting, so no tenant's flood delays another's by more than "
           "a turn per tenant (router/turns.py)")
    tenant_weights: str = option(
        "", "turns in a row a tenant takes when slots free, as TENANT=W,...; a tenant not "
            "named takes 1", metavar="TENANT=W,...")
    tenant_token_rate: float = option(
        0.0, "tokens per second one tenant may ask for (each request's prompt + max_tokens x "
             "n), in bursts of up to 10 s of it; past it RESOURCE_EXHAUSTED saying when to "
             "retry; 0 = no limit (router/token_rate.py)")
    health_interval_s: float = option(
        1.0, "how often a node that failed is health-checked until it passes")

    def __post_init__(self) -> None:
        self.prefill = [e for v in self.prefill for e in v.split(",") if e]
        self.decode = [e for v in self.decode for e in v.split(",") if e]
        self.peer_router = [e for v in self.peer_router for e in v.split(",") if e]

    def validate(self) -> None:
        if not self.decode and not self.etcd:
            raise ValueError("the router needs at least one --decode endpoint or --etcd")
        if isinstance(self.kv_window_end, str) and self.kv_window_end != "auto":
            raise ValueError(f"kv_window_end must be an int or 'auto', got {self.kv_window_end!r}")
        if not 0.0 <= self.auto_max_tail < 1.0:
            raise ValueError(f"auto_max_tail must be in [0, 1), got {self.auto_max_tail}")
        if self.generation_timeout_s < 0:
            raise ValueError(f"generation_timeout_s must be >= 0 (0: no limit), got "
                             f"{self.generation_timeout_s}")
        if self.lease_ms <= 0:
            raise ValueError(f"lease_ms must be > 0, got {self.lease_ms}")
        if self.max_queued_requests_per_tenant < 0 or self.tenant_token_rate < 0:
            raise ValueError("max_queued_requests_per_tenant and tenant_token_rate must be >= 0 "
                             f"(0: no limit), got {self.max_queued_requests_per_tenant}, "
                             f"{self.tenant_token_rate}")
        parse_weights(self.tenant_weights)
        if self.max_concurrent_requests < 1 or self.max_queued_requests < 0:
            raise ValueError("max_concurrent_requests must be >= 1 and max_queued_requests "
                             f">= 0, got {self.max_concurrent_requests}, "
                             f"{self.max_queued_requests}")
