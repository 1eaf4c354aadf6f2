"""`pdserve bench engine`: pdserve's `LLM` against transformers `generate` (greedy) on the
same workloads, in one process, on the same cores.

Throughput counts useful generated tokens only: the tokens each prompt asked for, divided
by the wall time of the whole workload. transformers runs padded batches of
`HF_BATCH_SIZE` prompts; every prompt of a batch generates as long as the batch's longest
request (min_new_tokens = max_new_tokens, so EOS never ends one early), and the tokens
beyond a prompt's own request are padding, not counted. pdserve gets `ignore_eos` and each
prompt's own `max_tokens`.

The model is `--model` (`benchmarks.model_choice`): SmolLM2-135M-Instruct by default, or
`bench-random-100m`, the random-weight ~100M Llama of the first figures. Prompts are token
ids drawn uniformly from the vocabulary above its special tokens, not text (the random
models' tokenizer has far fewer entries than their vocabulary); the longest prompt and
answer (512 + 256 tokens) fit every model's context. The JSON names the model measured:
catalogue name, directory and dtype.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, dataclass

# Ids below are special tokens: 0-5 in engine.checkpoint's tokenizers, 0-16 in SmolLM2's.
FIRST_PROMPT_TOKEN = 17
HF_BATCH_SIZE = 32


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]
    hf_batch_size: int


@dataclass
class Result:
    workload: str
    num_prompts: int
    prompt_tokens: int
    generated_tokens: int
    engine_s: float
    transformers_s: float
    engine_tokens_per_s: float
    transformers_tokens_per_s: float
    speedup: float  # engine over transformers
    greedy_match: float  # share of prompts whose tokens are identical in both


def make_workloads(names: list[str], vocab_size: int, quick: bool, seed: int = 0) -> list[Workload]:
    rng = random.Random(seed)

    def prompt(n):
        return [rng.randrange(FIRST_PROMPT_TOKEN, vocab_size) for _ in range(n)]

    out = []
    for name in names:
        if name == "mixed":
            count, (p_lo, p_hi), (o_lo, o_hi), batch = (8, (8, 32), (4, 16), 4) if quick else (
                64, (64, 512), (16, 256), HF_BATCH_SIZE)
            lens = [rng.randint(p_lo, p_hi) for _ in range(count)]
            outs = [rng.randint(o_lo, o_hi) for _ in range(count)]
            out.append(Workload(name, [prompt(n) for n in lens], outs, batch))
        elif name == "uniform":
            count, p_len, o_len, batch = (4, 16, 8, 4) if quick else (32, 256, 128, HF_BATCH_SIZE)
            out.append(Workload(name, [prompt(p_len) for _ in range(count)], [o_len] * count, batch))
        else:
            raise ValueError(f"unknown workload {name!r}")
    return out


def kv_cache_bytes(config, dtype: str, workloads: list[Workload], page_size: int) -> int:
    """Room for every context of the largest workload at once (plus one page each), so
    pdserve never waits for KV memory, as transformers never does."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = (2 * config.num_hidden_layers * config.num_key_value_heads * head_dim
                 * (4 if dtype == "float32" else 2))
    tokens = max(sum(len(p) + n + page_size for p, n in zip(w.prompts, w.output_lens))
                 for w in workloads)
    return per_token * tokens


def run_engine(llm, workload: Workload) -> tuple[float, list[list[int]]]:
    from engine import SamplingParams

    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in workload.output_lens]
    start = time.perf_counter()
    outputs = llm.generate(workload.prompts, params)
    elapsed = time.perf_counter() - start
    return elapsed, [list(o.token_ids) for o in outputs]


def run_transformers(model, workload: Workload, pad_id: int, progress) -> tuple[float, list[list[int]]]:
    import torch

    tokens: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(workload.prompts), workload.hf_batch_size):
        prompts = workload.prompts[i : i + workload.hf_batch_size]
        wanted = workload.output_lens[i : i + workload.hf_batch_size]
        width = max(len(p) for p in prompts)
        # Left padding, so every prompt's last token sits in the same column.
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        longest = max(wanted)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=mask, do_sample=False,
                max_new_tokens=longest, min_new_tokens=longest, pad_token_id=pad_id,
            )
        tokens.extend(row[width : width + n] for row, n in zip(out.tolist(), wanted))
        progress.update(len(prompts))
    return time.perf_counter() - start, tokens


