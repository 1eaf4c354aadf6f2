"""A checkpoint's weight names and layouts as the engine loads them (Llama's, Qwen's experts):
every family's own names renamed, fused or stacked tensors split, quantized experts
dequantized, and q's and k's rows put in the order the kernels rotate them (arch.rope_order)."""

from __future__ import annotations

import torch

from .arch import geometry, reorder_heads, rope_order
from .gpt_oss import split_experts

# EXAONE 3 and 3.5's released checkpoints' names (transformers runs them as Llama's)
_EXAONE = (("transformer.wte.", "model.embed_tokens."), ("transformer.h.", "model.layers."), ("transformer.ln_f.", "model.norm."),
           (".attn.attention.", ".self_attn."), (".self_attn.out_proj.", ".self_attn.o_proj."),
           (".ln_1.", ".input_layernorm."), (".ln_2.", ".post_attention_layernorm."), (".mlp.c_fc_0.", ".mlp.gate_proj."),
           (".mlp.c_fc_1.", ".mlp.up_proj."), (".mlp.c_proj.", ".mlp.down_proj."))
_MIXTRAL = (("block_sparse_moe.gate.", "mlp.gate."), ("block_sparse_moe.experts.", "mlp.experts."),
            (".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj."))


def to_llama_names(state: dict[str, torch.Tensor], hf_config, dtype: torch.dtype) -> None:
    """`state` (the whole checkpoint or any of its layers, `weights.read_groups`) in place as
    the engine loads it, what it makes in `dtype`:
    - Phi-3's fused qkv_proj and gate_up_proj split into Llama's q/k/v and gate/up names
      (the model fuses them again; tensor parallelism cuts them apart first);
    - EXAONE 3's released names as Llama's, as transformers renames them;
    - Mixtral's experts renamed as Qwen's (`mlp.experts.N.gate_proj`, ..., `mlp.gate`), and
      Granite MoE's and GPT-OSS's, stacked [experts, ...], split into them (GPT-OSS's MXFP4
      experts dequantized to the model's dtype first);
    - Llama 4's `feed_forward` as `mlp`, its stacked experts split (Qwen3-VL-MoE's too), its
      weightless q and k norms as norms of ones;
    - StableLM 2 12B's LayerNorms of each head of q and k stacked, as Command R+'s are;
    - GLM-4.5's and ERNIE's `shared_experts`, ERNIE's correction bias, HunYuan's q and k
      norms, shared MLP and router under the names the others use; layers past the last (GLM-4.5's
      multi-token prediction) dropped;
    - q's and k's rows reordered where the model rotates them otherwise (arch.rope_order)."""
    if hf_config.model_type == "gpt_oss":
        split_experts(state, dtype)
    for key in [k for k in state if k.startswith("model.layers.") and int(k.split(".")[2]) >= hf_config.num_hidden_layers]:
        del state[key]
    for key in [k for k in state if ".self_attn.query_layernorm." in k or ".self_attn.key_layernorm." in k]:
        state[key.replace("query_layernorm", "q_norm").replace("key_layernorm", "k_norm")] = state.pop(key)  # HunYuan's
    for key in [k for k in state if ".mlp.shared_experts." in k or ".mlp.shared_mlp." in k]:  # GLM-4.5's, ERNIE's,
        state[key.replace(".mlp.shared_experts.", ".mlp.shared_expert.")  # HunYuan's: Qwen2-MoE's, ungated
              .replace(".mlp.shared_mlp.", ".mlp.shared_expert.")] = state.pop(key)
    for key in [k for k in state if k.endswith(".mlp.gate.wg.weight")]:  # HunYuan's router
        state[key.replace(".gate.wg.", ".gate.")] = state.pop(key)
    for key in [k for k in state if k.endswith(".mlp.moe_statics.e_score_correction_bias")]:  # ERNIE's, [1, E]
        state[key.replace(".moe_statics.", ".gate.")] = state.pop(key).view(-1)
    if hf_config.model_type in ("granitemoe", "granitemoeshared", "granitemoe_swa"):
        _granite_experts(state)
    if hf_config.model_type == "llama4_text":
        _llama4(state, hf_config, dtype)
    if hf_config.model_type == "qwen3_vl_moe_text":
        split_stacked_experts(state, hf_config.hidden_size, transposed=None)
    if hf_config.model_type == "stablelm":  # StableLM 2 12B's LayerNorm of each head, one weight [H, D]
        for prefix in {k.split(".norms.")[0] for k in state if "_layernorm.norms." in k}:
            heads = sorted((k for k in state if k.startswith(prefix + ".norms.") and k.endswith(".weight")),
                           key=lambda k: int(k.split(".")[-2]))
            state[prefix.replace("_layernorm", "_norm") + ".weight"] = torch.stack([state.pop(k) for k in heads])
    if hf_config.model_type == "starcoder2":  # its ungated MLP's names
        for key in [k for k in state if ".mlp.c_fc." in k or ".mlp.c_proj." in k]:
            state[key.replace(".mlp.c_fc.", ".mlp.up_proj.").replace(".mlp.c_proj.", ".mlp.down_proj.")] = state.pop(key)
    if hf_config.model_type in ("mixtral", "exaone"):
        renames = _MIXTRAL if hf_config.model_type == "mixtral" else _EXAONE
        for key in [k for k in state if ".block_sparse_moe." in k or k.startswith("transformer.")]:
            new = key
            for old, name in renames:
                new = new.replace(old, name)
            state[new] = state.pop(key)
    heads, kv_heads, head_dim = geometry(hf_config)
    sizes = {"qkv_proj": (("q_proj", "k_proj", "v_proj"), (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)),
             "gate_up_proj": (("gate_proj", "up_proj"), (getattr(hf_config, "intermediate_size", 0),) * 2)}
    for key in [k for k in state if k.rsplit(".", 2)[-2] in sizes]:
        prefix, fused, kind = key.rsplit(".", 2)
        names, split = sizes[fused]
        for name, part in zip(names, state.pop(key).split(split, dim=0)):
            state[f"{prefix}.{name}.{kind}"] = part.contiguous()
    order = rope_order(hf_config)  # after the split: Phi-4-mini's fused q|k|v rotates part of each head too
    if order is not None:
        for key in [k for k in state if k.rsplit(".", 2)[-2] in ("q_proj", "k_proj", "q_norm", "k_norm")]:
            per_head = state[key].dim() == 2 and key.endswith("_norm.weight")  # [H, D]: each head's own weight
            state[key] = state[key][:, order].contiguous() if per_head else reorder_heads(state[key], order)


