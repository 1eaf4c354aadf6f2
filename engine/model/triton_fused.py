"""The decoder layer's small operations (`layer_ops.TorchOps`' interface) as one Triton
kernel each: the GPU path in bfloat16 and float16 (`FusedOps.for_model` picks it).

Why: in plain torch a layer runs ~30 small kernels besides its matmuls; replayed in a CUDA
graph their launches cost nothing, but each still takes a few microseconds of GPU time.

Invariants:
- Nothing here reads a tensor's values on the host or shapes a tensor by them: every
  call can be captured into a CUDA graph. T == 0 returns empty outputs, launching nothing.
- Importing this module never imports triton; the first call does, and jits the kernel
  (as `attention.triton_ops`), so TRITON_INTERPRET=1 set before triton's import runs
  them on the CPU interpreter.
- Numerics are transformers': float32 arithmetic, rounded to the model dtype wherever
  transformers stores a tensor (the residual sum, the normalised row before the weight,
  each rotary product, the SiLU before the multiply). torch's F.rms_norm (TorchOps)
  rounds once, after the weight, so in half precision about a quarter of the normed
  values differ from TorchOps' by one rounding step; elsewhere only a reordered sum of
  squares or the GPU's exp can move a value across a rounding boundary.
- Outputs are fresh tensors: neither `x` nor `residual` is written.
- Slot s is `[s // page_size, s % page_size]` of k_cache / v_cache, one layer's strided
  views of the page-major pool (every stride is an argument); a negative slot is a
  padding token: its k and v are written nowhere.
"""

from __future__ import annotations

import torch

from pdserve.arith import ceil_div

from ..triton_jit import kernel
from .layer_ops import TorchOps

triton = None
tl = None  # triton.language; bound on first use (engine/triton_jit.py) so the kernels see it

MAX_HEAD_DIM = 256


