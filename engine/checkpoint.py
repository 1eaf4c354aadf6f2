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

FAMILIES = ("llama", "llama3", "mistral", "qwen2", "qwen3", "phi3", "granite", "smollm3", "gemma", "gemma2", "gemma3",
            "olmo2", "olmo3", "exaone4", "seed_oss", "ministral", "ministral3", "arcee", "apertus", "ernie4_5",
            "helium", "glm", "glm4", "cwm", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "gpt_oss",
            "glm4_moe", "dots1", "ernie4_5_moe")

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


def _config(family: str, vocab_size: int, **overrides):
    from transformers import (ApertusConfig, ArceeConfig, CwmConfig, Dots1Config, Ernie4_5Config, Ernie4_5_MoeConfig,
                              Exaone4Config, Gemma2Config, Gemma3TextConfig, GemmaConfig, Glm4Config, Glm4MoeConfig,
                              GlmConfig, GptOssConfig, GraniteConfig, GraniteMoeConfig, GraniteMoeSharedConfig,
                              HeliumConfig, LlamaConfig, Ministral3Config, MinistralConfig, MistralConfig,
                              MixtralConfig, Olmo2Config, Olmo3Config, OlmoeConfig, Phi3Config, Qwen2Config,
                              Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig, SeedOssConfig, SmolLM3Config)

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        dtype="float32",
    )
    if family == "llama":
        cls = LlamaConfig
    elif family == "llama3":
        cls = LlamaConfig
        common.update(
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            },
        )
    elif family == "mistral":
        cls = MistralConfig
        common.update(sliding_window=None)
    elif family == "qwen2":
        cls = Qwen2Config
        common.update(tie_word_embeddings=True)
    elif family == "qwen3":
        cls = Qwen3Config
        common.update(head_dim=24, tie_word_embeddings=True)
    elif family == "phi3":  # q|k|v and gate|up stored fused
        cls = Phi3Config
        common.update(sliding_window=None, original_max_position_embeddings=2048)
    elif family == "granite":  # Granite 3's multipliers, every one away from 1
        cls = GraniteConfig
        common.update(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0078125,
                      logits_scaling=8.0, tie_word_embeddings=True)
    elif family == "smollm3":  # its second layer without rotary embeddings (NoPE)
        cls = SmolLM3Config
        common.update(no_rope_layer_interval=2, rope_theta=5000000.0, tie_word_embeddings=True)
    elif family == "gemma":  # norms of 1 + weight, GeLU (tanh), embeddings scaled; q wider than hidden
        cls = GemmaConfig
        common.update(head_dim=24, hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True, initializer_range=0.02)
    elif family == "olmo2":  # norms after attention and the MLP, none before; q and k normed whole
        cls = Olmo2Config
    elif family == "olmo3":  # OLMo 2's norms; an 8-token window on its first layer, YaRN on its full one
        cls = Olmo3Config
        common.update(sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                      rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 500000.0},
                                       "full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 500000.0,
                                                          "original_max_position_embeddings": 512}})
    elif family == "exaone4":  # norms after attention and the MLP; a window on its first layer, no rope on its full one
        cls = Exaone4Config
        common.update(sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    elif family == "seed_oss":  # Llama with q, k and v biases; heads wider than hidden / heads
        cls = SeedOssConfig
        common.update(head_dim=24)
    elif family == "ministral":  # Mistral with windows by layer: 8 tokens on its first
        cls = MinistralConfig  # (whose head_dim transformers does not fill in)
        common.update(sliding_window=8, layer_types=["sliding_attention", "full_attention"], head_dim=16)
    elif family == "ministral3":  # YaRN, and queries scaled up from position 16 on (Llama 4's scaling)
        cls = Ministral3Config
        common.update(rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0,
                                       "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
                                       "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.5})
    elif family == "arcee":  # an MLP without a gate: down(relu(up(x))^2)
        cls = ArceeConfig
    elif family == "apertus":  # an MLP without a gate, xIELU's parameters each layer's; q and k normed by head
        cls = ApertusConfig
        common.update(rope_parameters={"rope_type": "llama3", "rope_theta": 12000000.0, "factor": 8.0,
                                       "original_max_position_embeddings": 256, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0})
    elif family == "ernie4_5":  # rotary pairs of adjacent dimensions; biases everywhere (use_bias)
        cls = Ernie4_5Config
        common.update(use_bias=True)
    elif family == "helium":  # rotary pairs of adjacent dimensions
        cls = HeliumConfig
        common.update(head_dim=16)  # its o_proj takes hidden_size: heads * head_dim must be it
    elif family in ("glm", "glm4"):  # adjacent rotary pairs over half of each head; q, k and v biases
        cls = GlmConfig if family == "glm" else Glm4Config  # (GLM-4's norms after attention and the MLP too)
        common.update(head_dim=16, partial_rotary_factor=0.5, attention_bias=True)
    elif family == "cwm":  # Llama with windows by layer (its first full, the next an 8-token window); Llama 3's rope
        cls = CwmConfig
        common.update(sliding_window=8, rope_parameters={"rope_type": "llama3", "rope_theta": 1000000.0, "factor": 16.0,
                                                         "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                                         "original_max_position_embeddings": 256})
    elif family == "gemma2":  # caps small enough to bite, an 8-token window on its first layer
        cls = Gemma2Config
        common.update(head_dim=16, query_pre_attn_scalar=20, tie_word_embeddings=True, sliding_window=8,
                      initializer_range=0.05, attn_logit_softcapping=0.1, final_logit_softcapping=0.5)
    elif family == "gemma3":  # an 8-token sliding window, then a global layer of its own (linear-scaled) rope
        cls = Gemma3TextConfig
        common.update(head_dim=24, query_pre_attn_scalar=32, tie_word_embeddings=True,
                      initializer_range=0.02, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                      rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                       "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                          "rope_theta": 1000000.0}})
    elif family == "mixtral":  # 4 experts, 2 a token
        cls = MixtralConfig
        common.update(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)
    elif family == "qwen2_moe":  # a shared expert beside 4 routed ones, their weights not renormalised
        cls = Qwen2MoeConfig
        common.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                      shared_expert_intermediate_size=96, norm_topk_prob=False)
    elif family == "qwen3_moe":  # its first layer's MLP dense (mlp_only_layers), 8 experts after
        cls = Qwen3MoeConfig
        common.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=40, mlp_only_layers=[0],
                      head_dim=24, norm_topk_prob=True)
    elif family == "olmoe":  # 8 experts, 2 a token, not renormalised; q and k normed whole
        cls = OlmoeConfig
        common.update(num_experts=8, num_experts_per_tok=2, norm_topk_prob=False)
    elif family in ("granitemoe", "granitemoeshared"):  # experts stored stacked; multipliers that leave them a say
        cls = GraniteMoeConfig if family == "granitemoe" else GraniteMoeSharedConfig
        common.update(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48, embedding_multiplier=2.0,
                      residual_multiplier=0.8, attention_multiplier=0.125, logits_scaling=2.0, tie_word_embeddings=True)
    elif family == "gpt_oss":  # sinks; an 8-token window on its first layer, YaRN; a clamp that bites
        cls = GptOssConfig
        common.update(head_dim=16, num_local_experts=4, num_experts_per_tok=2, intermediate_size=48, sliding_window=8,
                      swiglu_limit=0.5, rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                         "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                                                         "original_max_position_embeddings": 512})
    elif family == "glm4_moe":  # a dense first layer; 8 experts in 4 groups, 2 kept; a shared expert
        cls = Glm4MoeConfig
        common.update(head_dim=16, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                      topk_group=2, first_k_dense_replace=1, use_qk_norm=True, attention_bias=True,
                      routed_scaling_factor=2.5, num_hidden_layers=3)
    elif family == "dots1":  # GLM-4.5's routing under Qwen3's attention; an 8-token window on its last layer
        cls = Dots1Config
        common.update(head_dim=16, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
                      num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1, norm_topk_prob=True,
                      routed_scaling_factor=2.5, num_hidden_layers=3, sliding_window=8, max_window_layers=2)
    elif family == "ernie4_5_moe":  # a dense first layer, 8 experts (2 a token) and a shared one; biases
        cls = Ernie4_5_MoeConfig
        common.update(head_dim=16, moe_intermediate_size=32, moe_num_experts=8, moe_k=2, moe_num_shared_experts=1,
                      moe_layer_start_index=1, num_hidden_layers=3, use_bias=True)
    else:
        raise ValueError(f"unknown model family {family!r}; expected one of {FAMILIES}")
    common.update(overrides)
    return cls(**common)


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
    config = _config(family, vocab_size, **config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Biases start at 0, and norms' weights at 0 (Gemma: 1 + weight) or 1: random ones show
    # a loader that drops them.
    random_norms = family in ("gemma", "gemma2", "gemma3", "olmo2", "olmo3", "exaone4")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith((".bias", "_proj_bias")) or (random_norms and name.endswith("norm.weight")):
                p.normal_(0.0, 0.3)
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
