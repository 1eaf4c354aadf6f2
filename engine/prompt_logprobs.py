"""A prompt's logprobs (vLLM's `prompt_logprobs`, what OpenAI's `echo` with `logprobs`
shows): the logprob of each prompt token given the ones before it.

Position p's logits score prompt token p + 1, so a request that asks computes its prompt
here whole (the scheduler takes nothing from the prefix cache for it, and the router sends
no KV window) and wants the logits of every position of each chunk (`Engine.step`). The
prompt's last position is the one that samples the first output token, as for any request.
Positions already scored (a sequence preempted and recomputed) are not scored again.
"""

from __future__ import annotations

import torch

from .sampler import token_logprobs
from .sequence import Sequence

# Rows scored at once: the log-softmax is another [rows, vocab] buffer beside the logits.
SCORE_ROWS = 128


def score_prompts(seqs: list[Sequence], wants: list[int], scored: list[bool], samples: list[bool],
                  logits: torch.Tensor) -> torch.Tensor:
    """Record the prompt logprobs of the scored sequences from their rows of `logits` (each
    sequence j has wants[j] rows, its chunk's last; num_computed is still the chunk's
    first position). Returns the rows left to sample: each sampling sequence's last."""
    sample_rows, at = [], 0
    for seq, w, score, smp in zip(seqs, wants, scored, samples):
        if score:
            _record(seq, logits[at:at + w])
        if smp:
            sample_rows.append(at + w - 1)
        at += w
    return logits[torch.tensor(sample_rows, dtype=torch.int64, device=logits.device)]


def _record(seq: Sequence, rows: torch.Tensor) -> None:
    request = seq.request
    prompt, got = request.prompt_token_ids, request.prompt_logprobs
    begin = seq.num_computed
    lo, hi = len(got), min(begin + len(rows), len(prompt) - 1)
    if begin > lo:  # (cannot happen: a scored prompt takes nothing from the cache)
        raise AssertionError(f"prompt positions [{lo}, {begin}) of {request.request_id!r} were never scored")
    for start in range(lo, hi, SCORE_ROWS):
        stop = min(start + SCORE_ROWS, hi)
        got += token_logprobs(rows[start - begin:stop - begin], prompt[start + 1:stop + 1],
                              request.params.prompt_logprobs)
