"""`pdserve bench host`: the host's part of a decode step on the GPU's step path, measured
on any machine.

On a GPU a decode step is one graph replay plus what the host does around it: schedule,
fill the step's inputs, sample's host half (the chosen ids come back), append the ids; and,
while the device runs the next step, the text (detokenizing, stop strings, the outputs).
However fast the device, a step at a large batch takes at least the first part; the text
is hidden only while it is shorter than the device's step.

This runs that path (`DecodeGraphs`' host side, overlapped text) on the CPU with the
device's work taken out: the forward returns one of a few fixed logits buffers of
`TEXT_IDS` columns, and each chosen column stands for a token of real text in the model's
tokenizer, so the argmax over a whole vocabulary, device work on a GPU, is not timed and
the text is words, not noise. The model's weights are never loaded: a 1-layer checkpoint
with its tokenizer prefills the prompts.

Per batch size, medians over the steps: ms per step, its `serial_ms` (on the step's critical path) and `text_ms`
(overlapped), beside the same with tokenizers' own decode per token
(`IncrementalDetokenizer`, the engine's way for a tokenizer that is not byte-level),
measured in the same run, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

from pdserve import process_gc
from pdserve.benchmarks.timers import Timers

TEXT = ("The prefill node computes the prompt's KV cache and the decode node streams the answer: "
        "pages move through NIXL, 東京 to 大阪, naïve café résumé, 🚀 ✓ — done. ") * 2
TEXT_IDS = 64  # logits columns: distinct tokens of TEXT a row can sample
BUFFERS = 8  # logits buffers cycled through, so a row's token changes every step
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def host_checkpoint(model_dir: str, out: Path) -> Path:
    """A 1-layer, hidden-64 checkpoint with `model_dir`'s tokenizer and vocabulary size."""
    from transformers import AutoTokenizer

    from pdserve.engine.checkpoint import write_checkpoint

    vocab = len(AutoTokenizer.from_pretrained(model_dir))
    write_checkpoint(out, family="llama", seed=0, vocab_size=vocab, hidden_size=64, intermediate_size=128,
                     num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=4096)
    for name in TOKENIZER_FILES:
        if (Path(model_dir) / name).exists():
            shutil.copy(Path(model_dir) / name, out / name)
    return out


def measure(model_dir: str, batch: int, steps: int, prompt_len: int, byte_level: bool) -> dict:
    import torch

    from pdserve.engine import LLM, SamplingParams
    from pdserve.engine import engine as engine_module
    from pdserve.engine.detokenizer import IncrementalDetokenizer
    from pdserve.engine.model.decode_graphs import DecodeGraphs

    llm = LLM(model_dir, device="cpu", attention_backend="torch", max_num_seqs=batch, max_num_batched_tokens=4096,
              enable_prefix_cache=False)
    engine, tokenizer = llm.engine, llm.engine.tokenizer
    if not byte_level:
        engine.new_detokenizer = lambda prompt, skip=True: IncrementalDetokenizer(tokenizer, skip, prompt)
    text_ids = list(dict.fromkeys(tokenizer.encode(TEXT, add_special_tokens=False)))[:TEXT_IDS]
    params = SamplingParams(max_tokens=steps + 64, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"host-{i}", text_ids[i % 7:][:prompt_len], params)
    while any(not s.output_token_ids for r in engine.requests.values() for s in r.seqs):
        engine.step()  # prefills on the CPU's own path

    runner = engine.runner
    graphs = DecodeGraphs(runner.model, runner.kv_cache, runner.page_size, batch, engine.max_model_len,
                          capture=False)
    logits = torch.randn(BUFFERS, batch, len(text_ids), generator=torch.Generator().manual_seed(0))
    calls = [0]

    def forward(b):
        calls[0] += 1
        return logits[calls[0] % BUFFERS, :b]

    graphs._forward = forward
    runner.graphs, runner.on_gpu, runner.backend = graphs, True, "triton"
    engine.overlap_output = True
    real_sample = engine_module.sample

    def sample(step_logits, rows):  # a column stands for a token of TEXT (~0.1 us a row, timed)
        chosen = real_sample(step_logits, rows)
        for s in chosen:
            s.token_id = text_ids[s.token_id]
        return chosen

    timers = Timers()
    engine._finish_text = timers.wrap("text", engine._finish_text)
    totals, texts = [], []
    with mock.patch.object(engine_module, "sample", sample):
        for i in range(8 + steps):  # 8 to warm up
            if i == 8:
                calls[0] = 0
            timers.seconds.clear()
            start = time.perf_counter()
            engine.step()
            totals.append(time.perf_counter() - start)
            texts.append(timers.seconds["text"])
    for request_id in list(engine.requests):
        engine.abort(request_id)
    # Medians: a garbage collection or another process now and then lengthens one step.
    total, text = statistics.median(totals[8:]), statistics.median(texts[8:])
    serial = statistics.median(t - x for t, x in zip(totals[8:], texts[8:]))
    return {"ms_per_step": round(total * 1e3, 4), "serial_ms": round(serial * 1e3, 4),
            "text_ms": round(text * 1e3, 4), "us_per_sequence": round(total * 1e6 / batch, 2),
            "graph_steps": calls[0]}  # timed steps that took the graphs' path: all of them


def run(model_dir: str, batches: list[int], steps: int, prompt_len: int) -> dict:
    import torch
    from transformers import AutoTokenizer

    from pdserve.engine.detokenizer import byte_level_table

    with tempfile.TemporaryDirectory(prefix="pdserve-host-") as tmp:
        checkpoint = str(host_checkpoint(model_dir, Path(tmp)))
        byte_level = byte_level_table(AutoTokenizer.from_pretrained(checkpoint), True) is not None
        rows = {}
        for b in batches:
            this = measure(checkpoint, b, steps, prompt_len, byte_level=True)
            base = measure(checkpoint, b, steps, prompt_len, byte_level=False)
            rows[str(b)] = {**this, "baseline": base,
                            "speedup": round(base["ms_per_step"] / max(this["ms_per_step"], 1e-9), 2)}
    return {"detokenizer": "byte-level" if byte_level else "tokenizers' decode", "threads": torch.get_num_threads(),
            "baseline": "tokenizers' decode per token (IncrementalDetokenizer)", "steps": steps,
            "prompt_len": prompt_len, "batches": rows}


def build_parser() -> argparse.ArgumentParser:
    from pdserve.benchmarks.model_choice import add_model_flag

    parser = argparse.ArgumentParser(prog="pdserve bench host", description=__doc__.split("\n\n")[0])
    add_model_flag(parser, help="whose tokenizer the text is made with (its weights are not loaded)")
    parser.add_argument("--batches", default="1,64,256", help="decode batch sizes (default 1,64,256)")
    parser.add_argument("--steps", type=int, default=100, help="decode steps timed per batch (default 100)")
    parser.add_argument("--prompt-len", type=int, default=16, help="tokens per prompt (default 16)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    from pdserve.benchmarks.model_choice import resolve_or_exit

    torch.set_num_threads(1)  # host work is one thread's
    model = resolve_or_exit(args.model, "pdserve bench host")
    batches = [int(b) for b in args.batches.split(",")]
    report = {"model": model.record("float32"), **run(model.dir, batches, args.steps, args.prompt_len)}
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    process_gc.own_process()
    sys.exit(main(sys.argv[1:]))
