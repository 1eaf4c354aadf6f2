"""Shared fixtures for engine tests: tiny checkpoints (one per family, written once per
session), transformers' greedy reference outputs (plain and under penalties), and engines whose page pool is checked
to be full again when the test ends."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from pdserve.engine import LLM, Engine, EngineConfig
from pdserve.engine.checkpoint import FAMILIES, write_checkpoint


@pytest.fixture(scope="session")
def checkpoint_dirs(tmp_path_factory):
    """family -> checkpoint dir, written on first use."""
    root = tmp_path_factory.mktemp("checkpoints")
    cache: dict[str, str] = {}

    def get(family: str) -> str:
        if family not in cache:
            cache[family] = str(write_checkpoint(root / family, family=family, seed=0))
        return cache[family]

    return get


@pytest.fixture(scope="session")
def hf_greedy(checkpoint_dirs):
    """(family, prompt ids, max_new_tokens) -> transformers' greedy continuation."""
    from transformers import AutoModelForCausalLM

    models = {}

    @functools.lru_cache(maxsize=None)
    def run(family: str, prompt: tuple[int, ...], max_new_tokens: int) -> list[int]:
        if family not in models:
            model = AutoModelForCausalLM.from_pretrained(checkpoint_dirs(family), dtype=torch.float32)
            models[family] = model.eval()
        ids = torch.tensor([list(prompt)])
        with torch.inference_mode():
            out = models[family].generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
            )
        return out[0, len(prompt) :].tolist()

    return lambda family, prompt, n: run(family, tuple(prompt), n)


@pytest.fixture(scope="session")
def hf_logprobs(checkpoint_dirs):
    """(family, prompt ids) -> transformers' log-softmax over the prompt [len - 1, vocab]:
    row p scores prompt token p + 1."""
    from transformers import AutoModelForCausalLM

    @functools.lru_cache(maxsize=None)
    def model(family):
        return AutoModelForCausalLM.from_pretrained(checkpoint_dirs(family), dtype=torch.float32).eval()

    def run(family, prompt):
        with torch.inference_mode():
            logits = model(family)(torch.tensor([prompt])).logits[0, :-1].float()
        return torch.log_softmax(logits, dim=-1)

    return run


@pytest.fixture(scope="session")
def hf_penalized(checkpoint_dirs):
    """(prompt, SamplingParams) -> transformers' greedy continuation of the llama checkpoint
    under the params' bias and penalties (its own processors, and OpenAI's two as one more)."""
    from transformers import AutoModelForCausalLM

    from pdserve.benchmarks.constrained import transformers_penalized

    model = AutoModelForCausalLM.from_pretrained(checkpoint_dirs("llama"), dtype=torch.float32).eval()

    @functools.lru_cache(maxsize=None)
    def run(prompt: tuple[int, ...], max_new: int, presence, frequency, repetition, bias) -> list[int]:
        return transformers_penalized(model, [list(prompt)], max_new, 0, presence_penalty=presence,
                                      frequency_penalty=frequency, repetition_penalty=repetition,
                                      logit_bias=dict(bias))[0]

    return lambda prompt, p: run(tuple(prompt), p.max_tokens, p.presence_penalty, p.frequency_penalty,
                                 p.repetition_penalty, tuple(sorted(p.logit_bias.items())))


def _prompts_of_lengths(lengths, seed=0, vocab=512):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="session")
def prompts_of_lengths():
    """(lengths, seed) -> random prompts (ids 3.., so never a special token) of those lengths."""
    return _prompts_of_lengths


@pytest.fixture
def make_engine(checkpoint_dirs):
    """Engines (or LLMs, with llm=True) that must hold no pages when the test ends."""
    engines = []

    def make(family: str = "llama", llm: bool = False, **kwargs):
        if llm:
            obj = LLM(checkpoint_dirs(family), **kwargs)
            engines.append(obj.engine)
        else:
            obj = Engine(EngineConfig(model_dir=checkpoint_dirs(family), **kwargs))
            engines.append(obj)
        return obj

    yield make
    for engine in engines:
        assert engine.num_free_pages() == engine.num_total_pages(), "pages leaked"


def _cpu_flags() -> set[str]:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return set(next((line for line in text.splitlines() if line.startswith("flags")), "").split())


_CPU_FLAGS = _cpu_flags()
# The AVX2 build is a second variant only where the native one is AVX-512; elsewhere the
# native build already is the AVX2 one (or there is none), and it is not run twice.
_ISAS = ["native", "avx2"] if "avx512f" in _CPU_FLAGS and {"avx2", "fma"} <= _CPU_FLAGS else ["native"]


@pytest.fixture(params=_ISAS)
def kernel_isa(request, monkeypatch):
    """Run a C-kernel test as built for this CPU, then (on an AVX-512 CPU) built without
    AVX-512, so the AVX2 paths are checked on every x86 machine that has them."""
    from pdserve.engine import native

    if request.param == "avx2":
        monkeypatch.setenv("PDSERVE_KERNEL_CFLAGS", "-mno-avx512f")
        monkeypatch.setattr(native, "_libraries", {})
    return request.param
