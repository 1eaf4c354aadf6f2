"""`pdserve bench constrained`: what held generation costs. Greedy generation with pdserve's
`LLM` under every penalty at once (repetition 1.2, frequency 0.5, presence 0.5, a logit
bias on four tokens), under bans (`min_tokens` the whole answer, four common `bad_words`)
and under two structured outputs (a regular expression of letters, and a JSON Schema: an
array of strings), each beside pdserve's plain greedy generation of
the same tokens (`*_vs_plain`, ratios of throughputs) and transformers' `generate` with the
same rules as logits processors, in left-padded batches (`*_speedup_vs_transformers`).

Every run generates exactly `--new` tokens a prompt: plain greedy ignores EOS, the bans
hold it back to the end, and neither structure can end sooner (1,000 letters or 200 strings at least, EOS not allowed before),
so the batches shrink alike (`*_full_length` says it held). pdserve's runs alternate, twice each, the fastest kept: a
workload's first run pays for what the warm-up did not touch. `*_matching_prompts` counts
prompts whose tokens equal transformers'. Both apply the same rules, but a padded batch's
logits differ from one prompt's in the last bits, and a greedy near-tie can then go
either way.

Workload: `--prompts` prompts (default 32) of 64-256 random token ids above the special
ones, `--new` new tokens each (default 128); `--quick`: 4 prompts of 16-32 ids, 8 tokens.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from pdserve import process_gc
from pdserve.benchmarks.engine import FIRST_PROMPT_TOKEN, random_prompts
from pdserve.benchmarks.model_choice import add_transformers_comparison_flags

PENALTIES = dict(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.5)
BAD_WORDS = ["the", "and", "of", "to"]  # common: an English text meets them at once
# Neither can be complete within 128 tokens (a token holds a few letters; a string item
# takes two tokens at least), so no row ends early.
STRUCTURES = {"regex": "[a-z ]{1000,}",
              "json": json.dumps({"type": "array", "items": {"type": "string"}, "minItems": 200})}


class OpenAIPenalties:
    """OpenAI's presence and frequency penalties as a transformers logits processor: a row's
    output tokens are those after the first `prompt_width` (a left-padded batch's width)."""

    def __init__(self, prompt_width: int, presence: float, frequency: float) -> None:
        self.prompt_width, self.presence, self.frequency = prompt_width, presence, frequency

    def __call__(self, input_ids, scores):
        import torch

        counts = torch.stack([torch.bincount(row[self.prompt_width:], minlength=scores.shape[-1])
                              for row in input_ids]).to(scores.dtype)
        return scores - counts * self.frequency - (counts > 0).to(scores.dtype) * self.presence


def transformers_greedy(model, prompts: list[list[int]], max_new_tokens: int, pad_id: int, *, processors=None,
                        eos: bool = True, **generate_kwargs) -> list[list[int]]:
    """`model`'s greedy continuations of `prompts` (one left-padded batch) through
    `processors(width)` (a batch's prompt width -> logits processors) and transformers' own
    `generate_kwargs`. `eos=False`: every row generates `max_new_tokens`."""
    import torch
    from transformers import LogitsProcessorList

    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    if not eos:
        generate_kwargs["min_new_tokens"] = max_new_tokens
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=pad_id, logits_processor=LogitsProcessorList(processors(width) if processors else []),
                             **generate_kwargs)
    return out[:, width:].tolist()


def transformers_penalized(model, prompts, max_new_tokens: int, pad_id: int, *, presence_penalty=0.0,
                           frequency_penalty=0.0, repetition_penalty=1.0, logit_bias=None, eos: bool = True):
    """`transformers_greedy` under the penalties: bias and repetition by transformers' own
    processors, OpenAI's two by `OpenAIPenalties`."""
    extra = {"sequence_bias": [[[int(t)], float(b)] for t, b in logit_bias.items()]} if logit_bias else {}
    return transformers_greedy(model, prompts, max_new_tokens, pad_id, eos=eos, repetition_penalty=repetition_penalty,
                               processors=lambda width: [OpenAIPenalties(width, presence_penalty, frequency_penalty)],
                               **extra)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench constrained", description=__doc__.split("\n\n")[0])
    add_transformers_comparison_flags(p, "4 short prompts, 8 new tokens each")
    p.add_argument("--prompts", type=int, default=32, help="prompts (default 32)")
    p.add_argument("--new", type=int, default=128, help="new tokens per prompt (default 128)")
    return p


