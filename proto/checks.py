"""Wire-level input checks shared by the router and the workers (edge code, no engine).

Each check raises `ValueError` whose message names the field and the offending value, so a
servicer passes it straight back as INVALID_ARGUMENT. They bound what a request may make a
node allocate (choices, stop lists, logprobs, id lengths) before any work starts; the
engine still checks everything again (`SamplingParams.validate`, `Engine.add_request`).
"""

from __future__ import annotations

import math

MAX_REQUEST_ID_CHARS = 256
MAX_CHOICES = 16          # n
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_LOGPROBS = 20
MAX_SEED = 2**63 - 1 - MAX_CHOICES  # seed + i of sample i must fit a torch generator seed


def _bad(name: str, value, why: str):
    raise ValueError(f"{name} must be {why}, got {value!r}")


def check_request_id(request_id: str, *, required: bool = True) -> None:
    if required and not request_id:
        _bad("request_id", request_id, "non-empty")
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        _bad("request_id", request_id[:40] + "...", f"at most {MAX_REQUEST_ID_CHARS} characters")
    if any(not c.isprintable() for c in request_id):
        _bad("request_id", request_id, "printable")


def check_prompt_ids(ids, vocab_size: int, max_prompt_len: int) -> None:
    """A non-empty prompt of in-vocabulary ids that leaves room for one output token."""
    if not ids:
        raise ValueError("prompt is empty (0 tokens)")
    if len(ids) > max_prompt_len:
        raise ValueError(f"prompt of {len(ids)} tokens is longer than the model's context "
                         f"allows ({max_prompt_len})")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})")


def check_sampling(pb, vocab_size: int, max_model_len: int) -> None:
    """A `pdserve.v1.SamplingParams` whose set fields are in range."""
    if pb.HasField("max_tokens") and not 1 <= pb.max_tokens <= max_model_len:
        _bad("max_tokens", pb.max_tokens, f"in [1, {max_model_len}]")
    if pb.HasField("temperature") and not (math.isfinite(pb.temperature) and pb.temperature >= 0):
        _bad("temperature", pb.temperature, ">= 0")
    if pb.HasField("top_p") and not 0 < pb.top_p <= 1:
        _bad("top_p", pb.top_p, "in (0, 1]")
    if pb.HasField("top_k") and pb.top_k < -1:
        _bad("top_k", pb.top_k, "-1, 0 (off) or a positive integer")
    if not 0 <= pb.min_p <= 1:
        _bad("min_p", pb.min_p, "in [0, 1]")
    if pb.HasField("n") and not 1 <= pb.n <= MAX_CHOICES:
        _bad("n", pb.n, f"in [1, {MAX_CHOICES}]")
    if pb.HasField("seed") and pb.seed > MAX_SEED:
        _bad("seed", pb.seed, f"<= {MAX_SEED}")
    if pb.HasField("logprobs") and not 0 <= pb.logprobs <= min(MAX_LOGPROBS, vocab_size):
        _bad("logprobs", pb.logprobs, f"in [0, {min(MAX_LOGPROBS, vocab_size)}]")
    if len(pb.stop) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_CHARS for s in pb.stop):
        _bad("stop", list(pb.stop)[:4], f"at most {MAX_STOP_STRINGS} non-empty strings of at "
             f"most {MAX_STOP_CHARS} characters")
    if len(pb.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        _bad("stop_token_ids", len(pb.stop_token_ids), f"at most {MAX_STOP_TOKEN_IDS} ids")
    bad = next((t for t in pb.stop_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        _bad("stop_token_ids", bad, f"token ids in [0, {vocab_size})")


def check_window_end(kv_window_end: int, prompt_len: int) -> None:
    """Python-style end of the KV window: resolves into [0, prompt_len)."""
    if not -prompt_len <= kv_window_end < prompt_len:
        _bad("kv_window_end", kv_window_end,
             f"in [{-prompt_len}, {prompt_len}) for a prompt of {prompt_len} tokens")
