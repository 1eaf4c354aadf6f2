"""`pdserve bench score`: scoring prompts (`prompt_logprobs`: what OpenAI's `echo` with
`logprobs` and lm-eval-harness's loglikelihood tasks ask) with pdserve's `LLM`, beside two
baselines measured in the same run, on the same cores:
- pdserve prefilling the same prompts without scoring them (one new token each): what
  scoring adds to a prefill (the output layer on every position, a log-softmax per row,
  no prefix-cache reuse);
- transformers' forward over padded batches and a log-softmax, the way lm-eval's `hf`
  backend scores.
Figures: prompt tokens scored per second by each, the ratios (`score_vs_prefill`,
`speedup_vs_transformers`), and the largest difference between pdserve's and transformers'
logprobs of the same tokens. Prefix caching is off in pdserve: random prompts share no
prefix, and a scored prompt takes none from the cache anyway.

Workload: `--prompts` prompts (default 64) of 64-512 random token ids above the special
ones (`--quick`: 8 of 16-64), transformers in batches of `--hf-batch-size`, longest first.
"""

from __future__ import annotations

import argparse
import json
import time

from pdserve import process_gc
from pdserve.benchmarks.engine import FIRST_PROMPT_TOKEN, random_prompts
from pdserve.benchmarks.model_choice import add_transformers_comparison_flags


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench score", description=__doc__.split("\n\n")[0])
    add_transformers_comparison_flags(p, "8 short prompts")
    p.add_argument("--prompts", type=int, default=64, help="prompts to score (default 64)")
    p.add_argument("--top", type=int, default=1, help="alternatives per token (default 1, as lm-eval asks)")
    return p


def make_prompts(count: int, vocab_size: int, quick: bool) -> list[list[int]]:
    return random_prompts(count, vocab_size, (16, 64) if quick else (64, 512))


def score_pdserve(llm, prompts, top: int | None) -> tuple[float, list[list[float]]]:
    """Seconds to score `prompts` (None: to prefill them unscored) and each one's logprobs."""
    from pdserve.engine import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=top)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return elapsed, [[s.logprob for s in o.prompt_logprobs or []] for o in outs]


def score_transformers(model, prompts, batch_size: int, pad_id: int) -> tuple[float, list[list[float]]]:
    import torch

    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    scored: dict[int, list[float]] = {}
    start = time.perf_counter()
    for b in range(0, len(order), batch_size):
        batch = [prompts[i] for i in order[b:b + batch_size]]
        width = len(batch[0])
        ids = torch.tensor([p + [pad_id] * (width - len(p)) for p in batch])
        mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in batch])
        with torch.inference_mode():
            logits = model(input_ids=ids, attention_mask=mask).logits
            for row, (i, p) in enumerate(zip(order[b:b + batch_size], batch)):
                rows = torch.log_softmax(logits[row, :len(p) - 1].float(), -1)
                scored[i] = rows.gather(1, torch.tensor(p[1:]).unsqueeze(1)).squeeze(1).tolist()
    return time.perf_counter() - start, [scored[i] for i in range(len(prompts))]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pdserve.benchmarks.model_choice import resolve_or_exit
    from pdserve.engine import LLM

    model = resolve_or_exit(args.model, "pdserve bench score")
    config = AutoConfig.from_pretrained(model.dir)
    prompts = make_prompts(8 if args.quick else args.prompts, config.vocab_size, args.quick)
    warmup = [[FIRST_PROMPT_TOKEN] * 8] * 2  # one-time set-up stays out of the figures
    llm = LLM(model.dir, dtype=args.dtype, enable_prefix_cache=False)
    score_pdserve(llm, warmup, args.top)
    hf = AutoModelForCausalLM.from_pretrained(model.dir, dtype=getattr(torch, args.dtype)).eval()
    pad_id = config.pad_token_id if config.pad_token_id is not None else 0
    score_transformers(hf, warmup, args.hf_batch_size, pad_id)

    prefill_s, _ = score_pdserve(llm, prompts, None)
    score_s, ours = score_pdserve(llm, prompts, args.top)
    hf_s, theirs = score_transformers(hf, prompts, args.hf_batch_size, pad_id)
    scored_tokens = sum(len(p) - 1 for p in prompts)
    report = {
        "model": model.described(args.dtype, config),
        "threads": torch.get_num_threads(),
        "quick": args.quick,
        "num_prompts": len(prompts),
        "prompt_tokens": sum(map(len, prompts)),
        "top_logprobs": args.top,
        "pdserve_score_s": round(score_s, 4),
        "pdserve_prefill_s": round(prefill_s, 4),
        "transformers_score_s": round(hf_s, 4),
        "pdserve_score_tokens_per_s": round(scored_tokens / score_s, 1),
        "pdserve_prefill_tokens_per_s": round(scored_tokens / prefill_s, 1),
        "transformers_score_tokens_per_s": round(scored_tokens / hf_s, 1),
        "score_vs_prefill": round(prefill_s / score_s, 3),
        "speedup_vs_transformers": round(hf_s / score_s, 3),
        "max_abs_logprob_diff": max(abs(a - b) for o, t in zip(ours, theirs) for a, b in zip(o, t)),
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"scored {report['prompt_tokens']} prompt tokens: pdserve {report['pdserve_score_tokens_per_s']} "
              f"tok/s ({report['score_vs_prefill']}x its unscored prefill), transformers "
              f"{report['transformers_score_tokens_per_s']} tok/s; pdserve {report['speedup_vs_transformers']}x; "
              f"largest logprob difference {report['max_abs_logprob_diff']:.2e}")
    return 0


if __name__ == "__main__":
    process_gc.own_process()
    raise SystemExit(main())
