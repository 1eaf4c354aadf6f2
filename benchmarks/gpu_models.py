"""The random checkpoints the GPU check runs (geometry of each, written once with
transformers), transformers' greedy reference on them, and the first prompt id above the
special tokens."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

ONE_B = dict(vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
             num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
             initializer_range=0.02, tie_word_embeddings=True,
             weights_dtype="bfloat16")  # as every run of it loads it: half the bytes to write and read
SMOLLM2_GEOMETRY = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                        initializer_range=0.02, tie_word_embeddings=True, rope_theta=100000.0)
TINY = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
            initializer_range=0.02, tie_word_embeddings=True)
FIRST_ID = 17  # prompts are random ids above the special tokens


def checkpoint(path: Path, geometry: dict) -> str:
    """A random Llama of `geometry` (seed 0) at `path`, written once (into a temporary
    directory renamed into place, so a run killed while writing leaves no half model)."""
    if not (path / "config.json").exists():
        from pdserve.engine.checkpoint import write_checkpoint

        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        write_checkpoint(tmp, family="llama", seed=0, **geometry)
        try:
            tmp.rename(path)
        except OSError:  # another run wrote it first: the same bytes (seed 0)
            shutil.rmtree(tmp, ignore_errors=True)
    return str(path)


def transformers_greedy(model_dir: str, device: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, exactly `n` tokens, on `device`."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=n, min_new_tokens=n)
            out.append(gen[0, len(prompt):].tolist())
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out
