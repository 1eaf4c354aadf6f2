"""`engine.native`: the KV cache's memory is plain zeros that cost nothing until written, and
freed step buffers are kept for the next step, not faulted in again."""

from __future__ import annotations

import subprocess
import sys

import torch

from pdserve.engine.native import lazy_zeros


def test_the_kv_cache_allocation_is_zeroed_and_shaped():
    for shape in [(3, 5), (2, 1 << 20)]:  # less than a 4 KiB page, and many of them
        t = lazy_zeros(shape, torch.bfloat16)
        assert t.shape == shape and t.dtype == torch.bfloat16 and t.is_contiguous() and not t.any()


def test_a_large_kv_cache_costs_no_memory_until_written():
    def resident_kib() -> int:
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        return 0

    before = resident_kib()
    t = lazy_zeros((256, 1 << 20), torch.float32)  # 1 GiB
    assert resident_kib() - before < 64 * 1024  # not touched: far below its size
    t[3].fill_(1.0)
    assert float(t[3].sum()) == 1 << 20 and not t[4].any()


# A fresh interpreter (the setting is process-wide, and an Engine of another test may have
# made it already): five steps that each allocate 16 blocks of 6 MiB, write them and free
# them, as a prefill's activations are; prints the page faults of those five steps.
_STEPS = """
import resource, sys, torch
torch.set_num_threads(1)
from pdserve.engine.native import keep_step_buffers
if sys.argv[1] == "keep":
    assert keep_step_buffers() and keep_step_buffers()  # once, then a no-op
def step():
    blocks = [torch.ones(6 << 18) for _ in range(16)]
    del blocks
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_freed_step_buffers_are_reused_not_faulted_in_again():
    def faults(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", _STEPS, mode], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        return int(out.stdout.split()[-1])

    pages_per_step = 16 * (6 << 20) // 4096
    default, kept = faults("default"), faults("keep")
    # Kept: under half a step's pages in five steps (seen: 1.5k-7.7k of 24.6k a step).
    assert kept < pages_per_step // 2, (kept, default)
    # glibc's defaults give some of the 96 MiB back after a step and fault it in again, how
    # much varies from run to run (seen: 26k-123k pages over the five steps).
    assert default > kept, (kept, default)


def build_command(cache, **env) -> subprocess.CompletedProcess:
    """`python -m pdserve.engine.native` (what an image build runs) into kernel cache `cache`."""
    import os

    return subprocess.run([sys.executable, "-m", "pdserve.engine.native"], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PDSERVE_CACHE": str(cache), **env})


def test_the_build_command_builds_every_kernel_of_the_engine_and_says_where(tmp_path):
    from pathlib import Path

    import pdserve.engine

    out = build_command(tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    sources = sorted(p.name for p in Path(pdserve.engine.__file__).parent.rglob("*.c"))
    built = dict(line.split(": ", 1) for line in out.stdout.splitlines() if line.endswith(".so"))
    assert sorted(built) == sources, out.stdout
    assert all(Path(path).parent == tmp_path / "kernels" and Path(path).exists() for path in built.values())
    assert out.stdout.splitlines()[-1] == "pdserve: C kernels built"


def test_without_a_compiler_the_build_command_says_why_and_fails(tmp_path):
    out = build_command(tmp_path, PATH=str(tmp_path / "no-such-bin"))
    assert out.returncode == 1, out.stdout + out.stderr
    assert "torch path: no C compiler" in out.stdout.splitlines()[-1], out.stdout
    assert not (tmp_path / "kernels").exists() or not list((tmp_path / "kernels").glob("*.so"))


# A CPU this machine is not: another native key, but every x86-64-v3 feature (or not).
_OTHER_CPU = "flags\t\t: fpu sse4_2 avx avx2 fma bmi1 bmi2 f16c movbe abm another-cpu"
_LOAD_ON = ("import sys; from pdserve.engine import native; native._cpu_id = lambda: sys.argv[1]; "
            "s = native.build_all(); print(s.state, sorted(p.name for p in native._built_at.values()))")


def test_a_portable_build_serves_another_avx2_cpu_without_a_compiler(tmp_path):
    """What an image does: its build machine makes the x86-64-v3 libraries; a node on
    another CPU, with no compiler, loads them instead of falling back to torch."""
    import os

    import pdserve.engine

    out = subprocess.run([sys.executable, "-m", "pdserve.engine.native", "--portable"], capture_output=True,
                         text=True, timeout=600, env={**os.environ, "PDSERVE_CACHE": str(tmp_path)})
    assert out.returncode == 0, out.stdout + out.stderr
    portable = sorted(p.name for p in (tmp_path / "kernels").glob("*.so"))
    assert len(portable) == len(list(__import__("pathlib").Path(pdserve.engine.__file__).parent.rglob("*.c")))
    no_cc = {**os.environ, "PDSERVE_CACHE": str(tmp_path), "PATH": str(tmp_path / "no-such-bin")}
    no_cc.pop("CC", None)
    other = subprocess.run([sys.executable, "-c", _LOAD_ON, _OTHER_CPU], capture_output=True, text=True,
                           timeout=300, env=no_cc)
    assert other.returncode == 0, other.stderr
    assert other.stdout.split(" ", 1) == ["c", f"{portable}\n"], other.stdout
    # A CPU without AVX2 must not load them: the torch path, saying why.
    old = subprocess.run([sys.executable, "-c", _LOAD_ON, _OTHER_CPU.replace(" avx2", "")],
                         capture_output=True, text=True, timeout=300, env=no_cc)
    assert old.stdout.split(" ", 1) == ["torch", "[]\n"], old.stdout + old.stderr
