"""The oracle of the real-weight tests: chat prompts for SmolLM2-135M-Instruct and what
transformers answers to them, computed once per test session and shared by
tests/engine/test_real_model.py and the cluster tests.

- `chat_prompts(model_dir)`: the prompts as token ids, rendered with the model's own chat
  template (add_generation_prompt=True). The last one is over 1,000 tokens: a long,
  deterministic travel log and a question about it.
- `greedy_reference(model_dir)`: transformers' fp32 `generate(do_sample=False)` of each,
  up to `MAX_NEW` new tokens, stopping at eos like the engine does (the eos id is the
  last token then).
- `forced_argmax(model_dir, dtype, pairs)`: transformers' greedy choice at every position
  of each (prompt, continuation), given the prompt and the continuation before it (one
  forward pass each: a teacher-forced comparison).

An all-ones attention mask goes to every call: without one transformers derives a mask
from the pad id, and this model's pad id is `<|im_end|>`, which every chat prompt
contains, so the reference would attend to the wrong tokens.
"""

from __future__ import annotations

import functools
import random

MAX_NEW = 32
EOS = 2  # <|im_end|>, eos and pad of SmolLM2-Instruct
THREADS = 2
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
]
LONG_MIN_TOKENS = 1000


def travel_log() -> str:
    """A long chat message (about 1,400 tokens), the same on every run."""
    rng = random.Random(0)
    towns = ["Ashford", "Bellmoor", "Carrow", "Dunmere", "Eastwick", "Fallow", "Glenhaven",
             "Harrowgate"]
    goods = ["wool", "salt", "copper", "barley", "timber", "cheese", "glass", "honey"]
    days = [f"Day {i}: the caravan left {rng.choice(towns)} with {rng.randint(2, 90)} carts of "
            f"{rng.choice(goods)}." for i in range(1, 70)]
    return ("Here is a travel log.\n" + "\n".join(days) +
            "\nWhich town appears most often in the log above? Answer in one sentence.")


@functools.cache
def tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _chats(model_dir: str, **how):
    tok = tokenizer(model_dir)
    return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                    **how) for q in [*QUESTIONS, travel_log()]]


@functools.cache
def chat_texts(model_dir: str) -> tuple[str, ...]:
    """The prompts as text, as a client would send them."""
    return tuple(_chats(model_dir, tokenize=False))


@functools.cache
def chat_prompts(model_dir: str) -> tuple[tuple[int, ...], ...]:
    prompts = tuple(tuple(c["input_ids"]) for c in _chats(model_dir, return_dict=True))
    assert len(prompts[-1]) > LONG_MIN_TOKENS, len(prompts[-1])
    return prompts


@functools.cache
def _model(model_dir: str, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(THREADS)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()


@functools.cache
def greedy_reference(model_dir: str) -> tuple[tuple[int, ...], ...]:
    """transformers' fp32 greedy continuation of every chat prompt (eos included if reached)."""
    import torch

    model = _model(model_dir, "float32")
    outs = []
    for prompt in chat_prompts(model_dir):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=MAX_NEW, eos_token_id=EOS, pad_token_id=EOS)
        outs.append(tuple(out[0, len(prompt):].tolist()))
    _model.cache_clear()  # the answers are all that is kept
    return tuple(outs)


def forced_argmax(model_dir: str, dtype: str, pairs) -> list[tuple[list[int], list[float]]]:
    """For each (prompt, continuation) of `pairs`: transformers' argmax at each position of
    `continuation` (given everything before it) and, per position, how far below that
    argmax's logit `continuation`'s own token scored."""
    import torch

    model, answers = _model(model_dir, dtype), []
    for prompt, continuation in pairs:
        ids = torch.tensor([[*prompt, *continuation]])
        with torch.inference_mode():
            logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0].float()
        rows = logits[len(prompt) - 1:-1]
        chosen = rows.gather(1, torch.tensor(continuation).unsqueeze(1)).squeeze(1)
        answers.append((rows.argmax(dim=-1).tolist(), (rows.max(dim=-1).values - chosen).tolist()))
    _model.cache_clear()
    return answers


def prompt_logprobs(model_dir: str, prompt) -> list[float]:
    """transformers' fp32 logprob of each prompt token after the first, given the ones
    before it (what `prompt_logprobs` scores)."""
    import torch

    model = _model(model_dir, "float32")
    ids = torch.tensor([list(prompt)])
    with torch.inference_mode():
        logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0, :-1].float()
    _model.cache_clear()
    return torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:].unsqueeze(1)).squeeze(1).tolist()
