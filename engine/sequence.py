"""One sequence (one of a request's `n` samples) and the request that groups them.

A sequence's tokens are its prompt followed by its output. Invariants:
- `num_computed` tokens have their KV in the cache, in `pages` (position i lives in slot
  `pages[i // page_size] * page_size + i % page_size`); the pages cover at least
  `num_computed` positions.
- `num_published` full pages of `pages` are in the prefix cache (a prefix of `pages`).
- Preemption drops the pages and sets `num_computed` to 0; the tokens stay, so the KV is
  recomputed later and the output continues exactly where it was.
- `text` is the output text streamed so far; `pending_text` is decoded but held back
  because a stop string could still begin inside it (it is never retracted once sent).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from .config import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # queued for prefill (new or preempted)
    RUNNING = "running"  # scheduled every step
    PARKED = "parked"  # prepare_receive: pages reserved, KV arriving from a prefill node
    PREFILLED = "prefilled"  # prefill_only finished: pages pinned until release
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request: "Request"
    index: int  # sample index within the request
    token_ids: list[int]
    num_prompt_tokens: int
    status: Status = Status.WAITING
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_published: int = 0
    page_keys: list[int] = field(default_factory=list)  # chained keys of full pages
    # LongRoPE's long factors rotate its every position: it is longer than the original
    # context (engine/model/rope.py; its prompt, or the whole prompt a prefill node starts).
    long_rope: bool = False
    generator: torch.Generator | None = None
    sampling: object = None  # its sampler.SamplingRow, made once (the sampler reads it every step)
    detokenizer: object = None
    text: str = ""
    pending_text: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    logprobs: list | None = None
    finish_reason: str | None = None
    # vLLM's stop_reason: the stop string or stop_token_ids id that ended it ("stop", not an EOS)
    stop_reason: str | int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def cache_salt(self) -> str:
        """Its request's, and its own where the long factors rotate it: pages of both kinds never mix."""
        return self.request.cache_salt + ("\0longrope" if self.long_rope else "")

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def slot(self, position: int, page_size: int) -> int:
        return self.pages[position // page_size] * page_size + position % page_size

    def slots(self, begin: int, end: int, page_size: int) -> list[int]:
        return self.slot_array(begin, end, page_size).tolist()

    def slot_array(self, begin: int, end: int, page_size: int) -> np.ndarray:
        """Slots of positions [begin, end), int64, computed as arrays: a prefill node's layer
        hook gets those of a whole chunk every step, before the step's first kernel."""
        first = begin // page_size
        pages = np.asarray(self.pages[first:-(-end // page_size)], dtype=np.int64)
        pos = np.arange(begin, end, dtype=np.int64)
        return pages[pos // page_size - first] * page_size + pos % page_size


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prefill_only: bool = False
    arrival: int = 0
    seqs: list[Sequence] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (first admission)
    kv_window_end: int | None = None  # set by prepare_receive
    cache_salt: str = ""  # seeds its page keys: it shares cached pages only with its salt
    priority: int = 0  # lower waits less (vLLM's): its place among the waiting (engine/scheduler.py)
    lora: int = -1  # its LoRA adapter's index (engine/lora.py `Adapters`); -1: the base model
    other_samples_started: bool = False  # samples 1..n-1 queued (after sample 0's prefill)
    # perf_counter times: added, first scheduled, first token (or prefilled); 0: not yet
    added_at: float = field(default_factory=time.perf_counter)
    scheduled_at: float = 0.0
    prefilled_at: float = 0.0
    kv_ready: object = None  # prefill-only on a GPU: a CUDA event, done once its KV is in memory
    # params.prompt_logprobs: the sampler's `Sample` of prompt positions 1.. so far, in order
    prompt_logprobs: list | None = None

    @property
    def scores_prompt(self) -> bool:
        """Its prompt's logprobs are asked for and not all known yet: every position of
        the prompt is computed here (no prefix-cache hit), and each gives logits."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids) - 1

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


def step_layer_hook(hook, seqs, num_new, page_size: int):
    """The hook of a step that computes prefill-only positions, given theirs alone: the
    layer-wise sends it serves are of prefill-only requests, and a step with a hook runs
    eagerly, not as a CUDA graph (a node serving both roles decodes through graphs)."""
    if hook is None:
        return None
    ranges = [(s.request.request_id, s.num_computed, s.num_computed + n,
               s.slot_array(s.num_computed, s.num_computed + n, page_size))
              for s, n in zip(seqs, num_new) if s.request.prefill_only]
    return (lambda layer_idx: hook(layer_idx, ranges)) if ranges else None
