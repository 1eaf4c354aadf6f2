"""Benchmark workloads: which requests are sent, and when.

Everything is a pure function of its seed: the same flags give the same prompts, output
lengths and arrival times on every run and for every system compared, so differences in
the results come from the servers, not from the draw. Prompts and arrivals use separate
random streams, so changing the rate does not change the prompts.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# Ids below this are special tokens: 0-5 in pdserve's own tokenizers (pad, bos, eos, roles),
# 0-16 in SmolLM2's; synthetic prompts avoid them so no prompt contains an end-of-sequence.
LOW_TOKEN_ID = 17


@dataclass(frozen=True)
class BenchRequest:
    prompt: list[int] | str  # token ids (synthetic) or text (ShareGPT)
    prompt_len: int          # tokens
    output_len: int          # tokens asked for (max_tokens, with ignore_eos)


def parse_range(text: str) -> tuple[int, int]:
    """`"512:1536"` or `"512"` -> inclusive (lo, hi); raises ValueError naming the text."""
    parts = text.split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (None, None)
    except ValueError:
        lo = hi = None
    if lo is None or not 1 <= lo <= hi:
        raise ValueError(f"expected LO:HI or N with 1 <= LO <= HI, got {text!r}")
    return lo, hi


def synthetic(num: int, input_len: tuple[int, int], output_len: tuple[int, int],
              vocab_size: int, seed: int | str = 0) -> list[BenchRequest]:
    """`num` prompts of token ids drawn uniformly from [LOW_TOKEN_ID, vocab_size), with
    lengths uniform over the inclusive ranges."""
    if vocab_size <= LOW_TOKEN_ID:
        raise ValueError(f"vocab_size must exceed {LOW_TOKEN_ID}, got {vocab_size}")
    rng = random.Random(f"pdserve-bench-prompts-{seed}")
    out = []
    for _ in range(num):
        n = rng.randint(*input_len)
        prompt = [rng.randrange(LOW_TOKEN_ID, vocab_size) for _ in range(n)]
        out.append(BenchRequest(prompt, n, rng.randint(*output_len)))
    return out


def read_sharegpt(path: str | Path) -> list[tuple[str, str]]:
    """The first-turn (human prompt, model answer) pairs of a ShareGPT JSON file: a list of
    `{"conversations": [{"from": "human"|"gpt", "value": text}, ...]}`."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of conversations, got {type(data).__name__}")
    pairs = []
    for item in data:
        turns = item.get("conversations") or item.get("conversation") or []
        if len(turns) >= 2 and turns[0].get("from") == "human":
            pairs.append((turns[0].get("value", ""), turns[1].get("value", "")))
    return pairs


def sample_sharegpt(pairs: list[tuple[str, str]], num: int, count_tokens: Callable[[str], int],
                    seed: int | str = 0, max_model_len: int = 0,
                    output_len: int | None = None) -> list[BenchRequest]:
    """`num` requests from ShareGPT pairs, shuffled with `seed`. The answer's length in
    tokens becomes the output length (unless `output_len` is given). As in vLLM's
    benchmark, pairs with a prompt or answer under 4 tokens are skipped, and so are those
    longer than `max_model_len` (when given) in total. Fewer than `num` come back if the
    pairs run out."""
    order = list(range(len(pairs)))
    random.Random(f"pdserve-bench-sharegpt-{seed}").shuffle(order)
    out = []
    for i in order:
        if len(out) == num:
            break
        prompt, answer = pairs[i]
        prompt_len = count_tokens(prompt)
        answer_len = output_len or count_tokens(answer)
        if prompt_len < 4 or answer_len < 4:
            continue
        if max_model_len and prompt_len + answer_len > max_model_len:
            continue
        out.append(BenchRequest(prompt, prompt_len, answer_len))
    return out


def arrival_offsets(num: int, rate: float, arrival: str = "poisson", seed: int = 0) -> list[float]:
    """Send times in seconds from the start: all at 0 for an infinite rate, every 1/rate
    for `fixed`, exponential gaps of mean 1/rate for `poisson`. The first is always 0."""
    if rate <= 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    if math.isinf(rate):
        return [0.0] * num
    if arrival == "fixed":
        return [i / rate for i in range(num)]
    if arrival != "poisson":
        raise ValueError(f"arrival must be 'poisson' or 'fixed', got {arrival!r}")
    rng = random.Random(f"pdserve-bench-arrivals-{seed}")
    offsets, t = [], 0.0
    for _ in range(num):
        offsets.append(t)
        t += rng.expovariate(rate)
    return offsets
