"""`KVCapacity`: what an Engine's KV cache can hold, fixed when the Engine is built.

Frozen, so any thread may read it: it is the one part of an Engine that a role reads from
the event loop (through `AsyncEngine.capacity`), sizing a request before it waits in line,
without a trip to the engine thread.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.arith import ceil_div

from .config import SamplingParams


@dataclass(frozen=True)
class KVCapacity:
    page_size: int
    num_pages: int
    max_model_len: int
    long_rope_from: int = 0  # LongRoPE's original context where the model's reaches past it (pdserve/context.py)

    def check_fits(self, prompt_len: int, params: SamplingParams, prefill_only: bool = False) -> None:
        """ValueError naming the numbers if a request could never fit the KV cache, even
        alone (the last token sampled is never fed back, so it needs no KV). The engine
        itself ends such a sequence with "length" when the pool is full; a decode node
        refuses it before it would wait in line for pages."""
        tokens = prompt_len if prefill_only else min(prompt_len + params.max_tokens - 1, self.max_model_len)
        pages = ceil_div(tokens, self.page_size)
        if pages > self.num_pages:
            extra = "" if prefill_only else f" plus max_tokens {params.max_tokens}"
            raise ValueError(
                f"prompt of {prompt_len} tokens{extra} needs {pages} KV pages, more than the "
                f"{self.num_pages} of this engine ({self.num_pages * self.page_size} tokens)"
            )