def _add_rms_norm_kernel(
    X, Residual, Weight, Out, NewResidual, n, eps, stride_x, stride_r, stride_o, stride_nr,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    dtype = Out.dtype.element_ty
    h = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        h = (h.to(tl.float32) + tl.load(Residual + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32))
        h = h.to(dtype)  # the residual stream is kept in the model dtype
        tl.store(NewResidual + row * stride_nr + cols, h, mask=mask)
    h = h.to(tl.float32)
    variance = tl.sum(h * h, axis=0) / n
    normed = (h * tl.rsqrt(variance + eps)).to(dtype).to(tl.float32)
    weight = tl.load(Weight + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + cols, (normed * weight).to(dtype), mask=mask)


def _rope_store_kernel(
    QKV, Positions, Cos, Sin, Q, KCache, VCache, Slots, page_size,
    stride_qkv, stride_cos, stride_sin, stride_qt, stride_qh,
    stride_kcp, stride_kcs, stride_kch, stride_vcp, stride_vcs, stride_vch,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)  # the query heads, then the key heads (each also moves its value head)
    half = HEAD_DIM // 2
    d = tl.arange(0, HALF_PAD)
    mask = d < half
    dtype = Q.dtype.element_ty
    pos = tl.load(Positions + t).to(tl.int64)
    cos = tl.load(Cos + pos * stride_cos + d, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(Sin + pos * stride_sin + d, mask=mask, other=0.0).to(tl.float32)
    head = QKV + t * stride_qkv + h * HEAD_DIM
    x1 = tl.load(head + d, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(head + half + d, mask=mask, other=0.0).to(tl.float32)
    # Rotate-half, each product rounded to the model dtype as torch's x * cos + rotate_half(x) * sin.
    out1 = ((x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)).to(dtype)
    out2 = ((x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)).to(dtype)
    if h < NUM_HEADS:
        q = Q + t * stride_qt + h * stride_qh
        tl.store(q + d, out1, mask=mask)
        tl.store(q + half + d, out2, mask=mask)
    else:
        slot = tl.load(Slots + t).to(tl.int64)
        if slot >= 0:  # a negative slot marks a padding token: nothing to write
            kv_head = h - NUM_HEADS
            page, offset = slot // page_size, slot % page_size
            k = KCache + page * stride_kcp + offset * stride_kcs + kv_head * stride_kch
            tl.store(k + d, out1.to(KCache.dtype.element_ty), mask=mask)
            tl.store(k + half + d, out2.to(KCache.dtype.element_ty), mask=mask)
            v_head = head + NUM_KV_HEADS * HEAD_DIM  # value head kv_head sits Hkv heads after its key
            v = VCache + page * stride_vcp + offset * stride_vcs + kv_head * stride_vch
            tl.store(v + d, tl.load(v_head + d, mask=mask).to(VCache.dtype.element_ty), mask=mask)
            tl.store(v + half + d, tl.load(v_head + half + d, mask=mask).to(VCache.dtype.element_ty), mask=mask)


def _silu_mul_kernel(GateUp, Out, inter, stride_g, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    dtype = Out.dtype.element_ty
    gate = tl.load(GateUp + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(GateUp + row * stride_g + inter + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)  # stored by transformers: rounded
    tl.store(Out + row * stride_o + cols, (silu * up).to(dtype), mask=mask)


def _load(name: str):
    return kernel(globals(), name)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


class TritonOps(TorchOps):
    def __init__(self, rope, num_heads: int, num_kv_heads: int, head_dim: int, eps: float):
        if head_dim % 2 or head_dim > MAX_HEAD_DIM:
            raise ValueError(f"TritonOps takes an even head_dim up to {MAX_HEAD_DIM}, not {head_dim}")
        super().__init__(rope, num_heads, num_kv_heads, head_dim, eps)

    def add_rms_norm(self, x, residual, weight):
        """(normed, residual + x) with the sum in a fresh tensor; (normed, x) without a residual."""
        x, weight = _unit_last_stride(x), _unit_last_stride(weight)
        rows, n = x.shape
        out = torch.empty_like(x)
        has_residual = residual is not None
        new_residual = torch.empty_like(x) if has_residual else x
        if rows == 0:
            return out, new_residual
        residual = _unit_last_stride(residual) if has_residual else x  # x: a placeholder, never read
        block = _pow2_at_least(n)
        _load("_add_rms_norm_kernel")[(rows,)](
            x, residual, weight, out, new_residual, n, self.eps,
            x.stride(0), residual.stride(0), out.stride(0), new_residual.stride(0),
            HAS_RESIDUAL=has_residual, BLOCK=block, num_warps=min(16, max(1, block // 256)),
        )
        return out, new_residual

    def rope_store(self, qkv, positions, q_norm, k_norm, k_cache, v_cache, slots, store_kv):
        """Llama's path in one kernel (q written fresh, k and v into the cache; `store_kv`
        unused); with Qwen3's per-head q/k norms, torch's. Positions must lie inside the
        rotary tables: checking them would read them on the host."""
        if q_norm is not None or k_norm is not None:
            return super().rope_store(qkv, positions, q_norm, k_norm, k_cache, v_cache, slots, store_kv)
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        T = qkv.shape[0]
        q = torch.empty(T, H, D, dtype=qkv.dtype, device=qkv.device)
        if T == 0:
            return q
        qkv, positions, slots = _unit_last_stride(qkv), _unit_last_stride(positions), _unit_last_stride(slots)
        assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "the cache's head_dim must be contiguous"
        cos, sin = self.rope.cos, self.rope.sin
        _load("_rope_store_kernel")[(T, H + Hkv)](
            qkv, positions, cos, sin, q, k_cache, v_cache, slots, k_cache.shape[1],
            qkv.stride(0), cos.stride(0), sin.stride(0), q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            NUM_HEADS=H, NUM_KV_HEADS=Hkv, HEAD_DIM=D, HALF_PAD=_pow2_at_least(D // 2), num_warps=1,
        )
        return q

    def silu_mul(self, gate_up):
        gate_up = _unit_last_stride(gate_up)
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
        if rows == 0 or inter == 0:
            return out
        block = min(1024, _pow2_at_least(inter))
        _load("_silu_mul_kernel")[(rows, ceil_div(inter, block))](
            gate_up, out, inter, gate_up.stride(0), out.stride(0), BLOCK=block, num_warps=min(4, max(1, block // 256)),
        )
        return out
