"""The decoder layer's small operations, each one call, in plain torch (`TorchOps`): the
interface that the C kernels (`fused.FusedOps`, CPU) and the Triton kernels
(`triton_fused.TritonOps`, CUDA) implement; `FusedOps.for_model` picks one.

TorchOps runs on any device and dtype and follows transformers' numerics: float32 norms,
rounding to the model dtype wherever transformers stores a tensor. It is the reference
the other two are tested against.

Interface (x, residual: [T, n]; qkv [T, (H + 2 Hkv) D]):
- `add_rms_norm(x, residual, weight) -> (normed, residual)`: residual + x (x alone when
  residual is None) normalised; the sum is the new residual.
- `rope_store(qkv, positions, q_norm, k_norm, k_cache, v_cache, slots, store_kv) -> q [T, H, D]`:
  rotary embedding of q and k (after the optional per-head norms), k and v written to
  their slots.
- `silu_mul(gate_up) -> [T, I]`.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from .rope import RotaryTables, apply_rope


class TorchOps:
    def __init__(self, rope: RotaryTables, num_heads: int, num_kv_heads: int, head_dim: int, eps: float):
        self.rope = rope
        self.num_heads, self.num_kv_heads, self.head_dim, self.eps = num_heads, num_kv_heads, head_dim, eps

    def with_rope(self, tables: RotaryTables) -> "TorchOps":
        """The same ops with other rotary tables: a layer with rope parameters of its own (or
        none: tables that rotate nothing) stores its K and computes its q through the same kernels."""
        ops = copy.copy(self)
        ops.rope = tables
        return ops

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, self.eps)

    def add_rms_norm(self, x, residual, weight):
        residual = x if residual is None else residual + x
        return self.rms_norm(residual, weight), residual

    def rope_store(self, qkv, positions, q_norm, k_norm, k_cache, v_cache, slots, store_kv):
        T = qkv.shape[0]
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        q_size, kv_size = H * D, Hkv * D
        cos, sin = self.rope.lookup(positions)
        v = qkv[:, q_size + kv_size :].view(T, Hkv, D)
        if q_norm is not None:
            q = apply_rope(self.rms_norm(qkv[:, :q_size].view(T, H, D), q_norm), cos, sin)
            k = apply_rope(self.rms_norm(qkv[:, q_size : q_size + kv_size].view(T, Hkv, D), k_norm), cos, sin)
        else:
            # q and k heads side by side: one rope (elementwise, so the same numbers) for both.
            qk = apply_rope(qkv[:, : q_size + kv_size].view(T, H + Hkv, D), cos, sin)
            q, k = qk[:, :H], qk[:, H:]
        store_kv(k_cache, v_cache, k, v, slots)
        return q

    def silu_mul(self, gate_up):
        inter = gate_up.shape[1] // 2
        return F.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:])


def layer_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """A LayerNorm as transformers computes it. `weight` [hidden]: Cohere's, without a bias:
    in float32, the mean subtracted, then the dtype; [2, hidden]: torch's, weight and bias
    (StarCoder2's). Plain torch: no kernel here fuses it."""
    if weight.dim() == 2:
        return F.layer_norm(x, (x.shape[-1],), weight[0], weight[1], eps)
    return _cohere_layer_norm(x, weight, eps)


def _cohere_layer_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    centered = h - h.mean(-1, keepdim=True)
    return (weight.float() * (centered * torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def head_layer_norms(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, heads: int, kv_heads: int,
                     eps: float, cohere: bool) -> torch.Tensor:
    """`qkv` [T, (H + 2 Hkv) * D] with q and k LayerNormed head by head, without a bias,
    `q_norm` [H, D] and `k_norm` [Hkv, D] each head's weight: Cohere's norm (Command R+) or
    torch's in the dtype (StableLM 2 12B's, one nn.LayerNorm a head)."""
    T, D = qkv.shape[0], q_norm.shape[-1]
    q, k, v = qkv.split([heads * D, kv_heads * D, kv_heads * D], dim=1)

    def normed(x, weight):
        x = x.reshape(T, -1, D)
        if cohere:
            return _cohere_layer_norm(x, weight, eps).flatten(1)
        return (F.layer_norm(x, (D,), None, None, eps) * weight).flatten(1)

    return torch.cat([normed(q, q_norm), normed(k, k_norm), v], dim=1)
