"""Appending a sampled token to a sequence: detokenize, apply stop rules, stream text;
and handing a request's delta back (`take_delta`).

`append_token` is both halves at once; an engine that overlaps the text with the next
step's forward calls `append_token_id` when the id arrives and `append_text` a step later.

Invariants:
- A stop token (an EOS unless `ignore_eos`, or one of `stop_token_ids`) is kept in
  `token_ids` (as transformers' `generate` does) but adds no text.
- A stop string ends the sequence and is cut from the text, with whatever followed it
  (`include_stop_str_in_output` keeps the string itself); not before the output has
  `min_tokens` tokens (nor can a stop token: engine/bans.py).
- Streamed text is never retracted: while stop strings are set, the last
  `max(len(stop)) - 1` characters are held back, since a stop string could begin there.
"""

from __future__ import annotations

import time

from .detokenizer import find_stop
from .outputs import CompletionOutput, GrowingListView, RequestOutput
from .sequence import Request, Sequence


def append_token(seq: Sequence, sample, eos_token_ids: set[int], max_model_len: int) -> None:
    append_text(seq, sample.token_id, append_token_id(seq, sample, eos_token_ids, max_model_len))


def append_token_id(seq: Sequence, sample, eos_token_ids: set[int], max_model_len: int) -> bool:
    """The token-level half: the id, its logprobs, stop tokens and length. Whether the
    token is a stop token (it then adds no text)."""
    params = seq.request.params
    token = sample.token_id
    seq.token_ids.append(token)
    seq.new_token_ids.append(token)
    if seq.logprobs is not None:
        seq.logprobs.append(sample)

    is_stop_token = token in params.stop_token_ids or (not params.ignore_eos and token in eos_token_ids)
    constraint = seq.sampling.constraint
    if constraint is not None and not constraint.accept(token):
        seq.finish_reason = "abort"  # its grammar refuses what its mask allowed: end, never go on unheld
    elif is_stop_token:
        seq.finish_reason = "stop"
        if params.ignore_eos or token not in eos_token_ids:  # as vLLM: an EOS is no stop_reason
            seq.stop_reason = token
    elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= max_model_len:
        seq.finish_reason = "length"
    return is_stop_token


def append_text(seq: Sequence, token: int, is_stop_token: bool) -> None:
    """The text half, for the token `append_token_id` appended last: detokenize, stop
    strings (which may end the sequence), what can be streamed."""
    params = seq.request.params
    delta = "" if is_stop_token else seq.detokenizer.add([token])
    if seq.finish_reason is not None:
        delta += seq.detokenizer.flush()
    if params.stop and delta and seq.num_output_tokens >= params.min_tokens:
        searched_from = len(seq.text) + len(seq.pending_text)
        full = seq.text + seq.pending_text + delta
        cut = find_stop(full, params.stop, searched_from)
        if cut is not None:
            seq.stop_reason = next(s for s in params.stop if s and full.startswith(s, cut))  # the first listed
            if params.include_stop_str_in_output:
                cut += len(seq.stop_reason)
            # The hold-back guarantees a match never begins inside already streamed text.
            full = full[:cut]
            seq.finish_reason = "stop"
        seq.pending_text = full[len(seq.text) :]
    else:
        seq.pending_text += delta

    hold = 0 if seq.finish_reason is not None or not params.stop else max(map(len, params.stop)) - 1
    emit = seq.pending_text[: max(0, len(seq.pending_text) - hold)]
    seq.text += emit
    seq.new_text += emit
    seq.pending_text = seq.pending_text[len(emit) :]


def take_delta(request: Request) -> RequestOutput:
    """What `request` made since its last delta (its new tokens and text then count as sent)."""
    # Once per sequence and step, at every batch size: views of the output ids and logprobs
    # (lists once finished), and the new ids handed over (the sequence starts a fresh list).
    outs = []
    finished = True
    for seq in request.seqs:
        if seq.finish_reason is None:
            ids = GrowingListView(seq.token_ids, seq.num_prompt_tokens, len(seq.token_ids))
            logprobs = None if seq.logprobs is None else GrowingListView(seq.logprobs, 0, len(seq.logprobs))
        else:
            ids = seq.token_ids[seq.num_prompt_tokens:]
            logprobs = None if seq.logprobs is None else list(seq.logprobs)
        outs.append(CompletionOutput(seq.index, ids, seq.text, seq.new_token_ids, seq.new_text,
                                     seq.finish_reason, logprobs, seq.stop_reason))
        finished = finished and seq.finish_reason is not None
        seq.new_token_ids = []
        seq.new_text = ""
    if not request.prefilled_at and request.scheduled_at and (
            finished or any(o.new_token_ids for o in outs)):
        request.prefilled_at = time.perf_counter()
    out = RequestOutput(request.request_id, outs, finished, len(request.prompt_token_ids),
                        request.num_cached_tokens, *_timings(request))
    if request.prompt_logprobs is not None and not request.scores_prompt:
        out.prompt_logprobs = request.prompt_logprobs
    return out


def _timings(request: Request) -> tuple[float, float]:
    """(queued_s, prefill_s) of `request` so far."""
    if not request.scheduled_at:
        return 0.0, 0.0
    prefill = request.prefilled_at - request.scheduled_at if request.prefilled_at else 0.0
    return request.scheduled_at - request.added_at, prefill


def eos_token_ids(hf_config, tokenizer) -> set[int]:
    eos = getattr(hf_config, "eos_token_id", None)
    ids = {eos} if isinstance(eos, int) else set(eos or ())
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
