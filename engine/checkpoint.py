"""Writes small Hugging Face checkpoint directories: config.json, safetensors weights and a
trained tokenizer.

Tests build their models with this (nothing is downloaded), and the random-weight demo
model (`demo-random`) is written by it on first use. Everything is deterministic for a given
seed: the same call writes byte-identical weights and the same tokenizer.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from .families import FAMILIES, config_of  # noqa: F401 (FAMILIES: the tests' list)

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|system|>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|eos|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_WORDS = (
    "the a an of to in and is was for on that with as by at from it this be are or his her "
    "model token cache page prefill decode router node request stream serve batch layer head "
    "river mountain city light shadow window garden music paper letter story market winter "
    "quick brown fox jumps over lazy dog while seven bright stars slowly turn around north "
    "café naïve résumé straße über 東京 北京 数据 模型 日本語 한국어 Ωmega πr² €100 ✓ 🚀 🙂 "
    "0 1 2 3 4 5 6 7 8 9 10 42 100 2024 , . ; : ! ? ( ) - \" '"
).split()


def training_corpus(num_lines: int = 4000, seed: int = 0) -> list[str]:
    """Deterministic pseudo-text covering ASCII, accented Latin, CJK and emoji."""
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        n = rng.randint(4, 24)
        lines.append(" ".join(rng.choice(_WORDS) for _ in range(n)))
    return lines


def write_tokenizer(out_dir: str | os.PathLike, vocab_size: int = 512, seed: int = 0) -> None:
    """Train a byte-level BPE tokenizer on the built-in corpus and save it as a
    `PreTrainedTokenizerFast` (tokenizer.json + tokenizer_config.json)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_corpus(seed=seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))


def write_checkpoint(
    out_dir: str | os.PathLike,
    family: str = "llama",
    seed: int = 0,
    vocab_size: int = 512,
    max_shard_size: str | None = None,
    weights_dtype: str = "float32",
    **config_overrides,
) -> Path:
    """Write a randomly initialised checkpoint of `family` into `out_dir` and return it.

    `config_overrides` go into the transformers config (hidden_size, num_hidden_layers,
    num_key_value_heads, head_dim, ...). `max_shard_size` (e.g. "200KB") splits the weights
    over several safetensors files with an index, as large checkpoints are. `weights_dtype`:
    the weights' as stored (initialised in float32 all the same, so the values match).
    """
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out, vocab_size=vocab_size, seed=seed)
    config = config_of(family, vocab_size, **config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Biases start at 0, and norms' weights at 0 (Gemma: 1 + weight) or 1: random ones show
    # a loader that drops them.
    random_norms = family in ("gemma", "gemma2", "gemma3", "olmo2", "olmo3", "exaone4", "hunyuan_v1_dense", "hunyuan_v1_moe",
                              "cohere", "cohere2", "nemotron")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith((".bias", "_proj_bias")) or (random_norms and name.endswith("norm.weight")):
                p.normal_(0.0, 0.3)
            elif family in ("starcoder2", "stablelm") and (name.endswith("norm.weight") or "_layernorm.norms." in name):
                # about 1 (their biases are random too), StableLM 2 12B's norms of each head of q and k too
                p.normal_(1.0, 0.3)
            elif name.endswith(".sinks"):  # GPT-OSS's: as large as a score, to take a share of each softmax
                p.normal_(0.0, 1.0)
            elif ".act_fn.alpha_" in name:  # xIELU's, alike in every layer at first
                p.add_(torch.randn_like(p) * 0.3)
        # A router's correction bias (GLM-4.5's buffer, ERNIE's parameter): small beside the
        # scores, so that the choice still depends on the token.
        for name, t in [*model.named_buffers(), *model.named_parameters()]:
            if name.endswith("e_score_correction_bias"):
                t.normal_(0.0, 0.05)
    model.eval().to(getattr(torch, weights_dtype))
    kwargs = {"safe_serialization": True}
    if max_shard_size:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(str(out), **kwargs)
    return out


def default_cache_dir() -> Path:
    root = os.environ.get("PDSERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "pdserve")
    return Path(root)


def ensure_demo_model(target: str | os.PathLike, extra_files: dict[str, str] | None = None) -> Path:
    """The random-weight demo model: a small Llama checkpoint written once into `target`
    (with `extra_files`, name -> text, beside it).

    Written into a temporary directory and renamed into place, so concurrent first starts
    (router, prefill and decode at once) never see half a checkpoint.
    """
    target = Path(target)
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.{os.getpid()}.tmp"
    write_checkpoint(
        tmp,
        family="llama",
        seed=1234,
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        initializer_range=0.05,
    )
    for name, text in (extra_files or {}).items():
        (tmp / name).write_text(text)
    try:
        os.rename(tmp, target)
    except OSError:
        # Another process won the race; its copy is identical.
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return target


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_lora_adapter(base_dir: str | os.PathLike, out_dir: str | os.PathLike, seed: int = 0, rank: int = 4,
                       alpha: float = 8.0, targets: tuple[str, ...] = LORA_TARGETS, **lora_config) -> Path:
    """Write a PEFT LoRA adapter of the checkpoint in `base_dir` with random weights (both
    A and B, so it changes the output) into `out_dir`, as PEFT saves one; needs `peft`."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False,
                        **lora_config)
    model = get_peft_model(base, config)
    with torch.no_grad():  # PEFT's own random init is small: make the adapter matter
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.3)
    model.save_pretrained(str(out_dir))
    return Path(out_dir)
