"""The fused C operations of the decoder layer give what the plain torch operations give:
residual add + RMS norm, rotary embedding + KV store into the right slots of strided page
views, SiLU-and-multiply; in float32 to the last bits a reordered sum can change, in
bfloat16 to one bfloat16 rounding step."""

from __future__ import annotations

import types

import pytest
import torch

from pdserve.engine.attention import cpu_ops
from pdserve.engine.model.fused import FusedOps, TorchOps
from pdserve.engine.model.rope import RotaryTables

DTYPES = [torch.float32, torch.bfloat16]


def _ops(dtype, num_heads=6, num_kv_heads=2, head_dim=16, max_positions=64):
    config = types.SimpleNamespace(rope_theta=10000.0)
    rope = RotaryTables(config, head_dim, max_positions, dtype)
    fused = FusedOps.for_model(dtype, torch.device("cpu"), rope, num_heads, num_kv_heads, head_dim, 1e-5)
    assert isinstance(fused, FusedOps), "the C kernels build on these machines; a fallback here is a build failure"
    return fused, TorchOps(rope, num_heads, num_kv_heads, head_dim, 1e-5)


def _close(got, want):
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)
    else:  # within a rounding step of bfloat16 (8 bits of mantissa)
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1.6e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 x 96 runs on the thread pool
def test_add_rms_norm_matches_torch(dtype, rows):
    fused, plain = _ops(dtype)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    residual = torch.randn(rows, 96, generator=g).to(dtype)
    weight = torch.randn(96, generator=g).to(dtype)
    want_h, want_r = plain.add_rms_norm(x, residual.clone(), weight)
    got_h, got_r = fused.add_rms_norm(x, residual, weight)
    assert got_r.data_ptr() == residual.data_ptr()  # the sum is written in place
    torch.testing.assert_close(got_r, want_r, atol=0, rtol=0)  # one add rounds the same
    _close(got_h, want_h)
    # Without a residual: the norm of x, and x is the residual.
    got_h, got_r = fused.add_rms_norm(x, None, weight)
    assert got_r is x
    _close(got_h, plain.rms_norm(x, weight))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_norms", [False, True])  # Qwen3's per-head q/k norms
@pytest.mark.parametrize("strided", [False, True])  # a qkv the kernel cannot take: the torch path
def test_rope_store_matches_torch_and_writes_the_slots(dtype, head_norms, strided):
    H, Hkv, D, page_size, layers = 6, 2, 16, 4, 3
    fused, plain = _ops(dtype, H, Hkv, D)
    g = torch.Generator().manual_seed(1)
    T = 9
    qkv = torch.randn(T, (H + 2 * Hkv) * D + (8 if strided else 0), generator=g).to(dtype)
    qkv = qkv[:, : (H + 2 * Hkv) * D]
    positions = torch.tensor([0, 1, 2, 3, 4, 40, 41, 63, 5])
    slots = torch.tensor([5, 6, 7, 8, 9, 30, 31, 0, 17])  # scattered over pages 0-7
    q_norm = torch.randn(D, generator=g).to(dtype) if head_norms else None
    k_norm = torch.randn(D, generator=g).to(dtype) if head_norms else None
    pools = [torch.zeros(8, layers, 2, page_size, Hkv, D, dtype=dtype) for _ in range(2)]
    outs = []
    for ops, pool in zip((fused, plain), pools):
        k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]  # a middle layer's strided views
        outs.append(ops.rope_store(qkv, positions, q_norm, k_norm, k_cache, v_cache, slots, cpu_ops.store_kv))
    _close(outs[0], outs[1])
    _close(pools[0], pools[1])
    written = pools[0][:, 1].transpose(0, 1).reshape(2, 8 * page_size, Hkv, D)  # [K/V, slot, Hkv, D]
    v = qkv[:, (H + Hkv) * D :].view(T, Hkv, D)
    torch.testing.assert_close(written[1][slots], v, atol=0, rtol=0)
    untouched = torch.ones(8 * page_size, dtype=torch.bool)
    untouched[slots] = False
    assert not written[:, untouched].any()
    assert not pools[0][:, 0].any() and not pools[0][:, 2].any()  # other layers untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 200])
def test_silu_mul_matches_torch(dtype, rows):
    fused, plain = _ops(dtype)
    gate_up = (torch.randn(rows, 2 * 384, generator=torch.Generator().manual_seed(2)) * 6).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # saturated and zero gates
    _close(fused.silu_mul(gate_up), plain.silu_mul(gate_up))