def make_prompts(count: int, vocab_size: int, quick: bool) -> list[list[int]]:
    return random_prompts(count, vocab_size, (16, 32) if quick else (64, 256))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from xgrammar.contrib.hf import LogitsProcessor

    from pdserve.benchmarks.model_choice import resolve_or_exit
    from pdserve.engine import LLM, SamplingParams
    from pdserve.sampling import StructuredOutput

    model = resolve_or_exit(args.model, "pdserve bench constrained")
    config = AutoConfig.from_pretrained(model.dir)
    count, new = (4, 8) if args.quick else (args.prompts, args.new)
    prompts = make_prompts(count, config.vocab_size, args.quick)
    bias = {t: b for t, b in zip(random.Random(1).sample(range(FIRST_PROMPT_TOKEN, config.vocab_size), 4),
                                 (5.0, 2.0, -2.0, -100.0))}
    specs = {"regex": StructuredOutput("regex", STRUCTURES["regex"]),
             "json": StructuredOutput("json_schema", STRUCTURES["json"])}
    greedy = dict(max_tokens=new, temperature=0.0)
    params = {"plain": SamplingParams(**greedy, ignore_eos=True),
              "penalties": SamplingParams(**greedy, ignore_eos=True, logit_bias=bias, **PENALTIES),
              "bans": SamplingParams(**greedy, min_tokens=new, bad_words=BAD_WORDS),
              **{name: SamplingParams(**greedy, structured_output=spec) for name, spec in specs.items()}}
    llm = LLM(model.dir, dtype=args.dtype, enable_prefix_cache=False)
    for p in params.values():  # one-time set-up (the grammars' tables too) stays out of the figures
        llm.generate([[FIRST_PROMPT_TOKEN] * 8] * 2, p)

    def timed(run):
        start = time.perf_counter()
        out = run()
        return time.perf_counter() - start, out

    runs: dict[str, list] = {name: [] for name in params}
    for _ in range(2):
        for name, p in params.items():
            runs[name].append(timed(lambda p=p: llm.generate(prompts, p)))
    best = {name: min(t for t, _ in r) for name, r in runs.items()}

    hf = AutoModelForCausalLM.from_pretrained(model.dir, dtype=getattr(torch, args.dtype)).eval()
    pad_id = config.pad_token_id if config.pad_token_id is not None else 0
    batches = [prompts[b:b + args.hf_batch_size] for b in range(0, count, args.hf_batch_size)]
    banned = llm.engine.bans.of(params["bans"], [], 0)  # the words' token ids, as the engine bans them
    baselines = {"penalties": lambda batch: transformers_penalized(hf, batch, new, pad_id, logit_bias=bias, eos=False,
                                                                    **PENALTIES),
                 "bans": lambda batch: transformers_greedy(hf, batch, new, pad_id, eos=False, bad_words_ids=[
                     [t] for t in banned.always] + [list(f) for f in banned.after]),
                 **{name: lambda batch, spec=spec: transformers_greedy(
                     hf, batch, new, pad_id, processors=lambda _: [LogitsProcessor(llm.engine.grammars.compiled(spec))])
                    for name, spec in specs.items()}}
    tokens = count * new
    report = {"model": model.described(args.dtype, config), "threads": torch.get_num_threads(), "quick": args.quick,
              "num_prompts": count, "new_tokens_each": new,
              "penalties": {**PENALTIES, "logit_bias": {str(t): b for t, b in bias.items()}},
              "bans": {"min_tokens": new, "bad_words": BAD_WORDS},
              "structures": STRUCTURES, "pdserve_runs_s": {name: [round(t, 3) for t, _ in r] for name, r in runs.items()},
              "pdserve_plain_tokens_per_s": round(tokens / best["plain"], 1)}
    for name, baseline in baselines.items():
        hf_s, theirs = timed(lambda: [row for batch in batches for row in baseline(batch)])
        ours = runs[name][-1][1]
        report.update({
            f"pdserve_{name}_tokens_per_s": round(tokens / best[name], 1),
            f"transformers_{name}_tokens_per_s": round(tokens / hf_s, 1),
            f"{name}_vs_plain": round(best["plain"] / best[name], 3),
            f"{name}_speedup_vs_transformers": round(hf_s / best[name], 3),
            f"{name}_matching_prompts": sum(o.token_ids == t for o, t in zip(ours, theirs)),
            f"{name}_full_length": all(len(o.token_ids) == new for o in ours)})
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"{tokens} tokens, pdserve plain greedy {report['pdserve_plain_tokens_per_s']} tok/s")
        for name in baselines:
            print(f"  {name}: pdserve {report[f'pdserve_{name}_tokens_per_s']} tok/s ({report[f'{name}_vs_plain']}x "
                  f"plain), transformers {report[f'transformers_{name}_tokens_per_s']} tok/s; pdserve "
                  f"{report[f'{name}_speedup_vs_transformers']}x; {report[f'{name}_matching_prompts']} of {count} "
                  "prompts token for token")
    return 0


if __name__ == "__main__":
    process_gc.own_process()
    raise SystemExit(main())
