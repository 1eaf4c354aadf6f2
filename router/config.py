"""Router configuration: one dataclass, built from `pdserve router` flags."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RouterConfig:
    """Everything the router needs; defaults work on one laptop.

    `prefill` and `decode` are static lists of Worker endpoints (HOST:PORT). The router
    never runs a model: `model` is only read for its tokenizer and config.
    """

    model: str
    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    host: str = "0.0.0.0"
    port: int = 50051
    # Where the prefill node's KV window ends, Python-style: -1 sends all but the last
    # prompt token; -k lets the decode node prefill the last k tokens itself.
    kv_window_end: int = -1
    prefill_policy: str = "round_robin"
    decode_policy: str = "round_robin"
    # How long a decode node keeps a reservation without StartGeneration or Abort.
    lease_ms: int = 30_000
    # Deadlines for the inter-node calls (seconds).
    prepare_timeout_s: float = 10.0
    remote_send_timeout_s: float = 60.0
    abort_timeout_s: float = 2.0

    def validate(self) -> None:
        if not self.decode:
            raise ValueError("the router needs at least one --decode endpoint")
        if self.lease_ms <= 0:
            raise ValueError(f"lease_ms must be > 0, got {self.lease_ms}")