def _granite_experts(state: dict[str, torch.Tensor]) -> None:
    for key in [k for k in state if ".block_sparse_moe." in k or ".shared_mlp." in k]:
        layer, _, part = key.partition(".block_sparse_moe.") if ".block_sparse_moe." in key else key.partition(".shared_mlp.")
        w = state.pop(key)
        # GraniteMoeSWA's checkpoints name them as transformers 5 does: router.weight,
        # experts.gate_up_proj and experts.down_proj.
        gate_up = part in ("input_linear.weight", "experts.gate_up_proj")
        if part in ("router.layer.weight", "router.weight"):
            state[f"{layer}.mlp.gate.weight"] = w
        elif ".shared_mlp." in key:  # gate | up, down
            names = ("gate_proj", "up_proj") if gate_up else ("down_proj",)
            for name, piece in zip(names, w.chunk(len(names), dim=0)):
                state[f"{layer}.mlp.shared_expert.{name}.weight"] = piece.contiguous()
        else:  # input_linear [E, 2I, H]: each expert's gate | up; output_linear [E, H, I]: its down
            names = ("gate_proj", "up_proj") if gate_up else ("down_proj",)
            for e, expert in enumerate(w):
                for name, piece in zip(names, expert.chunk(len(names), dim=0)):
                    state[f"{layer}.mlp.experts.{e}.{name}.weight"] = piece.contiguous()


def split_stacked_experts(state: dict[str, torch.Tensor], hidden: int, transposed: bool | None) -> None:
    """Experts stacked [E, ...] (`mlp.experts.gate_up_proj`, gate | up, and `down_proj`) split
    into Qwen's names. `transposed`: each expert stored [in, out] (Llama 4's); None: [out, in]
    unless its shape says otherwise (Qwen3-VL-MoE: transformers 5 saves [out, in], the released
    checkpoints [in, out]; a square one is taken as transformers takes it, [out, in])."""
    for key in [k for k in state if k.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"))]:
        prefix, w = key[:-len(key.rsplit(".", 1)[1])], state.pop(key)
        gate_up = key.endswith("gate_up_proj")
        flip = transposed if transposed is not None else (w.shape[2] if gate_up else w.shape[1]) != hidden
        names = ("gate_proj", "up_proj") if gate_up else ("down_proj",)
        for e, expert in enumerate(w):
            for name, part in zip(names, (expert.T if flip else expert).chunk(len(names), dim=0)):
                state[f"{prefix}{e}.{name}.weight"] = part.contiguous()


def _llama4(state: dict[str, torch.Tensor], c, dtype: torch.dtype) -> None:
    """Llama 4's `feed_forward` as Qwen's `mlp` (its router `gate`); its stacked experts,
    gate_up_proj [E, hidden, 2I] (gate | up) and down_proj [E, I, hidden], split into them;
    on its rope layers, q and k normed without a weight (use_qk_norm): by weights of ones."""
    for key in [k for k in state if ".feed_forward." in k]:
        state[key.replace(".feed_forward.router.", ".mlp.gate.").replace(".feed_forward.", ".mlp.")] = state.pop(key)
    split_stacked_experts(state, c.hidden_size, transposed=True)
    if c.use_qk_norm:
        ones = torch.ones(geometry(c)[2], dtype=dtype)
        layers = {int(k.split(".")[2]) for k in state if k.startswith("model.layers.")}
        for i in (i for i in sorted(layers) if c.no_rope_layers[i]):
            for name in ("q_norm", "k_norm"):
                state[f"model.layers.{i}.self_attn.{name}.weight"] = ones
