"""`PanelWeight`: a weight packed for gemm.c, the CPU matmul of every linear layer.

Why: at decode batch sizes oneDNN's GEMM ran at 55-75% of the machine's peak, and a decode
step of SmolLM2-135M is mostly matmuls. gemm.c packs each weight once, at load time, into
panels of 48 output columns and keeps a block of sums in registers: 8 x 48 over all of K
on AVX-512 (the next panel prefetched into L2), 6 x 16 thirds of a panel on AVX2 (float32
K in chunks of up to 256 steps, so a panel's chunk stays in L1). It matches or beats oneDNN
at every row count measured, 1 to 2048 (30 layers at 32 rows, float32, Zen 4: 55.2 -> 44.4
ms), so where it runs it replaces oneDNN and the weight is held once, in this layout. What
was tried and measured: docs/kernels.md.

`PanelWeight.pack(weight)` is None where the kernel cannot run: neither AVX-512 nor AVX2 with
FMA; bfloat16 on an AVX-512 CPU without AVX512-BF16 (oneDNN's bfloat16 runs there), or with
AMX (oneDNN's tiles win there); an odd K in bfloat16; an empty weight; other dtypes or
devices; PDSERVE_NO_C_KERNELS. `Linear` then uses oneDNN or `F.linear`.
"""

from __future__ import annotations

import ctypes

import torch

from pdserve.arith import ceil_div

from .. import native

_NR = 48  # output columns per panel, as in gemm.c
_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_SIGNATURES = {"gemm_supported": []}
for _s in ("f32", "bf16"):
    _SIGNATURES[f"pack_{_s}"] = [_ptr, _i64, _i64, _ptr]
    _SIGNATURES[f"gemm_{_s}"] = [_ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr, _int]
_KINDS = {torch.float32: ("f32", 1), torch.bfloat16: ("bf16", 2)}  # suffix, gemm_supported bit
_KERNELS = native.KernelLibrary(__file__, "gemm.c", _SIGNATURES)


class PanelWeight:
    def __init__(self, lib: ctypes.CDLL, weight: torch.Tensor):
        suffix, _ = _KINDS[weight.dtype]
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        panels = ceil_div(self.out_features, _NR)
        self.data = torch.empty(panels * _NR * self.in_features, dtype=weight.dtype)
        w = weight.contiguous()
        getattr(lib, f"pack_{suffix}")(w.data_ptr(), self.out_features, self.in_features, self.data.data_ptr())
        self._gemm = getattr(lib, f"gemm_{suffix}")

    @staticmethod
    def pack(weight: torch.Tensor) -> PanelWeight | None:
        kind = _KINDS.get(weight.dtype)
        if kind is None or weight.device.type != "cpu" or weight.dim() != 2:
            return None
        if (weight.dtype == torch.bfloat16 and weight.shape[1] % 2) or 0 in weight.shape:
            return None
        lib = _KERNELS.library()
        if lib is None or not lib.gemm_supported() & kind[1]:
            return None
        return PanelWeight(lib, weight)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., in_features] -> x @ W.T + bias, [..., out_features]; bias [out_features] of
        the weight's dtype."""
        if x.dtype != self.dtype or x.device.type != "cpu" or x.shape[-1] != self.in_features:
            raise ValueError(f"a {self.dtype} weight [{self.out_features}, {self.in_features}] cannot take "
                             f"a {x.dtype} input of shape {tuple(x.shape)} on {x.device}")
        flat = x.reshape(-1, self.in_features).contiguous()
        rows = flat.shape[0]
        out = torch.empty(rows, self.out_features, dtype=self.dtype)
        if rows:
            failed = self._gemm(flat.data_ptr(), rows, self.in_features, self.data.data_ptr(), self.out_features,
                                bias.data_ptr() if bias is not None else None, out.data_ptr(), torch.get_num_threads())
            if failed:
                raise MemoryError(f"gemm.c could not allocate float32 rows for a [{rows}, {self.in_features}] input")
        return out.view(*x.shape[:-1], self.out_features)
