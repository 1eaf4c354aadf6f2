"""The decoder layer's small operations (the interface of `layer_ops.TorchOps`) as C
kernels, and `FusedOps.for_model`, which picks the implementation for a model's device.

Why: SmolLM2-135M has 30 thin layers (hidden 576), so at decode batch sizes the layer's
fixed costs, not its matmuls, decide speed. In plain torch one layer runs ~30 operations
besides its four matmuls (norms of five ops each, rotary slices and a cat, index
arithmetic and two index_put for the KV store, SiLU, the multiply, residual adds), each
with its dispatch and a temporary. `FusedOps` runs them as four calls of fused.c.

Which runs (`for_model`):
- CPU, float32 or bfloat16: `FusedOps` (the C path writes the new residual in place; its
  sums of squares and exp may differ from torch's in the last bits).
- CUDA, bfloat16 or float16: `triton_fused.TritonOps`, one Triton kernel per operation,
  capturable in CUDA graphs. Not float32: there torch's own ops are the exactness oracle
  against transformers. PDSERVE_NO_TRITON_OPS=1 keeps torch's.
- Otherwise (no compiler, PDSERVE_NO_C_KERNELS, float16 on CPU, other devices):
  `TorchOps`.
"""

from __future__ import annotations

import ctypes
import os

import torch

from .. import native
from .layer_ops import TorchOps

_FLAGS = [*native.BASE_FLAGS, "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math"]
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_i64, _ptr, _int, _float = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_SIGNATURES = {}
for _s in _SUFFIX.values():
    _SIGNATURES[f"rms_norm_{_s}"] = [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _float, _int]
    _SIGNATURES[f"rope_kv_{_s}"] = [_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _float, _ptr,
                                    _ptr, _ptr, _ptr, _i64, _i64, _int]
    _SIGNATURES[f"silu_mul_{_s}"] = [_ptr, _ptr, _i64, _i64, _int]
_KERNELS = native.KernelLibrary(__file__, "fused.c", _SIGNATURES, _FLAGS)


class FusedOps(TorchOps):
    """The C kernels of fused.c; `for_model` says whether they can run."""

    def __init__(self, lib, dtype, rope, num_heads, num_kv_heads, head_dim, eps):
        super().__init__(rope, num_heads, num_kv_heads, head_dim, eps)
        s = _SUFFIX[dtype]
        self._norm, self._rope, self._silu = (getattr(lib, f"{n}_{s}") for n in ("rms_norm", "rope_kv", "silu_mul"))

    @staticmethod
    def for_model(dtype: torch.dtype, device: torch.device, rope, num_heads, num_kv_heads, head_dim, eps) -> TorchOps:
        """FusedOps where the C kernels run (CPU, float32 or bfloat16, built), TritonOps on
        CUDA in bfloat16 or float16, else TorchOps. Touches no device: it only chooses."""
        if (device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and head_dim % 2 == 0
                and head_dim <= 256 and not os.environ.get("PDSERVE_NO_TRITON_OPS")):
            from .triton_fused import TritonOps  # imports no triton until a kernel first runs

            return TritonOps(rope, num_heads, num_kv_heads, head_dim, eps)
        if device.type == "cpu" and dtype in _SUFFIX and head_dim % 2 == 0 and head_dim <= 1024:
            lib = _KERNELS.library()
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
