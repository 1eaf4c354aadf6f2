"""The random checkpoints the GPU check runs (geometry of each, written once into its
work directory with transformers), and the first prompt id above the special tokens."""

from __future__ import annotations

from pathlib import Path

ONE_B = dict(vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
             num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
             initializer_range=0.02, tie_word_embeddings=True)
SMOLLM2_GEOMETRY = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                        initializer_range=0.02, tie_word_embeddings=True, rope_theta=100000.0)
TINY = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
            initializer_range=0.02, tie_word_embeddings=True)
FIRST_ID = 17  # prompts are random ids above the special tokens


def checkpoint(workdir: Path, name: str, geometry: dict) -> str:
    from engine.checkpoint import write_checkpoint

    path = workdir / name
    if not (path / "config.json").exists():
        write_checkpoint(path, family="llama", seed=0, vocab_size=geometry["vocab_size"],
                         **{k: v for k, v in geometry.items() if k != "vocab_size"})
    return str(path)
