"""Router configuration: one dataclass, built from `pdserve router` flags."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RouterConfig:
    """Everything the router needs; defaults work on one laptop.

    `prefill` and `decode` are static lists of Worker endpoints (HOST:PORT, or
    dns:///NAME:PORT); with `etcd`, the workers registered under `etcd_prefix` join them
    (router/etcd_discovery.py). The router never runs a model: `model` is only read for its
    tokenizer and config. Routing rules: router/policies.py; when D prefills by itself:
    router/selective.py.
    """

    model: str
    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    host: str = "0.0.0.0"
    port: int = 50051
    # OpenAI-compatible API and Prometheus /metrics over HTTP; None: no HTTP server.
    http_port: int | None = None
    # Where the prefill node's KV window ends, Python-style: -1 sends all but the last
    # prompt token; -k lets the decode node prefill the last k tokens itself; "auto" picks
    # k from the current load (router/selective.py).
    kv_window_end: int | str = -1
    prefill_policy: str = "round_robin"
    decode_policy: str = "round_robin"
    # prefix_aware: one queued request weighs as much as this many uncached prompt tokens.
    prefix_load_tokens: int = 128
    # Selective disaggregation (router/selective.py): D prefills the prompt itself when it
    # lacks at most this many tokens of the window (0: only when it lacks none) ...
    min_remote_prefill_tokens: int = 0
    # ... or when every prefill node has at least this many requests queued (0: never).
    prefill_saturated_queue: int = 64
    # kv_window_end "auto": D prefills at most this fraction of the prompt.
    auto_max_tail: float = 0.5
    # Send RemoteSend before PrepareReceive so P computes while D reserves.
    overlap_prefill: bool = True
    # GetLoad polling of every node (router/load.py); slower while the router is idle.
    load_interval_s: float = 0.1
    load_idle_interval_s: float = 1.0
    # etcd discovery: HOST:PORT of an etcd server ("" = none) and the key prefix.
    etcd: str = ""
    etcd_prefix: str = "/pdserve/workers"
    # How long a decode node keeps a reservation without StartGeneration or Abort.
    lease_ms: int = 30_000
    # Deadlines for the inter-node calls (seconds).
    prepare_timeout_s: float = 10.0
    remote_send_timeout_s: float = 60.0
    abort_timeout_s: float = 2.0
    generation_timeout_s: float = 600.0  # a whole StartGeneration stream
    # Prefill nodes tried for one request before the decode node prefills it itself.
    max_prefill_attempts: int = 2
    # While every decode node answers RESOURCE_EXHAUSTED, retry for this long.
    full_retry_s: float = 5.0
    # Requests dispatched at once, and how many more may wait for a turn; past both,
    # RESOURCE_EXHAUSTED.
    max_concurrent_requests: int = 256
    max_queued_requests: int = 4096
    # Health checks of a node that failed as if gone (every this many seconds while down).
    health_interval_s: float = 1.0
    # On SIGTERM: how long in-flight streams may take to finish before the router stops.
    drain_timeout_s: float = 30.0

    def validate(self) -> None:
        if not self.decode and not self.etcd:
            raise ValueError("the router needs at least one --decode endpoint or --etcd")
        if isinstance(self.kv_window_end, str) and self.kv_window_end != "auto":
            raise ValueError(f"kv_window_end must be an int or 'auto', got {self.kv_window_end!r}")
        if not 0.0 <= self.auto_max_tail < 1.0:
            raise ValueError(f"auto_max_tail must be in [0, 1), got {self.auto_max_tail}")
        if self.lease_ms <= 0:
            raise ValueError(f"lease_ms must be > 0, got {self.lease_ms}")
        if self.max_concurrent_requests < 1 or self.max_queued_requests < 0:
            raise ValueError("max_concurrent_requests must be >= 1 and max_queued_requests "
                             f">= 0, got {self.max_concurrent_requests}, "
                             f"{self.max_queued_requests}")
