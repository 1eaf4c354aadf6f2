"""``pdserve bench lora``: what serving LoRA adapters costs the engine (engine/lora.py).

One engine (the real model by default) loads `--adapters` random adapters of rank `--rank`
on all seven projections of every layer, and runs the same batch of `--requests` prompts
of `--prompt-tokens` ids, each generating `--max-tokens` greedy tokens, in three modes: the
model alone (`base`, the baseline), every request with one adapter (`one`), and the
requests spread over all the adapters (`mixed`: every step holds rows of each). The modes
alternate, round after round, so drift hits all three; each mode's figure is its best
round. Printed (as JSON with `--json`): each mode's generated tokens per second and its
ratio to the base's.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from pdserve import process_gc
from pdserve.benchmarks.model_choice import add_model_flag, resolve_or_exit

MODES = ("base", "one", "mixed")
TARGETS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def _parse(argv):
    p = argparse.ArgumentParser(prog="pdserve bench lora", description=__doc__.split("\n\n")[0])
    add_model_flag(p)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="(default %(default)s)")
    p.add_argument("--adapters", type=int, default=4, help="adapters loaded (default %(default)s)")
    p.add_argument("--rank", type=int, default=16, help="each adapter's rank (default %(default)s)")
    p.add_argument("--requests", type=int, default=16, help="prompts per batch (default %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=128, help="ids per prompt (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens each request generates (default %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="batches per mode (default %(default)s)")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--json", action="store_true", help="print the report as JSON (else a summary)")
    p.add_argument("--out", metavar="FILE", help="also write the JSON report here")
    return p.parse_args(argv)


def write_adapter(model_dir: str, out: Path, rank: int, seed: int) -> Path:
    """A PEFT LoRA adapter of the checkpoint in `model_dir`, random A and B on every
    projection, written as PEFT saves one (no PEFT needed)."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((Path(model_dir) / "config.json").read_text())
    hidden, inter, heads = config["hidden_size"], config["intermediate_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads") or heads
    sizes = {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv * head_dim), "v_proj": (hidden, kv * head_dim),
             "o_proj": (heads * head_dim, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
             "down_proj": (inter, hidden)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for part, modules in TARGETS.items():
            for module in modules:
                fan_in, fan_out = sizes[module]
                key = f"base_model.model.model.layers.{layer}.{part}.{module}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.02
                tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.02
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
        "target_modules": [m for modules in TARGETS.values() for m in modules]}))
    return out


def run_mode(llm, prompts: list[list[int]], loras: list[str], max_tokens: int) -> float:
    """Generated tokens per second of one batch, each prompt with its adapter ("" none)."""
    from pdserve.engine import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for i, (prompt, lora) in enumerate(zip(prompts, loras)):
        engine.add_request(f"{time.monotonic_ns()}-{i}", prompt, params, lora=lora)
    generated = 0
    while engine.has_unfinished():
        generated += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
    return generated / (time.perf_counter() - start)


def report_of(best: dict[str, float]) -> dict:
    """Each mode's tokens per second and its ratio to the base's."""
    return {**{f"{m}_tok_s": round(best[m], 1) for m in MODES},
            **{f"{m}_vs_base": round(best[m] / best["base"], 3) for m in MODES if m != "base"}}


def main(argv=None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    measured = resolve_or_exit(args.model, "pdserve bench lora")
    from pdserve.engine import LLM

    with tempfile.TemporaryDirectory(prefix="pdserve-lora-") as root:
        names = [f"lora{i}" for i in range(args.adapters)]
        modules = [f"{n}={write_adapter(measured.dir, Path(root) / n, args.rank, i)}" for i, n in enumerate(names)]
        llm = LLM(measured.dir, dtype=args.dtype, lora_modules=modules, num_threads=args.num_threads,
                  enable_prefix_cache=False, max_num_seqs=max(args.requests, 1))
        vocab = llm.engine.vocab_size
        rng = random.Random(0)
        prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.requests)]
        loras = {"base": [""] * args.requests, "one": [names[0]] * args.requests,
                 "mixed": [names[i % len(names)] for i in range(args.requests)]}
        run_mode(llm, prompts[:1], [""], 2)  # warm-up: first-call costs out of every figure
        best = dict.fromkeys(MODES, 0.0)
        for _ in range(args.rounds):
            for mode in MODES:
                best[mode] = max(best[mode], run_mode(llm, prompts, loras[mode], args.max_tokens))
    report = {"model": measured.record(args.dtype), "adapters": args.adapters, "rank": args.rank,
              "requests": args.requests, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
              "rounds": args.rounds, **report_of(best)}
    text = json.dumps(report, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text if args.json else "  ".join(f"{k} {v}" for k, v in report.items() if k.endswith(("tok_s", "base"))))
    return 0


if __name__ == "__main__":
    process_gc.own_process()
    sys.exit(main())
