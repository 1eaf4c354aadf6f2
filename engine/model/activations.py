"""The MLP activations beside SiLU-and-multiply (`ops.silu_mul`, a fused kernel), each as
transformers computes it: gated ones take gate | up [T, 2I], ungated ones up [T, I] and the
layer (whose parameters xIELU reads)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def relu2(up: torch.Tensor, _layer) -> torch.Tensor:
    """An ungated MLP's activation, relu(x)^2 (Arcee)."""
    return F.relu(up).square_()


def xielu(up: torch.Tensor, layer) -> torch.Tensor:
    """xIELU (Apertus), with the layer's parameters, as transformers computes it."""
    alpha_p, alpha_n, beta, eps = layer.xielu
    alpha_p, alpha_n = F.softplus(alpha_p), beta + F.softplus(alpha_n)
    return torch.where(up > 0, alpha_p * up * up + beta * up,
                       (torch.expm1(torch.min(up, eps)) - up) * alpha_n + beta * up)


UNGATED_ACTIVATIONS = {"relu2": relu2, "xielu": xielu,
                       "gelu_pytorch_tanh": lambda up, _layer: F.gelu(up, approximate="tanh")}  # StarCoder2's


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeLU (tanh approximation: transformers' gelu_pytorch_tanh) of the gate times the up
    projection, as `silu_mul` (Gemma's MLP)."""
    inter = gate_up.shape[1] // 2
    return F.gelu(gate_up[:, :inter], approximate="tanh").mul_(gate_up[:, inter:])


def clamped_swiglu(alpha: float, limit: float):
    """GPT-OSS's activation of gate | up [T, 2I]: the gate clamped from above at `limit`, the
    up projection to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate)."""

    def act_mul(gate_up: torch.Tensor) -> torch.Tensor:
        inter = gate_up.shape[1] // 2
        gate = gate_up[:, :inter].clamp(max=limit)
        up = gate_up[:, inter:].clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))

    return act_mul
