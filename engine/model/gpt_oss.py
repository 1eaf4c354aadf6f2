"""What GPT-OSS adds to the decoder's loading: its experts stored stacked (transposed, gate
and up interleaved, and in the released checkpoints quantized to MXFP4). Its clamped SwiGLU
is activations.clamped_swiglu.

Its attention sinks (one learned logit per query head, a key with no value that takes its
share of every softmax) are the attention kernels' `sinks`; its alternating sliding and full
layers, YaRN rope and biases are those of the families before it.
"""

from __future__ import annotations

import torch

# The 16 values of an FP4 (E2M1) code, its sign bit the highest: OCP's MX format.
_FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_BLOCK = 32  # values that share one scale


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An MXFP4 tensor [..., rows, cols] from its codes `blocks` (uint8 [..., rows, cols / 32,
    16], two a byte, the low nibble first) and `scales` (uint8 [..., rows, cols / 32], E8M0:
    2 ** (s - 127) for each block of 32). Every value is exact in `dtype` where the scales are
    within its exponent range, so the dequantized model is the quantized one."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} ({blocks.dtype}) and scales {tuple(scales.shape)} "
                         f"({scales.dtype}) do not pair: blocks must be uint8 [..., n / 32, 16], scales uint8 [..., n / 32]")
    lut = torch.tensor(_FP4, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # [..., n / 32, 32]
    values = torch.ldexp(lut[codes], scales.to(torch.int32).sub_(127).unsqueeze(-1).float())
    return values.flatten(-2).to(dtype)


def split_experts(state: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """GPT-OSS's stacked experts, as Qwen's names (`mlp.experts.N.gate_proj`, ..., `mlp.gate`),
    in place: gate_up_proj [E, hidden, 2I] has each expert's gate and up in alternate columns,
    down_proj [E, I, hidden] is transposed; either may be MXFP4 (`_blocks`, `_scales`), stored
    [E, out, in] as a weight is."""
    for key in [k for k in state if k.endswith(".mlp.router.weight") or k.endswith(".mlp.router.bias")]:
        state[key.replace(".mlp.router.", ".mlp.gate.")] = state.pop(key)
    for key in [k for k in state if k.endswith((".mlp.experts.gate_up_proj_scales", ".mlp.experts.down_proj_scales"))]:
        stem = key[:-len("_scales")]
        w = dequantize_mxfp4(state.pop(stem + "_blocks"), state.pop(key), dtype)  # [E, out, in]
        state[stem] = w.transpose(1, 2)  # as the unquantized checkpoint stores it
    for key in [k for k in state if k.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"))]:
        prefix, w, b = key[:-len(key.rsplit(".", 1)[1])], state.pop(key), state.pop(key + "_bias", None)
        for e in range(w.shape[0]):
            if key.endswith("gate_up_proj"):
                parts = {"gate_proj": (w[e, :, 0::2], b[e, 0::2] if b is not None else None),
                         "up_proj": (w[e, :, 1::2], b[e, 1::2] if b is not None else None)}
            else:
                parts = {"down_proj": (w[e], b[e] if b is not None else None)}
            for name, (weight, bias) in parts.items():
                state[f"{prefix}{e}.{name}.weight"] = weight.T.contiguous()
                if bias is not None:
                    state[f"{prefix}{e}.{name}.bias"] = bias.contiguous()
