"""`pdserve bench engine`: pdserve's `LLM` against transformers `generate` (greedy) on the
same workloads, in one process, on the same cores; with `--peer vllm`, against vLLM's `LLM`
(`benchmarks.peer`: alone in a child process with its own interpreter, run first); with
`--tensor-parallel-size N`, TP = N against TP = 1 of pdserve's own (`benchmarks.engine_tp`).

Throughput counts useful generated tokens only: the tokens each prompt asked for, divided
by the wall time of the whole workload. transformers runs padded batches of
`HF_BATCH_SIZE` prompts; every prompt of a batch generates as long as the batch's longest
request (min_new_tokens = max_new_tokens, so EOS never ends one early), and the tokens
beyond a prompt's own request are padding, not counted. pdserve gets `ignore_eos` and each
prompt's own `max_tokens`, and so does vLLM (prefix caching off in both).

The model is `--model` (`benchmarks.model_choice`): SmolLM2-135M-Instruct by default, or
`bench-random-100m`, the random-weight ~100M Llama of the first figures. Prompts are token
ids drawn uniformly from the vocabulary above its special tokens, not text (the random
models' tokenizer has far fewer entries than their vocabulary); the longest prompt and
answer (1024 + 256 tokens, in long-mixed) fit the context of SmolLM2 and bench-random-100m
(bench-random-tiny's 512 fits the --quick workloads only). The JSON names the model
measured (catalogue name, directory and dtype) and each engine's start-up time.

Workloads (`--quick` shrinks each to a smoke test):
- mixed: 64 prompts of 64-512 ids, 16-256 new tokens each;
- uniform: 32 prompts of 256 ids, 128 new tokens each;
- long-mixed: 32 prompts of 32-1024 ids, 16-256 new tokens each;
- decode-heavy: 64 prompts of 64 ids, 512 new tokens each.
`all` is mixed and uniform against transformers, and uniform, long-mixed and decode-heavy
against a peer. `--prefill-only` keeps each workload's prompts and asks one new token of
each: the prefill alone (the full workload's time less this one is roughly its decode).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, dataclass

from pdserve import process_gc
from pdserve.benchmarks import peer as peers
from pdserve.benchmarks.engine_table import print_table

# Ids below are special tokens: 0-5 in engine.checkpoint's tokenizers, 0-16 in SmolLM2's.
FIRST_PROMPT_TOKEN = 17
HF_BATCH_SIZE = 32
STEPS = 64  # decode steps timed per batch size (--step-batches)


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]
    hf_batch_size: int


@dataclass
class Result:
    """One workload's figures; the transformers and peer columns are None when that
    engine did not run (and left out of the JSON)."""

    workload: str
    num_prompts: int
    prompt_tokens: int
    generated_tokens: int
    engine_s: float
    engine_tokens_per_s: float
    transformers_s: float | None = None
    transformers_tokens_per_s: float | None = None
    speedup: float | None = None  # engine over transformers
    greedy_match: float | None = None  # share of prompts whose tokens are identical in both
    peer_s: float | None = None
    peer_tokens_per_s: float | None = None
    peer_ratio: float | None = None  # engine tokens/s over the peer's
    peer_match: float | None = None  # share of prompts whose tokens are identical in both


WORKLOADS = ("mixed", "uniform", "long-mixed", "decode-heavy")
DEFAULT_WORKLOADS = ("mixed", "uniform")
DEFAULT_PEER_WORKLOADS = ("uniform", "long-mixed", "decode-heavy")


def random_prompts(count: int, vocab_size: int, lengths: tuple[int, int], seed: int = 0) -> list[list[int]]:
    """`count` prompts of random ids above the special ones, of lengths drawn from `lengths`."""
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_PROMPT_TOKEN, vocab_size) for _ in range(rng.randint(*lengths))]
            for _ in range(count)]


def workload_names(choice: str, peer: str | None) -> list[str]:
    if choice != "all":
        return [choice]
    return list(DEFAULT_PEER_WORKLOADS if peer else DEFAULT_WORKLOADS)


def make_workloads(names: list[str], vocab_size: int, quick: bool, seed: int = 0) -> list[Workload]:
    rng = random.Random(seed)

    def prompt(n):
        return [rng.randrange(FIRST_PROMPT_TOKEN, vocab_size) for _ in range(n)]

    def varied(name, count, p_range, o_range, batch):
        lens = [rng.randint(*p_range) for _ in range(count)]
        outs = [rng.randint(*o_range) for _ in range(count)]
        return Workload(name, [prompt(n) for n in lens], outs, batch)

    def same(name, count, p_len, o_len, batch):
        return Workload(name, [prompt(p_len) for _ in range(count)], [o_len] * count, batch)

    # (count, prompt length(s), output length(s), transformers batch): quick, then full.
    shapes = {
        "mixed": (varied, (8, (8, 32), (4, 16), 4), (64, (64, 512), (16, 256), HF_BATCH_SIZE)),
        "uniform": (same, (4, 16, 8, 4), (32, 256, 128, HF_BATCH_SIZE)),
        "long-mixed": (varied, (8, (8, 64), (4, 16), 4), (32, (32, 1024), (16, 256), HF_BATCH_SIZE)),
        "decode-heavy": (same, (4, 8, 32, 4), (64, 64, 512, HF_BATCH_SIZE)),
    }
    for name in names:
        if name not in shapes:
            raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    # Built in the order named: the prompts drawn depend on it.
    return [shapes[n][0](n, *(shapes[n][1] if quick else shapes[n][2])) for n in names]


def prefill_only(workload: Workload) -> Workload:
    """The same prompts, one new token each (named `<workload>-prefill`)."""
    return Workload(f"{workload.name}-prefill", workload.prompts, [1] * len(workload.prompts),
                    workload.hf_batch_size)


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
    from pdserve.engine import SamplingParams

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
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
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
    from pdserve.benchmarks.model_choice import add_model_flag

    parser = argparse.ArgumentParser(
        prog="pdserve bench engine",
        description="Throughput of pdserve's engine against transformers generate or vLLM (greedy).",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    add_model_flag(parser)
    parser.add_argument("--model-dir", dest="model", metavar="DIR", default=argparse.SUPPRESS,
                        help="the same as --model")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="weights and activations of every engine (default float32)")
    parser.add_argument("--workload", choices=[*WORKLOADS, "all"], default="all",
                        help=f"which workload to run (default all: {' and '.join(DEFAULT_WORKLOADS)}; "
                             f"with --peer, {', '.join(DEFAULT_PEER_WORKLOADS)})")
    parser.add_argument("--quick", action="store_true",
                        help="a few short prompts: a smoke test, not a measurement (pair it with "
                             "--model bench-random-tiny for the fastest run)")
    parser.add_argument("--page-size", type=int, default=16, help="pdserve page size (default 16)")
    parser.add_argument("--device", default="cpu",
                        help="torch device of both engines: cpu, cuda or cuda:N (default cpu)")
    parser.add_argument("--step-batches", default=None, metavar="B,B,...",
                        help="also time decode steps at these batch sizes (prompts of 128 tokens), "
                             "each beside the memory-bandwidth limit (default on a GPU: 1,64,256)")
    parser.add_argument("--peer", choices=["vllm"], default=None,
                        help="compare against this engine instead of transformers, run alone in a "
                             "child process with its own interpreter (see --peer-python)")
    parser.add_argument("--peer-python", metavar="PATH", default=None,
                        help=f"the peer's interpreter (default ${peers.PEER_PYTHON_ENV}, else "
                             f"{peers.DEFAULT_PEER_PYTHON} in the repository, made by `make bench-peers`)")
    parser.add_argument("--prefill-only", action="store_true",
                        help="one new token per prompt (same prompts): how fast each engine prefills")
    parser.add_argument("--transformers", action="store_true",
                        help="with --peer, measure transformers generate as well")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                        help="N > 1: pdserve with TP = N against TP = 1, each on all the cores (no transformers)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.peer:
        try:
            peer_python = peers.peer_python(args.peer_python)
        except peers.PeerMissing as err:
            print(f"pdserve bench engine: error: {err}", file=sys.stderr)
            return 2

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pdserve.benchmarks.model_choice import resolve_or_exit
    from pdserve.engine import LLM

    model = resolve_or_exit(args.model, "pdserve bench engine")
    config = AutoConfig.from_pretrained(model.dir)
    workloads = make_workloads(workload_names(args.workload, args.peer), config.vocab_size, args.quick)
    if args.prefill_only:
        workloads = [prefill_only(w) for w in workloads]
    kv_bytes = kv_cache_bytes(config, args.dtype, workloads, args.page_size)
    with_transformers = not args.peer or args.transformers
    # One short run each first, so one-time set-up costs stay out of the measurement.
    warmup = Workload("warmup", [[FIRST_PROMPT_TOKEN] * 8] * 2, [2, 2], 2)
    step_batches = [int(b) for b in (args.step_batches or ("1,64,256" if args.device != "cpu" else "")).split(",") if b]
    # pdserve's room holds each step batch's 128-token prompts and their steps too
    engine_kv_bytes = kv_cache_bytes(config, args.dtype, workloads + [
        Workload("steps", [[0] * 128] * b, [STEPS + 8] * b, 1) for b in step_batches], args.page_size)
    if args.tensor_parallel_size > 1:  # engine_tp.py runs with this file's functions (no import back)
        from pdserve.benchmarks.engine_tp import compare_tp
        return compare_tp(args, model, config, workloads, warmup, engine_kv_bytes, step_batches,
                          run_engine=run_engine, match=match, steps=STEPS)

    peer = peer_env = None
    if args.peer:
        # The peer runs first and alone: its child has exited before pdserve's engine starts.
        job = peers.build_job(model.dir, args.dtype, workloads, warmup)
        try:
            peer_env = peers.peer_env(kv_bytes, peer_python)
            peer = peers.run_peer(peer_python, job, peer_env)
        except peers.PeerFailed as err:
            print(f"pdserve bench engine: error: {err}", file=sys.stderr)
            return 1

    start = time.perf_counter()
    # Prefix caching is off against a peer, as it is in the peer (random prompts never
    # share a prefix anyway; this keeps the lookups out of the comparison too).
    llm = LLM(model.dir, page_size=args.page_size, dtype=args.dtype, kv_cache_memory_bytes=engine_kv_bytes,
              enable_prefix_cache=not args.peer, device=args.device, max_num_seqs=max([64, *step_batches]))
    engine_startup_s = time.perf_counter() - start
    run_engine(llm, warmup)
    hf = None
    pad_id = config.pad_token_id if config.pad_token_id is not None else 0
    if with_transformers:
        hf = AutoModelForCausalLM.from_pretrained(model.dir, dtype=getattr(torch, args.dtype)).to(args.device).eval()
        run_transformers(hf, warmup, pad_id, _NoProgress())

    results = measure(workloads, llm, hf, pad_id, peer)
    report = {
        "model": model.described(args.dtype, config),
        "dtype": args.dtype,
        "device": args.device,
        "threads": torch.get_num_threads(),
        "quick": args.quick,
        "prefill_only": args.prefill_only,
        "engine_startup_s": round(engine_startup_s, 3),
        "prefix_cache": not args.peer,
        "workloads": [{k: v for k, v in asdict(r).items() if v is not None} for r in results],
    }
    if step_batches:
        from pdserve.benchmarks.gpu_engine import step_report

        report.update(step_report(llm.engine, step_batches, 128, STEPS, args.device))
    if peer is not None:
        report["peer"] = {"name": peer.peer, "version": peer.version, "python": str(peer_python),
                          "startup_s": round(peer.startup_s, 3), "prefix_caching": False,
                          "env": peer_env}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)
    return 0


def measure(workloads: list[Workload], llm, hf, pad_id: int, peer) -> list[Result]:
    """pdserve's engine on each workload, then transformers on it when `hf` is a model;
    the peer's figures (`benchmarks.peer.PeerResult`, measured before) join each row."""
    from tqdm import tqdm

    results = []
    total = sum(len(w.prompts) for w in workloads) * (2 if hf is not None else 1)
    with tqdm(total=total, desc="bench engine", unit="prompt", file=sys.stderr) as progress:
        for i, w in enumerate(workloads):
            progress.set_postfix_str(f"{w.name}: pdserve")
            engine_s, engine_tokens = run_engine(llm, w)
            progress.update(len(w.prompts))
            generated = sum(w.output_lens)
            r = Result(workload=w.name, num_prompts=len(w.prompts),
                       prompt_tokens=sum(len(p) for p in w.prompts), generated_tokens=generated,
                       engine_s=round(engine_s, 4), engine_tokens_per_s=round(generated / engine_s, 2))
            if hf is not None:
                progress.set_postfix_str(f"{w.name}: transformers")
                hf_s, hf_tokens = run_transformers(hf, w, pad_id, progress)
                r.transformers_s = round(hf_s, 4)
                r.transformers_tokens_per_s = round(generated / hf_s, 2)
                r.speedup = round(hf_s / engine_s, 4)
                r.greedy_match = match(engine_tokens, hf_tokens)
            if peer is not None:
                theirs = peer.workloads[i]
                r.peer_s = round(theirs.seconds, 4)
                r.peer_tokens_per_s = round(generated / theirs.seconds, 2)
                r.peer_ratio = round(theirs.seconds / engine_s, 4)
                r.peer_match = match(engine_tokens, theirs.token_ids)
            results.append(r)
    return results


def match(ours: list[list[int]], theirs: list[list[int]]) -> float:
    """Share of prompts whose generated tokens are identical."""
    return round(sum(a == b for a, b in zip(ours, theirs)) / len(ours), 3)


class _NoProgress:
    def update(self, n):
        pass


if __name__ == "__main__":
    process_gc.own_process()
    sys.exit(main(sys.argv[1:]))
