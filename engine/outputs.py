"""What the engine hands back: per-step deltas of each request (`RequestOutput`), and the
slots a decode node reserved for incoming KV (`Reservation`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One sample of a request. `token_ids`/`text` are everything so far; `new_*` is what
    this step added. `logprobs` is a list of the sampler's `Sample` (token_id, logprob,
    top_logprobs) per output token, or None when not asked for."""

    index: int
    token_ids: list[int]
    text: str
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    finish_reason: str | None = None  # "stop" | "length" | "prefilled" | "abort"
    logprobs: list | None = None


@dataclass
class RequestOutput:
    request_id: str
    outputs: list[CompletionOutput]
    finished: bool
    num_prompt_tokens: int
    num_cached_tokens: int
    queued_s: float = 0.0   # from add_request to its first scheduled step
    prefill_s: float = 0.0  # from then to its first token (or, prefill-only, its last prompt KV)
    # A prefill-only request's "prefilled" output: the slot of every prompt position (what
    # `Engine.slots_of` says), so the role writes its KV without another engine call, and
    # on a GPU the CUDA event to wait for before reading that KV (None: it is in memory).
    slots: list[int] | None = None
    kv_ready: object = None

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


@dataclass
class Reservation:
    """Slots reserved by `Engine.prepare_receive`: `slots[i]` receives the KV of position
    `prefix_matched_length + i`, up to `kv_window_end` (exclusive)."""

    request_id: str
    prefix_matched_length: int
    kv_window_end: int
    slots: list[int]
