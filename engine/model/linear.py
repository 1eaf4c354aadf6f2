"""`Linear`: one weight matrix (and optional bias), applied as `x @ W.T + b`.

On a CPU with AVX-512 or AVX2 the weight is packed once, at load time, into gemm.c's panels, and
every call runs gemm.c (level with oneDNN or faster at every row count measured, 1 to 2048,
in chunks past that). Where gemm.c cannot run, the weight is reordered into oneDNN's
blocked layout and every call runs oneDNN's GEMM on it (what torch.compile's CPU freezing
does too), faster than `F.linear`'s MKL sgemm at decode sizes. Everywhere else (GPU, fp16,
a torch without oneDNN, bfloat16 on a CPU where oneDNN has no bfloat16 linear and gemm.c
cannot run) it is `F.linear`. Figures: docs/kernels.md.

Invariant: `Linear(w, b)(x)` equals `F.linear(x, w, b)` up to float rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .gemm import PanelWeight

_PACKABLE = (torch.float32, torch.bfloat16)


def can_pack(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or weight.dtype not in _PACKABLE or not torch.backends.mkldnn.is_available():
        return False
    # oneDNN's bfloat16 linear needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; on an AVX2-only
    # CPU its reorder raises, so the weight stays plain for F.linear.
    return weight.dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


class Linear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = True):
        self.out_features, self.in_features = weight.shape
        self.bias = bias.contiguous() if bias is not None else None
        self.panels = PanelWeight.pack(weight) if pack else None
        self.packed = pack and self.panels is None and can_pack(weight)
        if self.panels is not None:
            self.weight = None  # held once, as panels
        elif self.packed:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
        else:
            self.weight = weight.contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in_features] -> [T, out_features]."""
        if self.panels is not None:
            return self.panels.matmul(x, self.bias)
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
