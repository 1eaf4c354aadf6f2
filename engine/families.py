"""The tiny random checkpoints' configs, one per model family served (engine/model/arch.py):
every family's mechanisms set so that they change the output (windows shorter than the
test prompts, caps and clamps that bite, multipliers away from 1), so a loader or a kernel
that drops one gives other tokens than transformers. engine/checkpoint.py writes them."""

from __future__ import annotations

_YARN = {"rope_type": "yarn", "beta_fast": 32.0, "beta_slow": 1.0}
_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 16.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                "original_max_position_embeddings": 256}
_TWO_KINDS = {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}
# DeepSeek-V3's routing: a dense first layer, then 8 experts in 4 groups (the best 2 kept), 2 a token.
_GROUPED = dict(head_dim=16, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5, num_hidden_layers=3)

_GRANITE_MOE = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48, embedding_multiplier=2.0,
                           residual_multiplier=0.8, attention_multiplier=0.125, logits_scaling=2.0,
                           tie_word_embeddings=True)

# family: (transformers' config class, what sets it apart from the common fields)
CONFIGS: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {}),
    "llama3": ("LlamaConfig", dict(rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256})),
    "mistral": ("MistralConfig", dict(sliding_window=None)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(head_dim=24, tie_word_embeddings=True)),
    # q|k|v and gate|up stored fused; Phi-3.5's LongRoPE, its context past the original 32 positions
    "phi3": ("Phi3Config", dict(sliding_window=None, original_max_position_embeddings=32, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + i / 10 for i in range(8)],
        "long_factor": [4.0 + i for i in range(8)]})),
    # Granite 3's multipliers, every one away from 1
    "granite": ("GraniteConfig", dict(embedding_multiplier=12.0, residual_multiplier=0.22,
                                      attention_multiplier=0.0078125, logits_scaling=8.0, tie_word_embeddings=True)),
    # its second layer without rotary embeddings (NoPE)
    "smollm3": ("SmolLM3Config", dict(no_rope_layer_interval=2, rope_theta=5000000.0, tie_word_embeddings=True)),
    # norms of 1 + weight, GeLU (tanh), embeddings scaled; q wider than hidden
    "gemma": ("GemmaConfig", dict(head_dim=24, hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True,
                                  initializer_range=0.02)),
    # caps small enough to bite, an 8-token window on its first layer
    "gemma2": ("Gemma2Config", dict(head_dim=16, query_pre_attn_scalar=20, tie_word_embeddings=True, sliding_window=8,
                                    initializer_range=0.05, attn_logit_softcapping=0.1, final_logit_softcapping=0.5)),
    # an 8-token sliding window, then a global layer of its own (linear-scaled) rope
    "gemma3": ("Gemma3TextConfig", dict(
        head_dim=24, query_pre_attn_scalar=32, tie_word_embeddings=True, initializer_range=0.02, **_TWO_KINDS,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}})),
    # norms after attention and the MLP, none before; q and k normed whole
    "olmo2": ("Olmo2Config", {}),
    # OLMo 2's norms; an 8-token window on its first layer, YaRN on its full one
    "olmo3": ("Olmo3Config", dict(**_TWO_KINDS, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0},
        "full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 500000.0,
                           "original_max_position_embeddings": 512}})),
    # norms after attention and the MLP; a window on its first layer, no rope on its full one
    "exaone4": ("Exaone4Config", dict(_TWO_KINDS)),
    # Llama with q, k and v biases; heads wider than hidden / heads
    "seed_oss": ("SeedOssConfig", dict(head_dim=24)),
    # Mistral with windows by layer: 8 tokens on its first (its head_dim transformers does not fill in)
    "ministral": ("MinistralConfig", dict(**_TWO_KINDS, head_dim=16)),
    # YaRN, and queries scaled up from position 16 on (Llama 4's scaling)
    "ministral3": ("Ministral3Config", dict(rope_parameters={
        **_YARN, "rope_theta": 1000000.0, "factor": 16.0, "original_max_position_embeddings": 16,
        "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.5})),
    # an MLP without a gate: down(relu(up(x))^2)
    "arcee": ("ArceeConfig", {}),
    # an MLP without a gate, xIELU's parameters each layer's; q and k normed by head
    "apertus": ("ApertusConfig", dict(rope_parameters={**_LLAMA3_ROPE, "rope_theta": 12000000.0, "factor": 8.0})),
    # rotary pairs of adjacent dimensions; biases everywhere (use_bias)
    "ernie4_5": ("Ernie4_5Config", dict(use_bias=True)),
    # rotary pairs of adjacent dimensions (its o_proj takes hidden_size: heads * head_dim must be it)
    "helium": ("HeliumConfig", dict(head_dim=16)),
    # adjacent rotary pairs over half of each head; q, k and v biases (GLM-4: norms after attention and the MLP too)
    "glm": ("GlmConfig", dict(head_dim=16, partial_rotary_factor=0.5, attention_bias=True)),
    "glm4": ("Glm4Config", dict(head_dim=16, partial_rotary_factor=0.5, attention_bias=True)),
    # Llama with windows by layer (its first full, the next an 8-token window); Llama 3's rope
    "cwm": ("CwmConfig", dict(sliding_window=8, rope_parameters={**_LLAMA3_ROPE, "rope_theta": 1000000.0})),
    # 4 experts, 2 a token
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    # a shared expert beside 4 routed ones, their weights not renormalised
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                         shared_expert_intermediate_size=96, norm_topk_prob=False)),
    # its first layer's MLP dense (mlp_only_layers), 8 experts after
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=40,
                                         mlp_only_layers=[0], head_dim=24, norm_topk_prob=True)),
    # 8 experts, 2 a token, not renormalised; q and k normed whole
    "olmoe": ("OlmoeConfig", dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=False)),
    # experts stored stacked; multipliers that leave them a say
    "granitemoe": ("GraniteMoeConfig", _GRANITE_MOE),
    # sinks; an 8-token window on its first layer, YaRN; a clamp that bites
    "gpt_oss": ("GptOssConfig", dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, intermediate_size=48,
                                     sliding_window=8, swiglu_limit=0.5, rope_parameters={
                                         **_YARN, "factor": 4.0, "truncate": False, "rope_theta": 150000.0,
                                         "original_max_position_embeddings": 512})),
    # DeepSeek-V3's routing and a shared expert; half of each head rotated, in halves; q and k normed by head
    "glm4_moe": ("Glm4MoeConfig", dict(**_GROUPED, use_qk_norm=True, attention_bias=True)),
    # GLM-4.5's routing under Qwen3's attention; an 8-token window on its last layer
    "dots1": ("Dots1Config", dict(**_GROUPED, n_shared_experts=1, norm_topk_prob=True, sliding_window=8,
                                  max_window_layers=2)),
    # a dense first layer, 8 experts (2 a token) and a shared one; biases, the LM head's too
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", dict(head_dim=16, moe_intermediate_size=32, moe_num_experts=8, moe_k=2,
                                                moe_num_shared_experts=1, moe_layer_start_index=1,
                                                num_hidden_layers=3, use_bias=True)),
    # GLM-4.5's routing in every layer (no dense one, no intermediate_size) under Llama's attention
    "solar_open": ("SolarOpenConfig", dict({k: v for k, v in _GROUPED.items() if k != "first_k_dense_replace"},
                                           attention_bias=True)),
    # Granite's multipliers, windows of 8 on its 2nd and 3rd layers, sinks; its 3rd layer without rope
    "granite_swa": ("GraniteSWAConfig", dict(num_hidden_layers=3, sliding_window=8, embedding_multiplier=2.0,
                                             residual_multiplier=0.8, attention_multiplier=0.125, logits_scaling=2.0,
                                             layer_rope_theta=[10000.0, 500000.0, 0])),
    # Granite MoE's shared expert beside its routed ones, under GraniteSWA's attention
    "granitemoe_swa": ("GraniteMoeSWAConfig", dict(_GRANITE_MOE, shared_intermediate_size=96, num_hidden_layers=3,
                                                   sliding_window=8, layer_rope_theta=[10000.0, 500000.0, 0])),
    # q and k normed after their rotation; NTK-alpha rope (transformers' "dynamic" with alpha)
    "hunyuan_v1_dense": ("HunYuanDenseV1Config", dict(head_dim=16, rope_parameters={
        "rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0})),
    # the same attention; experts chosen by a softmax router, and a shared MLP every token runs
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", dict(head_dim=16, num_experts=8, moe_topk=2, rope_parameters={
        "rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0})),
    # every 2nd layer NoPE, its queries scaled up from position 7 on; the others' q and k normed
    # without a weight after rotating adjacent pairs; a dense first layer, then 4 experts (2 a
    # token) whose inputs the router's sigmoids scale, and a shared one
    "llama4": ("Llama4TextConfig", dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, intermediate_size_mlp=96,
                                        interleave_moe_layer_step=2, no_rope_layer_interval=2, floor_scale=8,
                                        attn_scale=0.5, rope_parameters={**_LLAMA3_ROPE, "rope_theta": 500000.0})),
    # attention and the MLP side by side off one LayerNorm, adjacent rotary pairs, logits scaled
    "cohere": ("CohereConfig", dict(logit_scale=0.5, tie_word_embeddings=True)),
    # Cohere's layers, an 8-token window on its first, no rope on its second (full) one
    "cohere2": ("Cohere2Config", dict(logit_scale=0.5, sliding_window=8, tie_word_embeddings=True,
                                      layer_types=["sliding_attention", "full_attention"])),
    # LayerNorms with biases, an MLP without a gate (GeLU), biases everywhere; 8-token windows
    "starcoder2": ("Starcoder2Config", dict(sliding_window=8, use_bias=True, norm_epsilon=1e-5)),
    # LayerNorms with biases, a quarter of each head rotated, q, k and v biases
    "stablelm": ("StableLmConfig", dict(partial_rotary_factor=0.25, use_qkv_bias=True)),
    # LayerNorms of 1 + weight with biases, an ungated ReLU² MLP, half of each head rotated, biases
    "nemotron": ("NemotronConfig", dict(partial_rotary_factor=0.5, attention_bias=True, mlp_bias=True)),
    # Llama's layers; its released checkpoints' names are GPT-2's (tests/engine/test_architectures.py)
    "exaone": ("ExaoneConfig", dict(rope_parameters={**_LLAMA3_ROPE, "rope_theta": 1000000.0})),
}
FAMILIES = tuple(CONFIGS)
# Written by tests of their own, not each family's: Granite MoE's ungated shared expert.
CONFIGS["granitemoeshared"] = ("GraniteMoeSharedConfig", dict(CONFIGS["granitemoe"][1]))


def config_of(family: str, vocab_size: int, **overrides):
    """The transformers config of `family`'s tiny checkpoint, `overrides` over it."""
    import copy

    import transformers

    if family not in CONFIGS:
        raise ValueError(f"unknown model family {family!r}; expected one of {FAMILIES}")
    name, fields = CONFIGS[family][0], copy.deepcopy(CONFIGS[family][1])  # the shared lists stay ours
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6,
                  initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
                  dtype="float32")
    if family == "solar_open":  # a config field it refuses
        del common["intermediate_size"]
    if family.startswith(("cohere", "starcoder2", "stablelm", "nemotron")):  # LayerNorms: their own epsilon alone, as their configs have
        del common["rms_norm_eps"]
    return getattr(transformers, name)(**{**common, **fields, **overrides})
