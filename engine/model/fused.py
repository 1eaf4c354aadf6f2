"""The decoder layer's small operations, each one call: residual add + RMS norm, rotary
embedding + KV store, SiLU-and-multiply.

Why: SmolLM2-135M has 30 thin layers (hidden 576), so at decode batch sizes the layer's
fixed costs, not its matmuls, decide speed. In plain torch one layer runs ~30 operations
besides its four matmuls (norms of five ops each, rotary slices and a cat, index
arithmetic and two index_put for the KV store, SiLU, the multiply, residual adds), each
with its dispatch and a temporary. `FusedOps` runs them as four calls of fused.c.

`TorchOps` is the same interface in plain torch: any device and dtype, and what runs when
the C kernels cannot (no compiler, PDSERVE_NO_C_KERNELS, not CPU, float16). Both follow
transformers' numerics (float32 norms, rounding to the model dtype where transformers
stores a tensor); the C path's sums of squares and exp may differ in the last bits.

Interface (x, residual, out: [T, n]; qkv [T, (H + 2 Hkv) D]):
- `add_rms_norm(x, residual, weight) -> (normed, residual)`: residual + x (x alone when
  residual is None) normalised; the sum is the new residual (the C path writes it in place).
- `rope_store(qkv, positions, q_norm, k_norm, k_cache, v_cache, slots) -> q [T, H, D]`:
  rotary embedding of q and k (after the optional per-head norms), k and v written to
  their slots.
- `silu_mul(gate_up) -> [T, I]`.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import native
from .rope import RotaryTables, apply_rope

_SOURCE = Path(__file__).with_name("fused.c")
_FLAGS = [*native.BASE_FLAGS, "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math"]
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_i64, _ptr, _int, _float = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_SIGNATURES = {}
for _s in _SUFFIX.values():
    _SIGNATURES[f"rms_norm_{_s}"] = [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _float, _int]
    _SIGNATURES[f"rope_kv_{_s}"] = [_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _float, _ptr,
                                    _ptr, _ptr, _ptr, _i64, _i64, _int]
    _SIGNATURES[f"silu_mul_{_s}"] = [_ptr, _ptr, _i64, _i64, _int]


class TorchOps:
    def __init__(self, rope: RotaryTables, num_heads: int, num_kv_heads: int, head_dim: int, eps: float):
        self.rope = rope
        self.num_heads, self.num_kv_heads, self.head_dim, self.eps = num_heads, num_kv_heads, head_dim, eps

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


class FusedOps(TorchOps):
    """The C kernels of fused.c; `for_model` says whether they can run."""

    def __init__(self, lib, dtype, rope, num_heads, num_kv_heads, head_dim, eps):
        super().__init__(rope, num_heads, num_kv_heads, head_dim, eps)
        s = _SUFFIX[dtype]
        self._norm, self._rope, self._silu = (getattr(lib, f"{n}_{s}") for n in ("rms_norm", "rope_kv", "silu_mul"))

    @staticmethod
    def for_model(dtype: torch.dtype, device: torch.device, rope, num_heads, num_kv_heads, head_dim, eps) -> TorchOps:
        """FusedOps where the kernels run (CPU, float32 or bfloat16, built), else TorchOps."""
        if device.type == "cpu" and dtype in _SUFFIX and head_dim % 2 == 0 and head_dim <= 1024:
            lib = native.load(_SOURCE, _FLAGS, _SIGNATURES)
            if lib is not None:
                return FusedOps(lib, dtype, rope, num_heads, num_kv_heads, head_dim, eps)
        return TorchOps(rope, num_heads, num_kv_heads, head_dim, eps)

    def rms_norm(self, x, weight):
        """Over the last dimension of x of any shape (the per-head norms are [T, heads, D])."""
        return self.add_rms_norm(x.reshape(-1, x.shape[-1]), None, weight)[0].view(x.shape)

    def add_rms_norm(self, x, residual, weight):
        x = x.contiguous()
        out = torch.empty_like(x)
        rows, n = x.shape
        self._norm(x.data_ptr(), residual.data_ptr() if residual is not None else None, weight.data_ptr(),
                   out.data_ptr(), rows, n, self.eps, torch.get_num_threads())
        return out, (x if residual is None else residual)

    def rope_store(self, qkv, positions, q_norm, k_norm, k_cache, v_cache, slots, store_kv):
        T = qkv.shape[0]
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        page_size = k_cache.shape[1]
        if (k_cache.stride() != v_cache.stride() or k_cache.stride()[1:] != (Hkv * D, D, 1)
                or k_cache.dtype != qkv.dtype or not qkv.is_contiguous()):
            return super().rope_store(qkv, positions, q_norm, k_norm, k_cache, v_cache, slots, store_kv)
        q = torch.empty(T, H, D, dtype=qkv.dtype)
        failed = self._rope(
            qkv.data_ptr(), T, H, Hkv, D, positions.data_ptr(), self.rope.cos.data_ptr(), self.rope.sin.data_ptr(),
            q_norm.data_ptr() if q_norm is not None else None, k_norm.data_ptr() if k_norm is not None else None,
            self.eps, q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), page_size,
            k_cache.stride(0), torch.get_num_threads(),
        )
        if failed:
            raise ValueError(f"rope_kv cannot take head_dim {D}")
        return q

    def silu_mul(self, gate_up):
        rows, width = gate_up.shape
        gate_up = gate_up.contiguous()
        out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
        self._silu(gate_up.data_ptr(), out.data_ptr(), rows, width // 2, torch.get_num_threads())
        return out
