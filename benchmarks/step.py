"""`pdserve bench step`: where one engine step's time goes, by kind of work.

A batch of prompts is prefilled, then decoded; every step is timed whole and, inside it,
the calls of each kind are timed by wrapping them (a fraction of a microsecond each):
- matmuls: every `Linear` call (the four of each layer and the LM head);
- attention: the attention of every layer (paged decode kernel, SDPA for prefill chunks);
- norms/rope/activation: residual add + RMS norm, rotary + KV store, SiLU-and-multiply;
- sampling: turning logits into tokens (and appending them: detokenizing, stop checks);
- scheduling: choosing the step's sequences and tokens;
- python and dispatch: the rest of the step (model inputs, the attention plan, bookkeeping,
  the loop over layers).
The report gives milliseconds per step for the prefill phase and the decode phase (batch
`--batch`, contexts from `--prompt-len` on), and each kind's share. Not a throughput
figure (`pdserve bench engine` is): a map of where to look.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from pdserve import process_gc
from pdserve.arith import ceil_div
from pdserve.benchmarks.timers import Timers

KINDS = ("matmuls", "attention", "norms/rope/activation", "sampling", "scheduling")


def instrument(engine, timers: Timers) -> None:
    """Wrap the engine's calls of each kind (instance attributes, so only this engine)."""
    model, runner = engine.model, engine.runner
    for layer in model.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            lin = getattr(layer, name)
            setattr(layer, name, timers.wrap("matmuls", lin))
    model.lm_head = timers.wrap("matmuls", model.lm_head)
    for name in ("add_rms_norm", "rope_store", "silu_mul"):
        setattr(model.ops, name, timers.wrap("norms/rope/activation", getattr(model.ops, name)))
    engine._sample = timers.wrap("sampling", engine._sample)
    engine.scheduler.schedule = timers.wrap("scheduling", engine.scheduler.schedule)
    attend = runner._attend_fn

    def attend_fn(*args):
        return timers.wrap("attention", attend(*args))

    runner._attend_fn = attend_fn


def measure(engine, prompts: list[list[int]], max_tokens: int, decode_steps: int) -> dict:
    from pdserve.engine import SamplingParams

    timers = Timers()
    instrument(engine, timers)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"step-{i}", prompt, params)

    def phase(steps_left):
        timers.seconds.clear()
        start, steps = time.perf_counter(), 0
        while steps_left(steps):
            engine.step()
            steps += 1
        total = time.perf_counter() - start
        parts = {kind: timers.seconds.get(kind, 0.0) for kind in KINDS}
        parts["python and dispatch"] = max(0.0, total - sum(parts.values()))
        return {
            "steps": steps,
            "ms_per_step": round(1e3 * total / max(steps, 1), 2),
            # 4 places: scheduling a few decodes takes microseconds, not hundredths of a ms
            "ms_per_step_by_kind": {k: round(1e3 * v / max(steps, 1), 4) for k, v in parts.items()},
            "share_by_kind": {k: round(v / total, 3) for k, v in parts.items()},
        }

    def prefilling(_):
        return any(not s.output_token_ids for r in engine.requests.values() for s in r.seqs)

    prefill = phase(prefilling)
    decode = phase(lambda steps: steps < decode_steps and engine.has_unfinished())
    for request_id in list(engine.requests):
        engine.abort(request_id)
    return {"prefill": prefill, "decode": decode}


def build_parser() -> argparse.ArgumentParser:
    from pdserve.benchmarks.model_choice import add_model_flag

    parser = argparse.ArgumentParser(prog="pdserve bench step", description=__doc__.split("\n\n")[0])
    add_model_flag(parser)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--batch", type=int, default=32, help="prompts decoded together (default 32)")
    parser.add_argument("--prompt-len", type=int, default=256, help="tokens per prompt (default 256)")
    parser.add_argument("--decode-steps", type=int, default=40, help="decode steps measured (default 40)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    from pdserve.benchmarks.engine import FIRST_PROMPT_TOKEN
    from pdserve.benchmarks.model_choice import resolve_or_exit
    from pdserve.engine import LLM

    from transformers import AutoConfig

    from pdserve.benchmarks.engine import Workload, kv_cache_bytes

    model = resolve_or_exit(args.model, "pdserve bench step")
    config = AutoConfig.from_pretrained(model.dir)
    rng = random.Random(0)
    prompts = [[rng.randrange(FIRST_PROMPT_TOKEN, config.vocab_size) for _ in range(args.prompt_len)]
               for _ in range(args.batch)]
    # Enough tokens that no sequence finishes while later ones are still prefilling, and
    # room for every sequence at once: the whole batch decodes together, none is preempted.
    max_tokens = args.decode_steps + ceil_div(args.batch * args.prompt_len, 256) + 2
    room = kv_cache_bytes(config, args.dtype, [Workload("step", prompts, [max_tokens] * args.batch, 1)], 16)
    llm = LLM(model.dir, dtype=args.dtype, enable_prefix_cache=False, kv_cache_memory_bytes=room)
    engine = llm.engine
    report = {"model": model.record(args.dtype), "threads": torch.get_num_threads(), "batch": args.batch,
              "prompt_len": args.prompt_len,
              **measure(engine, prompts, max_tokens, args.decode_steps)}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for phase in ("prefill", "decode"):
            r = report[phase]
            parts = ", ".join(f"{k} {v:.1f}" for k, v in r["ms_per_step_by_kind"].items())
            print(f"{phase}: {r['steps']} steps, {r['ms_per_step']:.1f} ms/step ({parts})")
    return 0


if __name__ == "__main__":
    process_gc.own_process()
    sys.exit(main(sys.argv[1:]))
