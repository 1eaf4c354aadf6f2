"""The Triton kernels of the decoder layer's small ops (`TritonOps`) give what `TorchOps`
gives: float32 to the last bits a reordered sum can change, bfloat16 to one rounding step;
rotary + KV store writes exactly the given slots of strided page views like the engine's
and nothing for padding slots, over odd head dims, GQA ratios and page sizes (1 and
non-powers of two). `for_model` picks TritonOps for CUDA in half precision without
touching a device. On a real GPU the ops are also captured into a CUDA graph.

Triton interprets or compiles for a whole process (its own library functions are jitted
when triton is imported): without CUDA these tests run on CPU tensors through its
interpreter; with CUDA, and TRITON_INTERPRET not set by an earlier module, compiled on
the GPU (as `benchmarks/gpu.py` runs this file)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported, and so before anything jits

import types  # noqa: E402

import pytest  # noqa: E402
import triton  # noqa: E402, F401  (a dependency: these tests run it)

from pdserve.engine.attention import cpu_ops  # noqa: E402
from pdserve.engine.model.fused import FusedOps  # noqa: E402
from pdserve.engine.model.layer_ops import TorchOps  # noqa: E402
from pdserve.engine.model.rope import RotaryTables  # noqa: E402
from pdserve.engine.model.triton_fused import TritonOps  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"
DTYPES = [torch.float32, torch.bfloat16]
MAX_POSITIONS = 64


def _ops(dtype, num_heads=4, num_kv_heads=2, head_dim=64):
    rope = RotaryTables(types.SimpleNamespace(rope_theta=10000.0), head_dim, MAX_POSITIONS, dtype, DEVICE)
    return (TritonOps(rope, num_heads, num_kv_heads, head_dim, 1e-5),
            TorchOps(rope, num_heads, num_kv_heads, head_dim, 1e-5))


def _randn(g, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype=dtype, device=DEVICE)


def _close(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:  # within a rounding step of bfloat16 / float16
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1.6e-2)


def _store_kv_skipping_padding(k_cache, v_cache, k, v, slots):
    """torch's KV store for the reference; it has no padding slots, so they are dropped here."""
    keep = slots >= 0
    cpu_ops.store_kv(k_cache, v_cache, k[keep], v[keep], slots[keep])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, n", [(0, 64), (1, 64), (3, 96), (17, 80)])  # 96, 80: padded, masked
def test_add_rms_norm_matches_torch_with_and_without_residual(dtype, rows, n):
    triton_ops, plain = _ops(dtype)
    g = torch.Generator().manual_seed(rows)
    x, residual = _randn(g, rows, n, dtype=dtype, scale=3.0), _randn(g, rows, n, dtype=dtype)
    weight = _randn(g, n, dtype=dtype)
    x_before, residual_before = x.clone(), residual.clone()
    got_h, got_r = triton_ops.add_rms_norm(x, residual, weight)
    want_h, want_r = plain.add_rms_norm(x, residual, weight)
    if INTERPRETED and dtype == torch.bfloat16:
        _close(got_r, want_r)  # the interpreter casts float32 to bfloat16 by truncating, a GPU rounds
    else:
        torch.testing.assert_close(got_r, want_r, atol=0, rtol=0)  # one add, rounded as torch rounds
    _close(got_h, want_h)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)  # inputs unwritten
    got_h, got_r = triton_ops.add_rms_norm(x, None, weight)
    assert got_r is x
    _close(got_h, plain.rms_norm(x, weight))