def build_parser() -> argparse.ArgumentParser:
    from benchmarks.model_choice import add_model_flag

    parser = argparse.ArgumentParser(
        prog="pdserve bench engine",
        description="Throughput of pdserve's engine against transformers generate (greedy).",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    add_model_flag(parser)
    parser.add_argument("--model-dir", dest="model", metavar="DIR", default=argparse.SUPPRESS,
                        help="the same as --model")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="weights and activations of both engines (default float32)")
    parser.add_argument("--workload", choices=["mixed", "uniform", "all"], default="all",
                        help="which workload to run (default all)")
    parser.add_argument("--quick", action="store_true",
                        help="a few short prompts: a smoke test, not a measurement (pair it with "
                             "--model bench-random-tiny for the fastest run)")
    parser.add_argument("--page-size", type=int, default=16, help="pdserve page size (default 16)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    import torch
    from tqdm import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM

    from benchmarks.model_choice import resolve_or_exit
    from engine import LLM

    model = resolve_or_exit(args.model, "pdserve bench engine")
    config = AutoConfig.from_pretrained(model.dir)
    names = ["mixed", "uniform"] if args.workload == "all" else [args.workload]
    workloads = make_workloads(names, config.vocab_size, args.quick)
    dtype = getattr(torch, args.dtype)

    hf = AutoModelForCausalLM.from_pretrained(model.dir, dtype=dtype).eval()
    num_params = sum(p.numel() for p in hf.parameters())
    llm = LLM(model.dir, page_size=args.page_size, dtype=args.dtype,
              kv_cache_memory_bytes=kv_cache_bytes(config, args.dtype, workloads, args.page_size))
    pad_id = config.pad_token_id if config.pad_token_id is not None else 0

    # One short run each first, so one-time set-up costs stay out of the measurement.
    warmup = Workload("warmup", [[FIRST_PROMPT_TOKEN] * 8] * 2, [2, 2], 2)
    run_engine(llm, warmup)
    run_transformers(hf, warmup, pad_id, _NoProgress())

    results = []
    total = sum(len(w.prompts) for w in workloads)
    with tqdm(total=2 * total, desc="bench engine", unit="prompt", file=sys.stderr) as progress:
        for w in workloads:
            progress.set_postfix_str(f"{w.name}: pdserve")
            engine_s, engine_tokens = run_engine(llm, w)
            progress.update(len(w.prompts))
            progress.set_postfix_str(f"{w.name}: transformers")
            hf_s, hf_tokens = run_transformers(hf, w, pad_id, progress)
            generated = sum(w.output_lens)
            results.append(Result(
                workload=w.name,
                num_prompts=len(w.prompts),
                prompt_tokens=sum(len(p) for p in w.prompts),
                generated_tokens=generated,
                engine_s=round(engine_s, 4),
                transformers_s=round(hf_s, 4),
                engine_tokens_per_s=round(generated / engine_s, 2),
                transformers_tokens_per_s=round(generated / hf_s, 2),
                speedup=round(hf_s / engine_s, 4),
                greedy_match=round(sum(a == b for a, b in zip(engine_tokens, hf_tokens)) / len(w.prompts), 3),
            ))

    report = {
        "model": {**model.record(args.dtype), "parameters": num_params,
                  "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
                  "num_layers": config.num_hidden_layers},
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "quick": args.quick,
        "workloads": [asdict(r) for r in results],
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_table(report)
    return 0


class _NoProgress:
    def update(self, n):
        pass


def _print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    m = report["model"]
    table = Table(title=f"pdserve vs transformers generate: {m['name']} "
                        f"({m['parameters'] / 1e6:.0f}M params), {report['dtype']}, "
                        f"{report['threads']} threads")
    for col in ("workload", "prompts", "generated", "pdserve tok/s", "transformers tok/s", "speedup",
                "greedy match"):
        table.add_column(col, justify="right")
    for r in report["workloads"]:
        table.add_row(r["workload"], str(r["num_prompts"]), str(r["generated_tokens"]),
                      f"{r['engine_tokens_per_s']:.1f}", f"{r['transformers_tokens_per_s']:.1f}",
                      f"{r['speedup']:.2f}x", f"{r['greedy_match']:.0%}")
    Console().print(table)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
