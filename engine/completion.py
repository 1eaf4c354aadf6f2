"""Appending a sampled token to a sequence: detokenize, apply stop rules, stream text.

Invariants:
- A stop token (an EOS unless `ignore_eos`, or one of `stop_token_ids`) is kept in
  `token_ids` (as transformers' `generate` does) but adds no text.
- A stop string ends the sequence and is cut from the text, with whatever followed it.
- Streamed text is never retracted: while stop strings are set, the last
  `max(len(stop)) - 1` characters are held back, since a stop string could begin there.
"""

from __future__ import annotations

from .detokenizer import find_stop
from .sequence import Sequence


def append_token(seq: Sequence, sample, eos_token_ids: set[int], max_model_len: int) -> None:
    params = seq.request.params
    token = sample.token_id
    seq.token_ids.append(token)
    seq.new_token_ids.append(token)
    if seq.logprobs is not None:
        seq.logprobs.append(sample)

    is_stop_token = token in params.stop_token_ids or (not params.ignore_eos and token in eos_token_ids)
    if is_stop_token:
        seq.finish_reason = "stop"
    elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= max_model_len:
        seq.finish_reason = "length"

    delta = "" if is_stop_token else seq.detokenizer.add([token])
    if seq.finish_reason is not None:
        delta += seq.detokenizer.flush()
    if params.stop and delta:
        searched_from = len(seq.text) + len(seq.pending_text)
        full = seq.text + seq.pending_text + delta
        cut = find_stop(full, params.stop, searched_from)
        if cut is not None:
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
