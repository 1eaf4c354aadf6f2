"""Which checkpoints the engine serves, and what sets each family apart from Llama.

Every family here is Llama's decoder with data changed (`Architecture`; Seed-OSS is Llama's
with biases, Ministral Mistral's and CWM Llama's with windows by layer; Arcee's and
Apertus's, StarCoder2's and Nemotron's MLPs have no gate, `UNGATED`; ERNIE 4.5's, Helium's
and GLM's rotary pairs are adjacent dimensions, and GLM's rotate part of each head:
reordered at load, `rope_order`); HunYuan's q and k are normed after their rotation;
GPT-OSS's and GraniteSWA's attention has sinks; Cohere's (Command R's) attention and MLP run
side by side off one LayerNorm; in the mixture-of-experts families (Mixtral, Qwen2-MoE,
Qwen3-MoE, OLMoE, Granite MoE and MoE SWA, GPT-OSS, GLM-4.5, dots.llm1, ERNIE 4.5 MoE, Solar
Open, HunYuan MoE, Llama 4) a layer's MLP is a set of experts, a few of which each token
runs (`moe.Experts`). Their checkpoints' own names and layouts become the engine's at load
(`names.to_llama_names`). A checkpoint of any other kind is refused before its weights load,
naming what it is. Weights of a family and a Llama would load alike, so serving one as the
other gives wrong text with no error (Command R runs attention and the MLP side by side off
one LayerNorm, Granite scales its residuals): the refusal, or the family's own
`Architecture`, is the only guard. A sliding window (Mistral 7B v0.1's, Phi-3's, Qwen2's
with use_sliding_window, Gemma 2's and 3's, OLMo 3's, EXAONE 4's) is run as such, a query
seeing its last W keys.
Where transformers changes how a model attends past some length (Llama 4's chunks:
pdserve/context.py), the engine runs contexts up to that length only, where its output is
still the model's; LongRoPE's long frequencies past its original context are run as
transformers runs them (`long_rope_from`: engine/model/rope.py); Ministral 3's and Llama
4's queries, scaled up past a length, are scaled so here too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from pdserve.context import context_limit, long_rope_from

log = logging.getLogger(__name__)

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "granite", "smollm3", "gemma", "gemma2", "gemma3_text",
               "olmo2", "olmo3", "exaone4", "seed_oss", "ministral", "ministral3", "arcee", "apertus", "ernie4_5", "helium",
               "glm", "glm4", "cwm", "mixtral", "gpt_oss", "glm4_moe", "dots1", "ernie4_5_moe", "hunyuan_v1_dense", "hunyuan_v1_moe", "solar_open", "granite_swa",
               "granitemoe_swa", "llama4_text", "cohere", "cohere2", "qwen2_vl_text", "qwen2_5_vl_text", "qwen3_vl_text",
               "qwen3_vl_moe_text", "starcoder2", "stablelm", "nemotron", "exaone",
               "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "granitemoeshared")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # a gated MLP's, as transformers names them
PARTIAL_ROTARY = ("glm", "glm4", "glm4_moe", "phi3", "stablelm", "nemotron")  # families that may rotate part of each head (partial_rotary_factor < 1)
# families whose MLP is up, activation, down
UNGATED = {"arcee": ("relu2",), "apertus": ("xielu",), "starcoder2": ("gelu_pytorch_tanh",), "nemotron": ("relu2",)}


class UnsupportedModel(ValueError):
    pass


@dataclass(frozen=True)
class Architecture:
    embedding_multiplier: float = 1.0  # the embeddings' scale (Granite; Gemma's sqrt(hidden_size))
    multiplier_in_dtype: bool = False  # Gemma rounds its embeddings' scale to the model's dtype first
    norm_offset: float = 0.0  # added to every RMS norm's weight (Gemma's norms scale by 1 + weight)
    activation: str = "silu"  # the MLP's gate activation: one of ACTIVATIONS (or UNGATED's)
    gated: bool = True  # False: the MLP is down(activation(up(x))), no gate (UNGATED)
    # The checkpoint's names of a layer's norms (before attention, of its output, before the
    # MLP, of its output); None: no such norm.
    layer_norms: tuple = ("input_layernorm", None, "post_attention_layernorm", None)
    whole_qk_norm: bool = False  # q and k normed over all their heads at once, not head by head (OLMo 2, OLMoE)
    qk_norm_after_rope: bool = False  # q and k normed by head after their rotation, not before (HunYuan)
    # q and k LayerNormed head by head before rope, each head's weight its own (Command R+, StableLM 2 12B)
    qk_layer_norm: bool = False
    residual_multiplier: float = 1.0  # each block's output's scale before the residual add (Granite)
    # Norms that subtract the mean first (LayerNorms): "cohere", without a bias, as Cohere
    # computes it; "biased", torch's with a bias (StarCoder2); "": RMS norms.
    layer_norm: str = ""
    eps: str = "rms_norm_eps"  # the config's name of the norms' epsilon
    parallel: bool = False  # attention and the MLP side by side off one norm, both added to the residual (Cohere)
    logit_scale: float = 1.0  # the logits' multiplier (Cohere)
    attention_scale: float | None = None  # None: head_dim ** -0.5
    logits_divisor: float = 1.0  # Granite's logits_scaling
    context_limit: int = 0  # the longest context served
    why_limited: str = ""  # what sets context_limit below max_position_embeddings, if anything
    long_rope_from: int = 0  # LongRoPE's original context, where it is below the model's (pdserve/context.py); else 0
    # Each layer's rotary tables: "" the model's, "none" none (SmolLM3's NoPE layers), else
    # the rope parameters of that layer kind (Gemma 3's "sliding_attention"); (): all "".
    rope_kinds: tuple[str, ...] = ()
    windows: tuple[int, ...] = ()  # each layer's sliding window, 0 for none: a query sees its last W keys
    attn_softcap: float = 0.0  # > 0: each attention score s is attn_softcap * tanh(s / attn_softcap) (Gemma 2)
    logit_softcap: float = 0.0  # the same of the logits
    # Llama 4's attention scaling (Ministral 3's too): each query times 1 + beta * log(1 +
    # floor(position / length)); None: none.
    query_scaling: QueryScaling | None = None
    # Rotary pairs of adjacent dimensions (GPT-J's; ERNIE 4.5, Helium, GLM), not of halves:
    # their q and k rows are reordered at load (`rope_order`), which leaves every score as it was.
    interleaved_rope: bool = False
    sinks: bool = False  # a learned logit per query head joins each softmax as a key with no value (GPT-OSS)
    clamped_swiglu: tuple[float, float] | None = None  # GPT-OSS's activation's (alpha, limit): gpt_oss.clamped_swiglu
    moe: MoE | None = None  # the experts, in a mixture-of-experts model


@dataclass(frozen=True)
class QueryScaling:
    beta: float
    length: int
    from_one: bool = False  # Llama 4 counts positions from 1 (floor((position + 1) / length))
    layers: tuple[bool, ...] = ()  # the layers whose queries it scales; (): all (Llama 4: its NoPE ones)

    def scales(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[T, 1, 1] of positions [T], in float32 and then the dtype as transformers computes them."""
        if self.from_one:  # Llama 4's own expression, so that it rounds alike
            scales = torch.log1p(torch.floor((positions.float() + 1.0) / self.length)) * self.beta + 1.0
        else:
            scales = 1 + self.beta * torch.log(1 + torch.floor(positions / self.length))
        return scales.to(dtype)[:, None, None]


