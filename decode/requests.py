"""What the decode role is asked (one dataclass per request kind) and what it answers."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.decode.leases import Lease
from pdserve.engine import SamplingParams


@dataclass
class PrepareReceive:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    kv_window_end: int  # Python-style
    lease_ms: int = 0   # 0: the node's default
    writer_address: str = ""  # the prefill node that will write it (asked for proof)
    caller: str = ""  # who asks (runtime/auth.py caller_of): its parked pages are bounded
    timeout_s: float | None = None  # what the caller's deadline leaves: bounds its wait in line
    cache_salt: str = ""  # whose cached pages it may match and join (engine/prefix_cache.py)
    priority: int = 0  # lower waits less in the line for pages (decode/page_line.py)
    lora: str = ""  # the LoRA adapter it generates with (engine/lora.py); "": none


@dataclass
class LocalPrefill:
    """A request this node prefills whole, from its own prefix cache (no KV received)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    lease_ms: int = 0
    cache_salt: str = ""  # as in PrepareReceive
    priority: int = 0  # lower waits less in the engine's line
    lora: str = ""  # as in PrepareReceive


@dataclass
class StartGeneration:
    request_id: str
    lease_id: str
    kv_window_begin: int  # must be the reservation's kv_window_end
    expect_kv: bool       # a prefill node wrote the window: wait for its notification
    timeout_s: float | None = None


@dataclass
class Prepared:
    lease: Lease
    kv_append_metadata: list[int]
    lease_ms: int = 0         # left at signing; covered by the capability
    capability: bytes = b""
    issued_unix_ms: int = 0


@dataclass
class DecodeLoad:
    """Each field is named as its `LoadReport` field: worker/service.py converts by name."""

    num_parked: int
    num_running: int
    requests_total: int
    prefix_hit_tokens_total: int
    leases_expired_total: int
    num_quarantined: int
    late_writes_total: int
    fenced_writers: list[str]
    fenced_pages: int
