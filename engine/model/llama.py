"""The Llama-family decoder (Llama, Llama 3, Mistral, Qwen2, Qwen3, Phi-3, Granite, SmolLM3, Gemma,
Gemma 2, Gemma 3, OLMo 2, and the mixtures of experts Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, GPT-OSS; the list
is arch.MODEL_TYPES) as plain tensor code over the paged KV cache.

Tokens of all sequences in a step are one flat batch [T]: every linear layer is one matmul for the
whole step, whatever mix of prefill chunks and decodes it holds. Per architecture differences are
data, not classes: QKV biases (Qwen2, `attention_bias`), q/k RMS norm (Qwen3), tied embeddings, rope
scaling, Granite's multipliers, SmolLM3's layers without rope, Gemma's norms (1 + weight, added at
load), GeLU and scaled embeddings, norms of the attention's and the MLP's outputs (OLMo 2, Gemma 2
and 3), sliding-window layers (Gemma 3's with rotary tables of their own), Gemma 2's capped scores
and logits, experts in place of the MLP (`arch`, `moe`), GPT-OSS's attention sinks (`Layer.sinks`),
Cohere's LayerNorms and its attention and MLP side by side. Weights are fused at load time (q|k|v
and gate|up) so each layer runs four matmuls; between them run four fused operations (`fused`: add +
norm, rotary + KV store, SiLU-and-multiply, add + norm), so a layer is about nine calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .. import collectives
from ..lora import add_deltas
from .arch import UnsupportedModel, architecture, geometry, reorder_heads, rope_order
from .fused import FusedOps
from .activations import UNGATED_ACTIVATIONS, clamped_swiglu, gelu_tanh_mul
from .layer_ops import head_layer_norms, layer_norm
from .linear import Linear
from .moe import Experts
from .rope import RotaryTables, apply_rope


@dataclass
class Layer:
    input_norm: torch.Tensor | None  # before attention; None: it reads the residual stream as is
    qkv: Linear  # q | k | v
    # [D]: every head's; [H * D]: all heads' at once (arch.whole_qk_norm); [H, D]: each head's own (arch.qk_layer_norm)
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: Linear
    post_norm: torch.Tensor | None  # before the MLP; None as input_norm
    gate_up: Linear | None  # gate | up; None where experts are the MLP
    down: Linear | None
    rope: str = ""  # its rotary tables (LlamaModel.rope_tables: "" the model's, "none" for a NoPE layer)
    window: int = 0  # a sliding window's size (its query sees its last `window` keys); 0: every key
    experts: Experts | None = None
    attn_out_norm: torch.Tensor | None = None  # of the attention's output, before the residual add
    mlp_out_norm: torch.Tensor | None = None
    xielu: tuple | None = None  # the layer's xIELU parameters (alpha_p, alpha_n, beta, eps): Apertus
    sinks: torch.Tensor | None = None  # float32 [H]: each query head's attention sink (GPT-OSS)


@dataclass
class StepAttention:
    """What one forward needs to reach the KV cache; built once per step by the runner."""

    slot_mapping: torch.Tensor  # int64 [T]
    store_kv: Callable  # (k_cache, v_cache, k, v, slot_mapping)
    attend: Callable  # (q, k_cache, v_cache, scale, sinks=None) -> out
    layer_hook: Callable | None = None  # (layer_idx) after the layer's K/V is written
    # The rows whose hidden states are wanted (int64, in the order wanted), and `attend` for
    # them alone, each row the last query of its sequence; None: every row.
    keep: torch.Tensor | None = None
    attend_kept: Callable | None = None
    # `attend` and `attend_kept` for the sliding-window layers (LlamaModel.window); None
    # where no context of the step outgrows the window.
    attend_window: Callable | None = None
    attend_kept_window: Callable | None = None
    # LoRA adapters' rows (engine/lora.py `row_groups`), of every row and of the kept rows;
    # None: no row has an adapter.
    lora: list | None = None
    lora_kept: list | None = None
    # int64 [T]: each position's rotary tables' row (rope.rope_index); None: the positions.
    rope_positions: torch.Tensor | None = None


class LlamaModel:
    def __init__(self, hf_config, state: dict[str, torch.Tensor], dtype: torch.dtype, max_positions: int, device="cpu",
                 shard=None):
        """`shard`: this rank's share of a tensor-parallel model (engine/tp/shard.py), its
        weights already cut from `state`; None: the whole model."""
        c = hf_config
        self.config = c
        self.hidden_size = c.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = geometry(c)
        self.tp = shard is not None and shard.world > 1
        # Norms over every head at once (arch.whole_qk_norm) divide the sums of squares of
        # all ranks' q and k by these sizes; a KV head on several ranks counts on its first.
        heads, kv_heads = self.num_heads, self.num_kv_heads
        self.qk_sizes = torch.tensor([heads * self.head_dim, kv_heads * self.head_dim], dtype=torch.float32, device=device)
        self.counts_k = shard is None or shard.q_begin == shard.kv_begin * (heads // kv_heads)
        if shard is not None:
            self.num_heads, self.num_kv_heads = shard.num_heads, shard.num_kv_heads
        self.num_layers = c.num_hidden_layers
        arch = architecture(c)
        self.eps = getattr(c, arch.eps)
        self.scale = arch.attention_scale or self.head_dim**-0.5
        self.embedding_multiplier, self.residual_multiplier = arch.embedding_multiplier, arch.residual_multiplier
        if arch.multiplier_in_dtype:
            self.embedding_multiplier = torch.tensor(arch.embedding_multiplier, dtype=dtype).item()
        self.logits_divisor, self.logit_scale = arch.logits_divisor, arch.logit_scale
        self.layer_norm, self.parallel = arch.layer_norm, arch.parallel
        rope_kinds = arch.rope_kinds or ("",) * self.num_layers
        self.vocab_size = c.vocab_size
        self.dtype = dtype
        # Rotary tables by layer kind ("": the model's; "none": a NoPE layer's, rotating nothing).
        # LongRoPE's long half of the tables, where a context reaches past its original one.
        self.long_rope_from = arch.long_rope_from if max_positions > arch.long_rope_from else 0
        self.max_positions = max_positions
        tables = {kind: RotaryTables.of_kind(c, kind, self.head_dim, max_positions, dtype, device, self.long_rope_from)
                  for kind in dict.fromkeys(rope_kinds) if kind != "none"} or {
                  "": RotaryTables(c, self.head_dim, max_positions, dtype, device, long_from=self.long_rope_from)}
        self.rope = next(iter(tables.values()))
        if "none" in rope_kinds:  # as large as a real table: only for a model with NoPE layers
            tables["none"] = self.rope.identity()
        self.rope_tables = tables
        self.ops = FusedOps.for_model(dtype, torch.device(device), self.rope, self.num_heads, self.num_kv_heads,
                                      self.head_dim, self.eps)

        def take(name):
            return state.pop(name).contiguous()

        def maybe(name):
            t = state.pop(name, None)
            return t.contiguous() if t is not None else None

        def norm(name):  # Gemma's (Nemotron's) norms scale by 1 + weight: the sum, once, in float32
            t = maybe(name)
            t = t if t is None or not arch.norm_offset else (t.float() + arch.norm_offset).to(dtype)
            if t is not None and arch.layer_norm == "biased":  # weight and bias stacked [2, hidden] (layer_ops.layer_norm)
                return torch.stack([t, take(name.removesuffix("weight") + "bias")])
            return t

        def fused(prefix: str, names: tuple[str, ...]) -> Linear:
            """One matmul of several: their weights stacked, and their biases (zeros for
            any one missing, as a partly biased checkpoint has) unless none has one."""
            weights = [take(f"{prefix}{n}.weight") for n in names]
            biases = [maybe(f"{prefix}{n}.bias") for n in names]
            if all(b is None for b in biases):
                return Linear(torch.cat(weights, dim=0).contiguous(), None)
            biases = [torch.zeros(w.shape[0], dtype=w.dtype, device=w.device) if b is None else b
                      for w, b in zip(weights, biases)]
            return Linear(torch.cat(weights, dim=0).contiguous(), torch.cat(biases, dim=0).contiguous())

        qk_norm = maybe if arch.qk_layer_norm else norm  # a weight for each head: no offset, no bias
        self.embed = take("model.embed_tokens.weight")
        self.layers = []
        moe = arch.moe
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            sparse = moe is not None and moe.layers[i]
            before_attn, after_attn, before_mlp, after_mlp = (name and f"{p}{name}.weight" for name in arch.layer_norms)
            self.layers.append(
                Layer(
                    input_norm=before_attn and norm(before_attn),
                    qkv=fused(a, ("q_proj", "k_proj", "v_proj")),
                    q_norm=qk_norm(a + "q_norm.weight"),
                    k_norm=qk_norm(a + "k_norm.weight"),
                    o=Linear(take(a + "o_proj.weight"), maybe(a + "o_proj.bias")),
                    post_norm=before_mlp and norm(before_mlp),
                    gate_up=None if sparse else fused(m, ("gate_proj", "up_proj") if arch.gated else ("up_proj",)),
                    down=None if sparse else Linear(take(m + "down_proj.weight"), maybe(m + "down_proj.bias")),
                    rope=rope_kinds[i],
                    window=arch.windows[i] if arch.windows else 0,
                    experts=Experts.load(moe, m, take, maybe, fused) if sparse else None,
                    attn_out_norm=after_attn and norm(after_attn),
                    mlp_out_norm=after_mlp and norm(after_mlp),
                    xielu=tuple(take(f"{m}act_fn.{n}") for n in ("alpha_p", "alpha_n", "beta", "eps"))
                    if arch.activation == "xielu" else None,
                    sinks=maybe(a + "sinks").float() if arch.sinks else None,
                )
            )
        self.norm = norm("model.norm.weight")
        windows = {layer.window for layer in self.layers} - {0}
        if len(windows) > 1:
            raise UnsupportedModel(f"sliding windows of several sizes ({sorted(windows)}) are not supported")
        self.window = windows.pop() if windows else 0  # the sliding layers' window
        self.adapters: list = []  # LoRA adapters, by the index a request's rows carry (engine/lora.py)
        lm_head = maybe("lm_head.weight")
        tied = lm_head is None or getattr(c, "tie_word_embeddings", False)
        # Only rank 0 samples: another rank holds no LM head.
        head_bias = maybe("lm_head.bias")  # ERNIE 4.5 MoE's, with use_bias
        self.lm_head = None if shard is not None and shard.rank else Linear(self.embed if tied else lm_head, head_bias)
        self.moe = moe
        self.activation, self.gated, self.whole_qk_norm = arch.activation, arch.gated, arch.whole_qk_norm
        self.qk_layer_norm = arch.qk_layer_norm
        self.attn_softcap, self.logit_softcap = arch.attn_softcap, arch.logit_softcap
        self.query_scaling = arch.query_scaling
        self.clamped_swiglu = arch.clamped_swiglu
        self.qk_norm_after_rope = arch.qk_norm_after_rope
        order = rope_order(c)  # q's and k's rows were reordered so at load (names.to_llama_names)
        self.reorder_qk = None if order is None else (lambda rows: reorder_heads(rows, order))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, step: StepAttention) -> torch.Tensor:
        """Final hidden states [T, hidden] of `input_ids` [T] at `positions` [T] (only the
        rows step.keep, when set), writing every layer's K/V into the page-major `kv_cache`
        [pages, layers, 2, page_size, Hkv, D] at step.slot_mapping.

        Past the last layer's K/V only the kept rows matter, so with step.keep the rest stop
        there: its attention, o projection and MLP run for the kept rows alone (a prefill
        chunk keeps one row, or none before its last chunk)."""
        ops = self.ops
        act_mul = ops.silu_mul if self.activation == "silu" else gelu_tanh_mul
        if self.clamped_swiglu is not None:
            act_mul = clamped_swiglu(*self.clamped_swiglu)
        # A dense MLP's activation of its gate_up output; without a gate, of up alone.
        mlp_act = UNGATED_ACTIVATIONS[self.activation] if not self.gated else (lambda up, _: act_mul(up))
        rope_ops = {kind: ops if tables is ops.rope else ops.with_rope(tables) for kind, tables in self.rope_tables.items()}
        q_size = self.num_heads * self.head_dim
        lora = step.lora

        def project(linear, x, i, name):  # the projection, plus the LoRA deltas of its rows
            y = linear(x)
            if lora:
                add_deltas(y, x, i, name, lora)
            return y

        def add_norm(x, residual, weight):  # ops.add_rms_norm (or a LayerNorm); without a weight, (the sum, the sum)
            if weight is not None and not self.layer_norm:
                return ops.add_rms_norm(x, residual, weight)
            total = x if residual is None else residual + x
            return (total if weight is None else layer_norm(total, weight, self.eps)), total

        def out_norm(x, weight):  # a block's output normed, in float32 as transformers does (OLMo 2)
            return x if weight is None else F.rms_norm(x.float(), (x.shape[-1],), weight.float(), self.eps).to(x.dtype)

        def whole_qk_norm(qkv, q_norm, k_norm):  # q and k each normed over all its heads, in float32
            kv_size = self.num_kv_heads * self.head_dim
            q, k, v = qkv[:, :q_size], qkv[:, q_size:q_size + kv_size], qkv[:, q_size + kv_size:]
            if not self.tp:
                return torch.cat([out_norm(q, q_norm), out_norm(k, k_norm), v], dim=1)
            # This rank holds some heads: the mean square needs every rank's sum.
            q, k = q.float(), k.float()
            sums = torch.stack([q.square().sum(-1), k.square().sum(-1) if self.counts_k else q.new_zeros(len(k))], dim=1)
            scale = collectives.all_reduce(sums).div_(self.qk_sizes).add_(self.eps).rsqrt_()
            return torch.cat([(q * scale[:, :1] * q_norm.float()).to(qkv.dtype),
                              (k * scale[:, 1:] * k_norm.float()).to(qkv.dtype), v], dim=1)

        scaling = self.query_scaling
        query_scale = None if scaling is None else scaling.scales(positions, self.dtype)
        rope_positions = positions if step.rope_positions is None else step.rope_positions

        residual = F.embedding(input_ids, self.embed)
        if self.embedding_multiplier != 1:
            residual = residual * self.embedding_multiplier
        h, residual = add_norm(residual, None, self.layers[0].input_norm if self.layers else self.norm)
        if step.keep is not None and not self.layers:
            return h.index_select(0, step.keep)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            k_cache, v_cache = kv_cache[:, i, 0], kv_cache[:, i, 1]  # [pages, page_size, Hkv, D]
            qkv, q_norm, k_norm = project(layer.qkv, h, i, "qkv"), layer.q_norm, layer.k_norm
            if self.whole_qk_norm:  # over all heads at once (OLMo 2, OLMoE)
                qkv = whole_qk_norm(qkv, q_norm, k_norm)
                q_norm = k_norm = None
            elif self.qk_layer_norm:  # LayerNorms head by head (Command R+, StableLM 2 12B)
                qkv = head_layer_norms(qkv, q_norm, k_norm, self.num_heads, self.num_kv_heads, self.eps,
                                       cohere=self.layer_norm == "cohere")
                q_norm = k_norm = None
            if self.qk_norm_after_rope and q_norm is not None:  # (Llama 4's NoPE layers have none)
                q = self._rope_then_norm(qkv, rope_positions, layer, k_cache, v_cache, step)
            else:
                q = rope_ops[layer.rope].rope_store(
                    qkv, rope_positions, q_norm, k_norm, k_cache, v_cache, step.slot_mapping, step.store_kv)
            if query_scale is not None and (not scaling.layers or scaling.layers[i]):
                q = q * query_scale
            # Tensor-parallel: the layer's KV is in every rank's pool only once the o
            # projection's all-reduce returned, so the hook (which may send it) waits for that.
            if step.layer_hook is not None and not self.tp:
                step.layer_hook(i)
            attend = (layer.window and step.attend_window) or step.attend
            if i == last and step.keep is not None:
                if not step.keep.numel():
                    if self.tp:
                        collectives.barrier()
                        if step.layer_hook is not None:
                            step.layer_hook(i)
                    return h[:0]
                q, residual = q.index_select(0, step.keep), residual.index_select(0, step.keep)
                if self.parallel:  # the MLP reads the attention's input
                    h = h.index_select(0, step.keep)
                attend, lora = (layer.window and step.attend_kept_window) or step.attend_kept, step.lora_kept
            attn = attend(q, k_cache, v_cache, self.scale, layer.sinks)
            out = project(layer.o, attn.view(-1, q_size), i, "o")
            if self.tp:
                collectives.all_reduce(out)
                if step.layer_hook is not None:
                    step.layer_hook(i)
            if self.residual_multiplier != 1:  # of the whole sum, as transformers scales it
                out = out * self.residual_multiplier
            if self.parallel:  # Cohere: the MLP reads the attention's input; the residual adds both in turn
                residual = residual + out
            else:
                h, residual = add_norm(out_norm(out, layer.attn_out_norm), residual, layer.post_norm)
            if layer.experts is not None:
                x = layer.experts(h, act_mul)
            else:
                x = project(layer.down, mlp_act(project(layer.gate_up, h, i, "gate_up"), layer), i, "down")
            if self.tp:
                collectives.all_reduce(x)
            if self.residual_multiplier != 1:
                x = x * self.residual_multiplier
            following = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm
            h, residual = add_norm(out_norm(x, layer.mlp_out_norm), residual, following)
        return h

    def _rope_then_norm(self, qkv, rope_positions, layer: Layer, k_cache, v_cache, step: StepAttention) -> torch.Tensor:
        """q [T, H, D] of HunYuan's order (rotated, then normed by head in float32 and scaled in
        the dtype, as transformers' RMS norm), k so too and stored with v: plain torch, which
        the fused rope-and-store kernels (normed first) are not."""
        T, D = qkv.shape[0], self.head_dim
        q_size, kv_size = self.num_heads * D, self.num_kv_heads * D
        tables = self.rope_tables.get(layer.rope) or self.rope
        cos, sin = tables.lookup(rope_positions)

        def normed(x, weight):
            return F.rms_norm(apply_rope(x, cos, sin).float(), (D,), eps=self.eps).to(x.dtype) * weight

        q = normed(qkv[:, :q_size].view(T, self.num_heads, D), layer.q_norm)
        k = normed(qkv[:, q_size:q_size + kv_size].view(T, self.num_kv_heads, D), layer.k_norm)
        step.store_kv(k_cache, v_cache, k, qkv[:, q_size + kv_size:].view(T, self.num_kv_heads, D), step.slot_mapping)
        return q

    def lora_sizes(self) -> dict[str, list[int]]:
        """The output parts of each of the whole model's fused projections (every rank's
        together), as LoRA adapters target them: the attention's alone in a mixture of
        experts, whose experts adapters are not run on."""
        heads, kv_heads, D = geometry(self.config)
        inter = getattr(self.config, "intermediate_size", 0)  # (Solar Open, all experts, has none)
        sizes = {"qkv": [heads * D, kv_heads * D, kv_heads * D], "o": [self.hidden_size]}
        gate_up = [inter, inter] if self.gated else [inter]  # (an ungated MLP's up alone)
        return sizes if self.moe else {**sizes, "gate_up": gate_up, "down": [self.hidden_size]}

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """float32 logits [S, vocab] of hidden states [S, hidden], into `out` if given (None
        on a rank > 0)."""
        if self.lm_head is None:
            return None
        raw = self.lm_head(hidden)
        logits = raw.float() if out is None else out.copy_(raw)
        if self.logit_softcap:  # Gemma 2: tanh-capped, as transformers caps them
            logits.div_(self.logit_softcap).tanh_().mul_(self.logit_softcap)
        if self.logit_scale != 1:  # Cohere's
            logits.mul_(self.logit_scale)
        return logits if self.logits_divisor == 1 else logits.div_(self.logits_divisor)