def test_add_rms_norm_rounds_as_transformers_llama_rms_norm():
    """transformers rounds the normalised row to the dtype, then multiplies by the weight;
    torch's F.rms_norm rounds once, after the weight (1 element in 4 differs, in half
    precision). float16: the interpreter rounds it as a GPU does."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    triton_ops, _ = _ops(torch.float16)
    g = torch.Generator().manual_seed(4)
    x, residual = _randn(g, 17, 96, dtype=torch.float16, scale=3.0), _randn(g, 17, 96, dtype=torch.float16)
    norm = LlamaRMSNorm(96, eps=1e-5).to(device=DEVICE, dtype=torch.float16)
    norm.weight.data = _randn(g, 96, dtype=torch.float16)
    got = triton_ops.add_rms_norm(x, residual, norm.weight.data)[0]
    with torch.no_grad():
        want = norm(residual + x)
    # Only a reordered sum of squares may move a value across a rounding boundary.
    assert (got != want).float().mean() < 0.01
    _close(got, want)


def test_add_rms_norm_takes_rows_with_a_gap():
    triton_ops, plain = _ops(torch.float32)
    wide = _randn(torch.Generator().manual_seed(3), 5, 48)
    x, residual = wide[:, :40], wide[:, 8:]  # row stride 48, not 40
    weight = torch.linspace(0.5, 2.0, 40, device=DEVICE)
    for got, want in zip(triton_ops.add_rms_norm(x, residual, weight), plain.add_rms_norm(x, residual, weight)):
        _close(got, want)


# (tokens, query heads, KV heads, head dim, page size): GQA 1, 2, 3 and 4; head dims 64,
# 80 (halves padded to 64) and 128; pages of 1, 5 and 16 slots.
ROPE_CASES = {
    "empty": (0, 4, 2, 64, 16),
    "decode_mha_page1": (1, 2, 2, 64, 1),
    "gqa2_d80_page5": (3, 4, 2, 80, 5),
    "gqa4_d128_page16": (17, 8, 2, 128, 16),
    "gqa3_d80_page1": (17, 3, 1, 80, 1),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(ROPE_CASES))
def test_rope_store_matches_torch_and_writes_only_the_given_slots(dtype, name):
    T, H, Hkv, D, page_size = ROPE_CASES[name]
    triton_ops, plain = _ops(dtype, H, Hkv, D)
    g = torch.Generator().manual_seed(T + D)
    pages, layers, layer = -(-(T + 4) // page_size), 3, 1  # room for every token, and unused slots
    qkv = _randn(g, T, (H + 2 * Hkv) * D, dtype=dtype)
    positions = torch.randint(0, MAX_POSITIONS, (T,), generator=g).to(DEVICE)
    slots = torch.randperm(pages * page_size, generator=g)[:T]
    slots[1::3] = -1  # every third token from the second is padding
    slots = slots.to(DEVICE)
    sentinel = 7.0  # "untouched" must be told apart from a written zero
    pools = [torch.full((pages, layers, 2, page_size, Hkv, D), sentinel, dtype=dtype, device=DEVICE) for _ in range(2)]
    outs = []
    for ops, pool in zip((triton_ops, plain), pools):
        k_cache, v_cache = pool[:, layer, 0], pool[:, layer, 1]  # strided views, as the engine's
        outs.append(ops.rope_store(qkv, positions, None, None, k_cache, v_cache, slots, _store_kv_skipping_padding))
    _close(*outs)
    _close(pools[0], pools[1])
    # By slot: [K/V, slot, Hkv, D]. Values are copied, not computed: exactly qkv's v heads.
    by_slot = pools[0][:, layer].transpose(0, 1).reshape(2, pages * page_size, Hkv, D)
    written = slots[slots >= 0]
    v = qkv[:, (H + Hkv) * D :].view(T, Hkv, D)
    assert torch.equal(by_slot[1][written], v[slots >= 0])
    untouched = torch.ones(pages * page_size, dtype=torch.bool, device=DEVICE)
    untouched[written] = False
    assert (by_slot[:, untouched] == sentinel).all()
    others = [i for i in range(layers) if i != layer]
    assert (pools[0][:, others] == sentinel).all()


def test_rope_store_takes_int32_slots_and_a_strided_qkv():
    T, H, Hkv, D = 4, 2, 1, 64
    triton_ops, plain = _ops(torch.float32, H, Hkv, D)
    qkv = _randn(torch.Generator().manual_seed(5), T, (H + 2 * Hkv) * D + 16)[:, : (H + 2 * Hkv) * D]
    positions = torch.tensor([0, 9, 63, 1], device=DEVICE)
    slots = torch.tensor([7, 0, 3, -1], device=DEVICE)
    pools = [torch.zeros(4, 2, 2, 2, Hkv, D, device=DEVICE) for _ in range(2)]
    outs = [ops.rope_store(qkv, positions, None, None, pool[:, 0, 0], pool[:, 0, 1], s, _store_kv_skipping_padding)
            for ops, pool, s in zip((triton_ops, plain), pools, (slots.int(), slots))]
    _close(*outs)
    _close(pools[0], pools[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_store_with_head_norms_takes_torchs_path(dtype):
    T, H, Hkv, D = 3, 4, 2, 16
    triton_ops, plain = _ops(dtype, H, Hkv, D)
    g = torch.Generator().manual_seed(6)
    qkv = _randn(g, T, (H + 2 * Hkv) * D, dtype=dtype)
    q_norm, k_norm = _randn(g, D, dtype=dtype), _randn(g, D, dtype=dtype)
    positions, slots = torch.tensor([0, 5, 6], device=DEVICE), torch.tensor([2, 3, 4], device=DEVICE)
    pools = [torch.zeros(2, 1, 2, 4, Hkv, D, dtype=dtype, device=DEVICE) for _ in range(2)]
    outs = [ops.rope_store(qkv, positions, q_norm, k_norm, pool[:, 0, 0], pool[:, 0, 1], slots, cpu_ops.store_kv)
            for ops, pool in zip((triton_ops, plain), pools)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(pools[0], pools[1])


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's exp(100): inf, as on a GPU
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, inter", [(0, 64), (1, 64), (3, 80), (17, 1100)])  # 1100: two blocks
def test_silu_mul_matches_torch(dtype, rows, inter):
    triton_ops, plain = _ops(dtype)
    gate_up = _randn(torch.Generator().manual_seed(rows), rows, 2 * inter, dtype=dtype, scale=6.0)
    if rows:
        gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # saturated and zero gates
    _close(triton_ops.silu_mul(gate_up), plain.silu_mul(gate_up))


@pytest.mark.skipif(not INTERPRETED, reason="swaps the ops of a CPU engine; a GPU engine picks TritonOps itself")
@pytest.mark.parametrize("family, kv_layout", [("llama", "page-major"), ("qwen3", "page-major"),
                                               ("llama", "layer-major")])  # qwen3: rope_store takes torch's path
def test_engine_with_triton_ops_generates_torch_ops_tokens(checkpoint_dirs, family, kv_layout):
    from pdserve.engine import LLM, SamplingParams

    prompts = [[5, 6, 7, 8, 9] * 4, [10, 11, 12], [13, 40, 7] * 9]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    tokens = []
    for ops in (TorchOps, TritonOps):
        # Page size 3 and a 16-token budget: chunked prefills over cached prefixes, and decodes.
        llm = LLM(checkpoint_dirs(family), page_size=3, max_num_batched_tokens=16, kv_layout=kv_layout)
        m = llm.engine.runner.model
        m.ops = ops(m.rope, m.num_heads, m.num_kv_heads, m.head_dim, m.eps)
        tokens.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    assert tokens[1] == tokens[0]


def _for_model(dtype, device, head_dim=64):
    rope = RotaryTables(types.SimpleNamespace(rope_theta=10000.0), head_dim, 8, torch.float32)
    return FusedOps.for_model(dtype, torch.device(device), rope, 4, 2, head_dim, 1e-5)


def test_for_model_picks_triton_on_cuda_in_half_precision_only(monkeypatch):
    monkeypatch.delenv("PDSERVE_NO_TRITON_OPS", raising=False)
    # Only choosing: none of these touches CUDA, so they run on a machine without one.
    assert type(_for_model(torch.bfloat16, "cuda")) is TritonOps
    assert type(_for_model(torch.float16, "cuda")) is TritonOps
    assert type(_for_model(torch.float32, "cuda")) is TorchOps  # the exactness oracle stays torch's
    assert type(_for_model(torch.bfloat16, "cuda", head_dim=512)) is TorchOps
    assert type(_for_model(torch.bfloat16, "cpu")) is not TritonOps
    monkeypatch.setenv("PDSERVE_NO_TRITON_OPS", "1")
    assert type(_for_model(torch.bfloat16, "cuda")) is TorchOps


def test_importing_triton_fused_does_not_import_triton():
    import subprocess
    import sys

    code = "import sys, engine.model.fused, engine.model.triton_fused; assert 'triton' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.skipif(INTERPRETED, reason="needs a CUDA device (and triton compiling, not interpreting)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_ops_match_torch_and_capture_in_a_graph(dtype):
    T, H, Hkv, D, page_size, n, inter = 5, 8, 2, 80, 16, 256, 384
    triton_ops, plain = _ops(dtype, H, Hkv, D)
    g = torch.Generator().manual_seed(0)
    x, residual, weight = _randn(g, T, n, dtype=dtype), _randn(g, T, n, dtype=dtype), _randn(g, n, dtype=dtype)
    qkv = _randn(g, T, (H + 2 * Hkv) * D, dtype=dtype)
    gate_up = _randn(g, T, 2 * inter, dtype=dtype, scale=6.0)
    positions = torch.tensor([0, 1, 30, 63, 2], device=DEVICE)
    slots = torch.tensor([3, -1, 40, 17, 0], device=DEVICE)
    pools = [torch.zeros(4, 2, 2, page_size, Hkv, D, dtype=dtype, device=DEVICE) for _ in range(3)]

    def run(ops, pool):
        h, r = ops.add_rms_norm(x, residual, weight)
        q = ops.rope_store(qkv, positions, None, None, pool[:, 1, 0], pool[:, 1, 1], slots, _store_kv_skipping_padding)
        return h, r, q, ops.silu_mul(gate_up), ops.add_rms_norm(x, None, weight)[0]

    got, want = run(triton_ops, pools[0]), run(plain, pools[1])
    for a, b in zip(got, want):
        _close(a, b)
    _close(pools[0], pools[1])
    graph = torch.cuda.CUDAGraph()  # capture fails if an op reads a value on the host
    with torch.cuda.graph(graph):
        captured = run(triton_ops, pools[2])
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(captured, got):
        assert torch.equal(a, b)
    assert torch.equal(pools[2], pools[0])
