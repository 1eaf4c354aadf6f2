"""One throw-away request through a new engine before its node serves, so the first client
request finds what the second does: kernels built and loaded (the C attention kernels load
at their first step), thread pools and allocator warm, CUDA kernels compiled.

The request prefills a page and a token (so a full page and a partial one) and decodes two
tokens; afterwards the engine is as it was: no request held, every page free and the
prefix cache empty (the warm-up's pages must not look like a cached prompt to a router).
"""

from __future__ import annotations

from .config import SamplingParams

REQUEST_ID = "pdserve-warm-up"
DECODE_TOKENS = 2
MAX_STEPS = 32  # a few prefill chunks and the decodes; more only where the pool cannot hold it


def warm_up(engine) -> None:
    """On the engine's thread, before any request: run the warm-up request to its end."""
    prompt_len = max(1, min(engine.page_size + 1, engine.max_model_len - DECODE_TOKENS - 1,
                            (engine.num_total_pages() - 1) * engine.page_size))
    prompt = [i % engine.vocab_size for i in range(prompt_len)]
    params = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, ignore_eos=True)
    # Twice: the first run's steps carry the one-time costs; the second's, warm, are the
    # step budget's first measurements (engine/step_budget.py).
    for run in range(2):
        engine.add_request(REQUEST_ID, prompt, params)
        for _ in range(MAX_STEPS):
            if not engine.has_unfinished():
                break
            engine.step()
        else:  # a pool too small to finish it (preempted again and again): what ran is warm
            engine.abort(REQUEST_ID)
        engine.prefix_cache.clear()
        if run == 0:
            engine.step_budget.forget()
