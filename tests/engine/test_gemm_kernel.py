"""gemm.c, the CPU matmul of the linear layers, gives x @ W.T + b: in float32 to the last
bits a reordered sum can change, in bfloat16 the float32 sum rounded once (one bfloat16
step at most, from the order of the sums). Shapes cover partial panels (N not a multiple
of 48), partial row blocks (M not a multiple of 8, or of 6 in the AVX2 build), odd K,
biases, more rows than one chunk (2048 rows in the AVX-512 build, 192 in the AVX2 one), K
in several chunks (the AVX2 build's float32 from 3 rows);
`Linear` runs it for every call where it can run, else oneDNN."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine import native
from pdserve.engine.model.gemm import PanelWeight
from pdserve.engine.model.linear import Linear

_FLAGS = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
_CPU = set(_FLAGS.split())
_AVX2 = {"avx2", "fma"} <= _CPU
DTYPES = [torch.float32, torch.bfloat16]


def _has(dtype, isa):
    """Whether gemm.c runs `dtype` here, as built for `isa` (the kernel_isa fixture): with
    AVX-512 float32, and bfloat16 where there is AVX512-BF16 but no AMX; without AVX-512 (or
    built without it), both wherever there is AVX2 with FMA."""
    if isa == "avx2" or "avx512f" not in _CPU:
        return _AVX2
    return dtype == torch.float32 or ("avx512_bf16" in _CPU and "amx_bf16" not in _CPU)


def _pack(weight, isa):
    panels = PanelWeight.pack(weight)
    bf16_odd_k = weight.dtype == torch.bfloat16 and weight.shape[1] % 2  # pairs of K steps: oneDNN
    if _has(weight.dtype, isa) and not bf16_odd_k:
        assert panels is not None, "the CPU has the instructions; no panels here is a build failure"
    return panels


def _reference(x, w, b):
    """float64 sum, then the output dtype's rounding."""
    want = x.double() @ w.double().T + (b.double() if b is not None else 0)
    return want.to(x.dtype)


def _assert_matches(got, x, w, b):
    want = _reference(x, w, b)
    if got.dtype == torch.float32:
        scale = (x.double().abs() @ w.double().abs().T + (b.double().abs() if b is not None else 0)).float()
        assert ((got - want).abs() <= 1e-6 * scale + 1e-30).all()
    else:
        # one bfloat16 step of the larger of the two at most
        step = torch.maximum(got.float().abs(), want.float().abs()) * 2.0**-7
        assert ((got.float() - want.float()).abs() <= step + 1e-30).all(), (got - want).abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(50, 64), (96, 576), (49, 38), (145, 130), (70, 301)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_panels_give_the_product_for_every_block_shape(dtype, n, k, with_bias, kernel_isa):
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if with_bias else None
    panels = _pack(w, kernel_isa)
    if panels is None:
        return
    for rows in (1, 2, 3, 6, 7, 8, 9, 13, 17, 33, 64):
        x = torch.randn(rows, k, generator=g).to(dtype)
        _assert_matches(panels.matmul(x, b), x, w, b)


@pytest.mark.parametrize("k", [64, 301, 576, 1536])
def test_float32_rows_are_bit_for_bit_the_same_alone_or_in_a_batch(k, kernel_isa):
    """From 3 rows the AVX2 build takes K in chunks of up to 256 steps (301: one of 151 and
    one of 150), 1-2 rows over all of K at once: the same sums in the same order."""
    g = torch.Generator().manual_seed(k)
    w, b = torch.randn(100, k, generator=g), torch.randn(100, generator=g)
    panels = _pack(w, kernel_isa)
    if panels is None:
        return
    x = torch.randn(40, k, generator=g)
    batch = panels.matmul(x, b)
    for i in (0, 17, 39):
        assert torch.equal(batch[i], panels.matmul(x[i:i + 1], b)[0]), f"row {i}"
    assert torch.equal(batch[:2], panels.matmul(x[:2], b))


def test_odd_k_in_float32_and_zero_rows(kernel_isa):
    w = torch.randn(70, 37)
    panels = _pack(w, kernel_isa)
    if panels is None:
        return
    x = torch.randn(11, 37)
    _assert_matches(panels.matmul(x, None), x, w, None)
    assert panels.matmul(torch.empty(0, 37), None).shape == (0, 70)


def test_bfloat16_with_odd_k_is_not_packed():
    assert PanelWeight.pack(torch.randn(8, 37).bfloat16()) is None


def test_no_c_kernels_means_no_panels(monkeypatch):
    monkeypatch.setenv("PDSERVE_NO_C_KERNELS", "1")
    monkeypatch.setattr(native, "_libraries", {})  # built ones are forgotten, then not rebuilt
    w = torch.randn(8, 16)
    lin = Linear(w)
    assert lin.panels is None
    x = torch.randn(4, 16)
    torch.testing.assert_close(lin(x), F.linear(x, w))


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_runs_panels_for_every_row_count(dtype, kernel_isa):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(100, 64, generator=g).to(dtype)
    b = torch.randn(100, generator=g).to(dtype)
    lin = Linear(w, b)
    if lin.panels is None:
        assert not _has(dtype, kernel_isa)
        return
    assert lin.weight is None, "the weight is held once, as panels"
    for rows in (1, 256, 2048, 2049, 4100):  # one chunk, then several, ending whole or partial
        x = torch.randn(rows, 64, generator=g).to(dtype)
        got = lin(x)
        _assert_matches(got, x, w, b)
        assert torch.equal(got[-5:], lin(x[-5:])), "a row's result does not depend on its chunk"
    # a strided input, or one with leading dimensions, is taken as its rows
    x = torch.randn(64, 4, generator=g).to(dtype).T
    _assert_matches(lin(x), x, w, b)
    x3 = torch.randn(2, 3, 64, generator=g).to(dtype)
    assert lin(x3).shape == (2, 3, 100)
    _assert_matches(lin(x3).reshape(6, 100), x3.reshape(6, 64), w, b)
    with pytest.raises(ValueError, match="cannot take"):
        lin(torch.randn(2, 64, dtype=torch.float16))


def test_an_empty_weight_is_not_packed():
    assert PanelWeight.pack(torch.randn(0, 16)) is None
    assert PanelWeight.pack(torch.randn(8, 0)) is None
