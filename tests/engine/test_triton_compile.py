"""Every launch the engine's Triton kernels get on a GPU compiles, through Triton's real
compiler and NVIDIA's ptxas (both in the triton wheel), into a cubin for sm_90 (H100 and
H200), with no GPU here, and keeps its values in registers: ptxas reports no spill to local
memory, which would put slow memory traffic inside the kernels' loops. The interpreter
tests check what the kernels compute; these, that the compiler takes them as launched
(constexpr branches, loop bounds and types the interpreter does not check) and that their
tiles fit (`triton_ops.launch_config`), across head dims 64, 128 and 256, bfloat16 and
IEEE fp32, and GPT-OSS's sinks, before any device time is spent.

Each case runs the engine's own wrapper on CPU tensors with the kernel launch recorded
instead of run, and compiles the kernel for exactly the arguments it was given. The cases
run in a process of their own: Triton's library functions are jitted when it is
imported, interpreted for good if TRITON_INTERPRET was set then, as the interpreter tests
of this session set it."""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import pytest
import torch

from pdserve.engine.attention import triton_ops
from pdserve.engine.model import triton_fused
from pdserve.engine.model.rope import RotaryTables

LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas")
TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64",
         torch.int32: "i32"}


def _recorded(module) -> list:
    """Launches of `module`'s kernels, recorded as (kernel function, args, kwargs), not run."""
    calls = []

    class Launch:
        def __init__(self, name):
            self.fn = getattr(module, name)

        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((self.fn, args, kwargs))

    module._load("_store_kv_kernel" if module is triton_ops else "_silu_mul_kernel")  # binds tl
    module._load = Launch  # this process runs the cases and ends
    return calls


def _arg_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    return "fp32"