@dataclass(frozen=True)
class MoE:
    experts: int
    top_k: int  # experts each token runs
    normalize: bool  # the top-k probabilities scaled to sum to 1
    weights_fp32: bool  # Mixtral weighs expert outputs in float32; Qwen's in the model's dtype
    layers: tuple[bool, ...]  # whether each layer's MLP is the experts (Qwen's mlp_only_layers are not)
    softmax_top_k: bool = False  # the weights: a softmax of the top-k logits (Granite), not of them all
    # DeepSeek-V3's routing (GLM-4.5): sigmoid scores in float32, experts chosen by score plus
    # a correction bias within the best `groups[1]` of `groups[0]` groups, weights times `scaling`.
    # (ERNIE 4.5's: softmax scores in float32, chosen by score plus a correction bias.)
    sigmoid: bool = False
    groups: tuple[int, int] = (1, 1)
    scaling: float = 1.0
    # Llama 4's: the sigmoid of each chosen logit scales the expert's input, not its output.
    scales_input: bool = False


def _moe(c, kind: str) -> MoE | None:
    if kind == "mixtral":
        return MoE(c.num_local_experts, c.num_experts_per_tok, True, True, (True,) * c.num_hidden_layers)
    if kind in ("granitemoe", "granitemoeshared", "granitemoe_swa", "gpt_oss"):
        return MoE(c.num_local_experts, c.num_experts_per_tok, False, False, (True,) * c.num_hidden_layers, True)
    if kind == "olmoe":
        return MoE(c.num_experts, c.num_experts_per_tok, bool(c.norm_topk_prob), False, (True,) * c.num_hidden_layers)
    if kind == "hunyuan_v1_moe":  # every layer's experts, weighed in the model's dtype
        top_k = {c.moe_topk} if isinstance(c.moe_topk, int) else set(c.moe_topk)
        if len(top_k) != 1:
            raise UnsupportedModel(f"moe_topk differs by layer ({c.moe_topk}); pdserve runs one top-k in every layer")
        return MoE(c.num_experts, top_k.pop(), True, False, (True,) * c.num_hidden_layers)
    if kind == "llama4_text":  # experts in the moe_layers, the others dense MLPs of intermediate_size_mlp
        return MoE(c.num_local_experts, c.num_experts_per_tok, False, False,
                   tuple(i in c.moe_layers for i in range(c.num_hidden_layers)), scales_input=True)
    if kind == "ernie4_5_moe":  # experts every moe_layer_interval-th layer of [start, end]
        layers = tuple((i + 1) % c.moe_layer_interval == 0 and c.moe_layer_start_index <= i <= c.moe_layer_end_index
                       for i in range(c.num_hidden_layers))
        return MoE(c.moe_num_experts, c.moe_k, True, False, layers)
    if kind in ("glm4_moe", "dots1", "solar_open"):  # DeepSeek-V3's routing; the first first_k_dense_replace dense
        dense = getattr(c, "first_k_dense_replace", 0)  # (Solar Open's: none)
        return MoE(c.n_routed_experts, c.num_experts_per_tok, bool(c.norm_topk_prob), True,
                   tuple(i >= dense for i in range(c.num_hidden_layers)), sigmoid=True,
                   groups=(c.n_group, c.topk_group), scaling=c.routed_scaling_factor)
    if kind not in ("qwen2_moe", "qwen3_moe", "qwen3_vl_moe_text"):
        return None
    # As transformers builds the layers: sparse every decoder_sparse_step-th, but not those listed.
    layers = tuple(i not in (c.mlp_only_layers or ()) and c.num_experts > 0 and (i + 1) % c.decoder_sparse_step == 0
                   for i in range(c.num_hidden_layers))
    # (Qwen3-VL-MoE renormalises always.)
    return MoE(c.num_experts, c.num_experts_per_tok, bool(getattr(c, "norm_topk_prob", True)), False, layers)


