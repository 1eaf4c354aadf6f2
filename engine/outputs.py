"""What the engine hands back: per-step deltas of each request (`RequestOutput`), and the
slots a decode node reserved for incoming KV (`Reservation`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


class GrowingListView(Sequence):
    """items[begin:end] of a list that only grows, read when asked for. A delta carries its
    sequence's output ids and logprobs so far this way: copying them into every delta
    would cost each step as much as the output is long."""

    __slots__ = ("_items", "_range")

    def __init__(self, items: list, begin: int, end: int):
        self._items, self._range = items, range(begin, end)

    def __len__(self) -> int:
        return len(self._range)

    def __getitem__(self, key):
        r = self._range[key]
        return self._items[r] if isinstance(r, int) else [self._items[i] for i in r]

    def __iter__(self):
        return iter(self._items[self._range.start:self._range.stop])

    def __eq__(self, other) -> bool:
        return isinstance(other, (list, GrowingListView)) and list(self) == list(other)  # as a list compares

    def __repr__(self) -> str:
        return repr(list(self))


@dataclass
class CompletionOutput:
    """One sample of a request. `token_ids`/`text` are everything so far; `new_*` is what
    this step added. `logprobs` is a list of the sampler's `Sample` (token_id, logprob,
    top_logprobs) per output token, or None when not asked for. In the output that finishes
    the sample, `token_ids` and `logprobs` are lists; before, read-only views of them."""

    index: int
    token_ids: list[int] | GrowingListView
    text: str
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    finish_reason: str | None = None  # "stop" | "length" | "prefilled" | "abort"
    logprobs: list | GrowingListView | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it


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
    # Asked for (params.prompt_logprobs) and all known: the sampler's `Sample` of each
    # prompt token after the first, in every later output.
    prompt_logprobs: list | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> str | int | None:
        return self.outputs[0].stop_reason


@dataclass
class Reservation:
    """Slots reserved by `Engine.prepare_receive`: `slots[i]` receives the KV of position
    `prefix_matched_length + i`, up to `kv_window_end` (exclusive)."""

    request_id: str
    prefix_matched_length: int
    kv_window_end: int
    slots: list[int]