def _compile(fn, args, kwargs) -> tuple[str, int]:
    """(kernel name, bytes ptxas spills) of the launch compiled for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    names = list(inspect.signature(fn).parameters)
    constexprs = {k: v for k, v in kwargs.items() if k not in LAUNCH_OPTIONS}
    signature = {n: _arg_type(v) for n, v in zip(names, args)}
    # What a launch specializes on (as triton/tools/compile.py states it): an int equal to 1
    # becomes a constant; a 16-byte aligned pointer and an int divisible by 16 are marked so.
    # Without the marks a kernel takes about twice the registers it takes when launched.
    attrs = {}
    for i, (n, v) in enumerate(zip(names, args)):
        if isinstance(v, int) and not isinstance(v, bool) and v == 1:
            constexprs[n] = 1
        elif isinstance(v, torch.Tensor) and v.data_ptr() % 16 == 0 or (
                isinstance(v, int) and not isinstance(v, bool) and v % 16 == 0):
            attrs[(i,)] = [["tt.divisibility", 16]]
    signature.update({n: "constexpr" for n in constexprs})
    assert list(signature) == names, f"{fn.__name__}: launched with {list(signature)}"
    src = ASTSource(fn=triton.jit(fn), signature=signature, attrs=attrs,
                    constexprs={(names.index(n),): v for n, v in constexprs.items()})
    options = {k: v for k, v in kwargs.items() if k in LAUNCH_OPTIONS}
    binary = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    assert len(binary.asm["cubin"]) > 0
    # Triton does not keep ptxas's report: assemble its PTX again with -v, as it did.
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(binary.asm["ptx"])
        ptx.flush()
        report = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", ptx.name, "-o", os.devnull],
                                capture_output=True, text=True, check=True).stderr
    spills = re.search(r"(\d+) bytes spill stores", report)
    assert spills, report
    return fn.__name__, int(spills.group(1))


def _attention_case(dtype, query_lens, seq_lens, heads=32, kv_heads=8, head_dim=64, page_size=16):
    num_pages = sum(-(-n // page_size) for n in seq_lens) + 1
    pool = torch.zeros(num_pages, 2, 2, page_size, kv_heads, head_dim, dtype=dtype)
    tables = torch.zeros(len(seq_lens), 16, dtype=torch.int64)
    starts = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0)), dtype=torch.int64)
    q = torch.zeros(sum(query_lens), heads, head_dim, dtype=dtype)
    return q, pool[:, 1, 0], pool[:, 1, 1], tables, starts, torch.tensor(seq_lens, dtype=torch.int64)


def attention(dtype, shape, head_dim, heads=32, kv_heads=8, sinks=False) -> list:
    """`sinks`: as GPT-OSS launches it, with sinks (the HAS_SINKS branch) and a 128-key window."""
    calls = _recorded(triton_ops)
    query_lens = [70, 1] if shape == "prefill" else [1, 1]
    args = _attention_case(dtype, query_lens, [75, 300], heads, kv_heads, head_dim)
    splits = triton_ops.MAX_SPLITS if shape == "split" else 1  # a batch of one on a GPU splits in 16
    extra = dict(sinks=torch.zeros(heads), window=128) if sinks else {}
    triton_ops.paged_attention(*args, 16, 0.125, max_query_len=max(query_lens), num_splits=splits, **extra)
    return calls


def store_kv() -> list:
    calls = _recorded(triton_ops)
    q, k_cache, v_cache, *_ = _attention_case(torch.bfloat16, [1], [5])
    kv = torch.zeros(3, 8, 64, dtype=torch.bfloat16)
    triton_ops.store_kv(k_cache, v_cache, kv, kv, torch.tensor([0, 5, -1]))
    return calls


def fused_layer_ops(hidden, heads, kv_heads, head_dim, intermediate) -> list:
    calls = _recorded(triton_fused)
    dtype = torch.bfloat16
    rope = RotaryTables(types.SimpleNamespace(rope_theta=10000.0), head_dim, 64, dtype, "cpu")
    ops = triton_fused.TritonOps(rope, heads, kv_heads, head_dim, 1e-5)
    x = torch.zeros(3, hidden, dtype=dtype)
    ops.add_rms_norm(x, x, torch.ones(hidden, dtype=dtype))
    ops.add_rms_norm(x, None, torch.ones(hidden, dtype=dtype))
    _, k_cache, v_cache, *_ = _attention_case(dtype, [1], [5], heads, kv_heads, head_dim)
    qkv = torch.zeros(3, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    ops.rope_store(qkv, torch.arange(3), None, None, k_cache, v_cache, torch.arange(3), None)
    ops.silu_mul(torch.zeros(3, 2 * intermediate, dtype=dtype))
    return calls


ATTENTION = ["_paged_attention_kernel"]
CASES = {  # name: (what launches, its arguments, the kernels it launches)
    **{f"attention_{shape}_{str(dtype)[6:]}_dim{d}": (
        attention, (dtype, shape, d), ATTENTION + (["_combine_splits_kernel"] if shape == "split" else []))
       for shape in ("decode", "split", "prefill") for dtype in (torch.float32, torch.bfloat16) for d in (64, 128, 256)},
    # 32 query heads to a KV head: a decode program's rows are the group's 32, not 16
    **{f"attention_{shape}_{str(dtype)[6:]}_dim128_group32": (
        attention, (dtype, shape, 128, 32, 1), ATTENTION + (["_combine_splits_kernel"] if shape == "split" else []))
       for shape in ("decode", "split") for dtype in (torch.float32, torch.bfloat16)},
    # GPT-OSS's: 64 query heads on 8 KV heads of 64 dims, sinks and a window
    **{f"attention_{shape}_bf16_dim64_sinks": (
        attention, (torch.bfloat16, shape, 64, 64, 8, True),
        ATTENTION + (["_combine_splits_kernel"] if shape == "split" else []))
       for shape in ("decode", "split", "prefill")},
    "store_kv": (store_kv, (), ["_store_kv_kernel"]),
    **{f"fused_layer_ops_{name}": (
        fused_layer_ops, geometry, ["_add_rms_norm_kernel", "_add_rms_norm_kernel", "_rope_store_kernel", "_silu_mul_kernel"])
       for name, geometry in (("1b", (2048, 32, 8, 64, 8192)), ("8b", (4096, 32, 8, 128, 14336)))},
}


def main() -> None:
    """In the child: each case's [kernel, spilled bytes] pairs, or its error."""
    out = {}
    for name, (fn, params, _) in CASES.items():
        try:
            out[name] = [_compile(*call) for call in fn(*params)]
        except Exception as err:  # noqa: BLE001 - reported to the test of this case
            out[name] = f"{type(err).__name__}: {err}"[-3000:]
    print(json.dumps(out))


@pytest.fixture(scope="module")
def compiled() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "from tests.engine.test_triton_compile import main; main()"
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", list(CASES))
def test_kernels_compile_for_sm90_without_spilling(compiled, case):
    assert isinstance(compiled[case], list), compiled[case]
    assert [name for name, _ in compiled[case]] == CASES[case][2]
    assert [spilled for _, spilled in compiled[case]] == [0] * len(CASES[case][2]), compiled[case]