def architecture(hf_config) -> Architecture:
    """What the engine runs `hf_config`'s model with; UnsupportedModel saying why it cannot."""
    c = hf_config
    kind = getattr(c, "model_type", None)
    names = ", ".join(getattr(c, "architectures", None) or []) or "no architectures listed"
    if kind not in MODEL_TYPES:
        raise UnsupportedModel(
            f"model_type {kind!r} ({names}) is not supported: pdserve serves {', '.join(MODEL_TYPES)} "
            f"checkpoints; serve this model with a server that implements it")
    quant = getattr(c, "quantization_config", None)
    method = (quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", quant)) if quant else None
    if quant and (kind, method) != ("gpt_oss", "mxfp4"):  # GPT-OSS's MXFP4 experts are dequantized at load
        raise UnsupportedModel(f"quantized checkpoints are not supported (quant_method {method!r}); "
                               f"serve the model's unquantized (bf16, fp16 or fp32) weights")
    # Gemma 2 and 3 take their activation from hidden_activation (transformers ignores hidden_act there).
    act = c.hidden_activation if kind in ("gemma2", "gemma3_text") else getattr(c, "hidden_act", "silu")
    allowed = UNGATED.get(kind, ACTIVATIONS)
    if act not in allowed:
        raise UnsupportedModel(f"hidden_act {act!r} is not supported (the MLP's activation must be one of "
                               f"{', '.join(allowed)})")
    if kind in ("gemma2", "gemma3_text"):
        return _gemma2_or_3(c, act)
    if getattr(c, "clip_qkv", None) is not None:
        raise UnsupportedModel(f"clip_qkv {c.clip_qkv} is not supported (q, k and v clamped)")
    params = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {}
    factor = params.get("partial_rotary_factor", getattr(c, "partial_rotary_factor", 1.0))
    if factor != 1 and kind not in PARTIAL_ROTARY:  # transformers' own model would not rotate part of a head
        raise UnsupportedModel(f"partial rotary embeddings (partial_rotary_factor {factor}) are not supported for "
                               f"{kind} (only {', '.join(PARTIAL_ROTARY)} rotate part of each head)")

    def get(name, default):
        return getattr(c, name, default)

    limit, why = context_limit(get)
    return replace(_family(c, kind, act), context_limit=limit, why_limited=why, long_rope_from=long_rope_from(get),
                   windows=_windows(c))


def _family(c, kind: str, act: str) -> Architecture:
    """What sets the family apart, its context and windows aside."""
    params = getattr(c, "rope_parameters", None) or {}
    if kind == "gemma":
        return Architecture(embedding_multiplier=c.hidden_size**0.5, multiplier_in_dtype=True, norm_offset=1.0,
                            activation=act)
    after_only = (None, "post_attention_layernorm", None, "post_feedforward_layernorm")
    if kind in ("olmo2", "olmo3"):  # no norm before attention or the MLP; each one's output normed
        # OLMo 3's sliding and full layers have rotary tables of their own (YaRN on the full).
        kinds = tuple(c.layer_types) if kind == "olmo3" else ()
        return Architecture(layer_norms=after_only, whole_qk_norm=True, activation=act, rope_kinds=kinds)
    if kind == "exaone4":  # OLMo 2's norms, q and k normed head by head; with windows, full layers rotate nothing
        hybrid = bool(getattr(c, "sliding_window", None)) and "sliding_attention" in c.layer_types
        kinds = tuple("" if t == "sliding_attention" else "none" for t in c.layer_types) if hybrid else ()
        return Architecture(layer_norms=after_only, activation=act, rope_kinds=kinds)
    if kind == "olmoe":
        return Architecture(whole_qk_norm=True, activation=act, moe=_moe(c, kind))
    if kind == "ministral3":
        beta = params.get("llama_4_scaling_beta")
        scaling = QueryScaling(beta, params["original_max_position_embeddings"]) if beta else None
        return Architecture(activation=act, query_scaling=scaling)
    if kind in ("ernie4_5", "ernie4_5_moe", "helium", "glm"):
        return Architecture(activation=act, interleaved_rope=True, moe=_moe(c, kind))
    if kind == "glm4":  # norms before and after attention and the MLP, as Gemma 2's
        return Architecture(activation=act, interleaved_rope=True,
                            layer_norms=("input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm",
                                         "post_mlp_layernorm"))
    if kind == "arcee":
        return Architecture(activation=act, gated=False)
    if kind in ("hunyuan_v1_dense", "hunyuan_v1_moe"):
        return Architecture(activation=act, qk_norm_after_rope=True, moe=_moe(c, kind))
    if kind == "gpt_oss":
        return Architecture(activation=act, sinks=True, clamped_swiglu=(c.swiglu_alpha, c.swiglu_limit), moe=_moe(c, kind))
    if kind == "apertus":  # its norms' own names; xIELU's parameters are each layer's
        return Architecture(activation=act, gated=False, layer_norms=("attention_layernorm", None,
                                                                      "feedforward_layernorm", None))
    if kind == "llama4_text":  # NoPE layers (queries scaled by position there); weightless q and k norms after rope
        rope = tuple(bool(r) for r in c.no_rope_layers)
        scaling = QueryScaling(c.attn_scale, c.floor_scale, True, tuple(not r for r in rope))
        return Architecture(activation=act, interleaved_rope=True, qk_norm_after_rope=True, moe=_moe(c, kind),
                            rope_kinds=tuple("" if r else "none" for r in rope),
                            query_scaling=scaling if c.attn_temperature_tuning else None)
    if kind in ("cohere", "cohere2"):  # Command R, R+, R7B, A; Aya: adjacent rotary pairs
        # Cohere 2's full layers have no rope; its sliding ones (with a window) do.
        kinds = tuple("" if t == "sliding_attention" and c.sliding_window else "none"
                      for t in c.layer_types) if kind == "cohere2" else ()
        return Architecture(activation=act, interleaved_rope=True, layer_norm="cohere", eps="layer_norm_eps", parallel=True,
                            logit_scale=c.logit_scale, layer_norms=("input_layernorm", None, None, None),
                            rope_kinds=kinds, qk_layer_norm=bool(getattr(c, "use_qk_norm", False)))
    if kind == "starcoder2":  # LayerNorms with biases, an MLP without a gate, biases everywhere
        return Architecture(activation=act, gated=False, layer_norm="biased", eps="norm_epsilon")
    if kind == "stablelm":  # torch's LayerNorms with biases; part of each head rotated
        parallel = bool(c.use_parallel_residual)  # attention and the MLP side by side off one norm
        return Architecture(activation=act, layer_norm="biased", eps="layer_norm_eps", parallel=parallel,
                            layer_norms=("input_layernorm", None, None if parallel else "post_attention_layernorm", None),
                            qk_layer_norm=bool(c.qk_layernorm))
    if kind == "nemotron":  # LayerNorms of 1 + weight, with biases; an ungated ReLU² MLP; half of each head rotated
        return Architecture(activation=act, gated=False, layer_norm="biased", eps="norm_eps", norm_offset=1.0)
    if kind == "smollm3":
        return Architecture(rope_kinds=tuple("" if rope else "none" for rope in c.no_rope_layers))
    if kind.startswith("granite"):  # GraniteSWA's: sinks, and a rope base by layer (0: none)
        thetas = getattr(c, "layer_rope_theta", None) or ()
        kinds = tuple("none" if not t else f"theta={float(t)}" for t in thetas)
        return Architecture(embedding_multiplier=c.embedding_multiplier, residual_multiplier=c.residual_multiplier,
                            attention_scale=c.attention_multiplier, logits_divisor=c.logits_scaling,
                            activation=act, moe=_moe(c, kind), sinks=kind.endswith("_swa"), rope_kinds=kinds)
    return Architecture(activation=act, moe=_moe(c, kind))


def _gemma2_or_3(c, act: str) -> Architecture:
    """Gemma 2 and 3: Gemma's norms, embeddings and GeLU; norms before and after attention and
    the MLP; sliding-window layers, run as such (no cap on the context): Gemma 3's with rotary
    tables of their own; Gemma 2's scores and logits capped."""
    if getattr(c, "use_bidirectional_attention", False):
        raise UnsupportedModel("use_bidirectional_attention is not supported (an embedding model's attention)")
    return Architecture(embedding_multiplier=c.hidden_size**0.5, multiplier_in_dtype=True, norm_offset=1.0,
                        activation=act, attention_scale=c.query_pre_attn_scalar**-0.5,
                        layer_norms=("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                                     "post_feedforward_layernorm"),
                        rope_kinds=tuple(c.layer_types) if c.model_type == "gemma3_text" else (),
                        windows=tuple(c.sliding_window if t == "sliding_attention" else 0 for t in c.layer_types),
                        attn_softcap=c.attn_logit_softcapping or 0.0, logit_softcap=c.final_logit_softcapping or 0.0,
                        context_limit=c.max_position_embeddings)


def _windows(c) -> tuple[int, ...]:
    """Each layer's sliding window (0: none), where transformers masks one; () for none at all."""
    window = getattr(c, "sliding_window", None) or 0
    layer_types = getattr(c, "layer_types", None)
    if layer_types is not None:  # Qwen2/3: sliding layers only with use_sliding_window
        windows = tuple(window if t == "sliding_attention" else 0 for t in layer_types)
        return windows if any(windows) else ()
    if getattr(c, "use_sliding_window", True) is False:
        return ()
    return (window,) * c.num_hidden_layers if window else ()


def served_context(hf_config, asked: int | None) -> int:
    """The longest context served: `asked` (max_model_len, None for the model's own), at
    most what the model allows; UnsupportedModel before any weight loads if it cannot run."""
    arch = architecture(hf_config)
    limit, why = arch.context_limit, arch.why_limited
    if asked and asked > limit and why:
        log.warning("max_model_len %d is cut to %d, %s: beyond it transformers attends otherwise",
                    asked, limit, why)
    return min(asked or limit, limit)


def rope_order(hf_config) -> torch.Tensor | None:
    """The order of a head's q and k dimensions in which the kernels' rope rotates them as
    `hf_config`'s model does (`head_order`); None where the checkpoint's order is that already."""
    c = hf_config
    D = geometry(c)[2]
    params = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {}
    R = int(D * params.get("partial_rotary_factor", getattr(c, "partial_rotary_factor", 1.0)))
    interleaved = architecture(c).interleaved_rope
    return None if R == D and not interleaved else head_order(D, R, interleaved)


def head_order(head_dim: int, rotary_dim: int, interleaved: bool) -> torch.Tensor:
    """The kernels rotate pairs (i, i + D/2), the first R/2 of them (rope.RotaryTables). A model
    rotates pairs (2i, 2i + 1) (GPT-J's, `interleaved`) or (i, i + R/2), for i < R/2, and
    passes its dimensions past the rotary dim R through: this order of a head's dimensions
    puts its pairs where the kernels rotate them and the rest in both halves' tails. q and k
    reordered alike give the same scores."""
    D, R = head_dim, rotary_dim
    if R % 2 or not 0 < R <= D:
        raise UnsupportedModel(f"a rotary dim of {R} (partial_rotary_factor of head_dim {D}) is not supported")
    pairs = torch.arange(R).view(-1, 2).T if interleaved else torch.arange(R).view(2, -1)  # [2, R/2]: each pair
    still = torch.arange(R, D).view(2, -1)
    return torch.cat([pairs[0], still[0], pairs[1], still[1]])


def reorder_heads(rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """`rows` (a q or k projection's weight, bias or LoRA B: head after head; or a norm's
    weight of one head) with each head's dimensions in `order`."""
    D = order.numel()
    heads = rows.shape[0] // D
    return rows.reshape(heads, D, *rows.shape[1:])[:, order.to(rows.device)].reshape(rows.shape).contiguous()


def geometry(hf_config) -> tuple[int, int, int]:
    """(query heads, KV heads, head_dim) of the whole model."""
    c = hf_config
    heads = c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    return heads, kv_heads, getattr(c, "head_dim", None) or c.hidden_size // heads
