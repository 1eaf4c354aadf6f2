"""What the prefill role is asked and what it answers: one dataclass per request kind
(`RemoteSend`, `OverlappedSend`), the decode node's half of a send (`Window`), the result
of a send and the role's load. Plain data; the role checks every value it uses."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.prefill.peers import PeerRef


@dataclass
class Window:
    """What a send needs from the decode node's PrepareReceive. `lease_deadline` is on this
    node's monotonic clock: receipt + the lease time left (no other node's clock is read).
    `capability` is D's signature over the window (runtime/cluster_key.py `window_fields`)."""

    begin: int
    kv_append_metadata: list[int]
    lease_id: str
    decode: PeerRef
    lease_deadline: float
    lease_ms: int = 0
    capability: bytes = b""
    issued_unix_ms: int = 0


@dataclass
class RemoteSend:
    request_id: str
    prompt_token_ids: list[int]
    kv_window_end: int  # Python-style
    window: Window
    timeout_s: float | None = None  # the caller's deadline
    cache_salt: str = ""  # whose cached pages its prefill may use (engine/prefix_cache.py)
    priority: int = 0  # lower waits less in the engine's line
    lora: str = ""  # the LoRA adapter its prefill runs with (engine/lora.py); "": none


@dataclass
class OverlappedSend:
    request_id: str
    prompt_token_ids: list[int]
    kv_window_end: int  # Python-style; the rest of the window comes by deliver_window
    timeout_s: float | None = None
    cache_salt: str = ""
    priority: int = 0
    lora: str = ""


@dataclass
class SendResult:
    kv_window_begin: int  # absolute
    kv_window_end: int
    num_bytes: int
    num_descriptors: int
    prefill_cached_tokens: int
    prefill_s: float
    transfer_s: float  # from the prefill's end to the notification: what a layer-wise send leaves
    num_writes: int = 1  # NIXL WRITEs: one for a whole window, several for a layer-wise one

    @property
    def num_tokens_sent(self) -> int:
        return self.kv_window_end - self.kv_window_begin


@dataclass
class PrefillLoad:
    """Each field is named as its `LoadReport` field: worker/service.py converts by name."""

    num_running: int
    remote_sends_total: int
    last_kv_window_begin: int
    kv_bytes_sent_total: int
