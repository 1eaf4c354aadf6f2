"""Small C kernels for the CPU, compiled on first use and called through ctypes.

Why ctypes and not a torch C++ extension: a C file with no torch headers compiles in a
second or two, so a cold start still answers within seconds; a C++ extension takes
minutes. Each library is compiled with the system C compiler into the pdserve cache
directory, keyed by its source, its flags and the CPU, into a temporary name and renamed,
so concurrent first uses never load half a file. torch has already loaded its libgomp, so
the kernels' OpenMP shares torch's thread pool (one pool, not two spinning against each
other).

`load(source, flags, signatures)` returns the library, or None when there is no compiler
(and no library built before), the build fails, the system is not Linux or
PDSERVE_NO_C_KERNELS is set: callers then use their torch path, and `status()` says why.
PDSERVE_KERNEL_CFLAGS adds compiler flags after the kernel's own: for example
`-mno-avx512f` builds the AVX2 paths on an AVX-512 CPU (the tests run both).

`build_all()` builds every kernel library of the engine at once: a CPU worker calls it
before it serves, so no request pays for a compile, and `python -m pdserve.engine.native`
runs it at image build time (printing each library and where it lies). With `--portable`
it builds for x86-64-v3 (AVX2 and FMA) instead of this CPU, keyed without the CPU: an
image built on one machine then runs the C kernels on any AVX2 machine with no compiler,
where a library for the running CPU is neither cached nor buildable.
The kernels' design notes and measurements: docs/kernels.md.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import mmap
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path

log = logging.getLogger(__name__)

# Every kernel library: OpenMP, position independent, -march=native (the key holds the CPU).
BASE_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
_libraries: dict[str, ctypes.CDLL | None] = {}
_HEADERS = Path(__file__).parent  # engine/*.h, shared by the kernels
# The modules that declare a KernelLibrary (one per .c file of the engine package). Named,
# not imported, here: they import this module, and the engine's files import no cycle.
WRAPPERS = ("pdserve.engine.model.gemm", "pdserve.engine.model.fused",
            "pdserve.engine.attention.paged_decode", "pdserve.engine.attention.prefill_attention")
_registered: list[KernelLibrary] = []  # every KernelLibrary made, in order
_built_at: dict[str, Path] = {}  # source -> the shared object loaded
_unavailable: dict[str, tuple[str, str]] = {}  # source -> (reason, its words): torch path
PORTABLE_MARCH = "x86-64-v3"
# What x86-64-v3 code may use, as /proc/cpuinfo names it (abm: lzcnt).
_PORTABLE_NEEDS = {"avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "movbe", "abm"}
_build_portable = False  # set by `main --portable`: build the portable libraries only


@dataclass(frozen=True)
class KernelStatus:
    """Which path a CPU node's kernels take, for its ready line and pdserve_c_kernels."""

    state: str  # "c": every library built; "torch": none (the torch path); "partial"
    reason: str = ""  # why not "c": disabled, no_compiler, not_linux, build_failed
    detail: str = ""  # the reason in words

    def describe(self) -> str:
        if self.state == "c":
            return "C kernels built"
        return f"C kernels {'partly ' if self.state == 'partial' else ''}unavailable, " \
               f"torch path: {self.detail}"


def _cpu_id() -> str:
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor()


def _build(source: Path, flags: list[str]) -> ctypes.CDLL | None:
    from .checkpoint import default_cache_dir

    if platform.system() != "Linux":
        _unavailable[str(source)] = ("not_linux", f"the C kernels build on Linux only, not {platform.system()}")
        return None
    # The source and every header beside it in the engine package (what it may #include).
    text = source.read_bytes() + b"".join(h.read_bytes() for h in sorted(_HEADERS.glob("*.h")))
    portable_flags = [f"-march={PORTABLE_MARCH}" if f == "-march=native" else f for f in flags]

    def cached(flags: list[str], cpu: str) -> Path:
        key = hashlib.sha256(text + " ".join(flags).encode() + cpu.encode()).hexdigest()[:16]
        return default_cache_dir() / "kernels" / f"{source.stem}-{key}.so"

    target = cached(flags, _cpu_id())
    portable = cached(portable_flags, "portable")
    if _build_portable:
        target, flags = portable, portable_flags
    elif not target.exists() and portable.exists() and _PORTABLE_NEEDS <= set(_cpu_id().split()):
        target = portable  # an image's build, made for any AVX2 machine
    if not target.exists():  # built before (an image's build step) needs no compiler now
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            words = "no C compiler (cc or gcc on PATH, or $CC); install gcc for the faster C kernels"
            if not any(reason == "no_compiler" for reason, _ in _unavailable.values()):  # once
                log.warning("C kernels unavailable, using the torch path: %s", words)
            _unavailable[str(source)] = ("no_compiler", words)
            return None
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            subprocess.run([compiler, *flags, str(source), "-o", tmp, "-lm"], check=True, capture_output=True, timeout=120)
            # mkstemp made it private: a cache shared with another user (an image's) must load it
            os.chmod(tmp, 0o755)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(str(target))
    _built_at[str(source)] = target
    return lib


def load(source: Path, flags: list[str], signatures: dict[str, list]) -> ctypes.CDLL | None:
    """The library built from `source` with `flags`, its functions typed by `signatures`
    (name -> argtypes; every function returns int), or None (use the torch path)."""
    key = str(source)
    if key not in _libraries:
        lib = None
        if os.environ.get("PDSERVE_NO_C_KERNELS"):
            _unavailable[key] = ("disabled", "PDSERVE_NO_C_KERNELS is set")
        else:
            try:
                lib = _build(source, [*flags, *shlex.split(os.environ.get("PDSERVE_KERNEL_CFLAGS", ""))])
                if lib is not None:
                    for name, argtypes in signatures.items():
                        fn = getattr(lib, name)
                        fn.argtypes = argtypes
                        fn.restype = ctypes.c_int
            except (OSError, AttributeError, subprocess.SubprocessError) as e:
                detail = (getattr(e, "stderr", b"") or b"").decode()[-500:]
                log.warning("C kernels of %s unavailable, using the torch path: %s %s", source.name, e, detail)
                _unavailable[key] = ("build_failed", f"{source.name} did not build ({e}) {detail}".strip())
                lib = None
        _libraries[key] = lib
    return _libraries[key]


class KernelLibrary:
    """The C kernels of one source file beside its Python wrapper: built on first use (once
    per process), each function typed by `signatures` (name -> argtypes; all return int)."""

    def __init__(self, wrapper: str, source: str, signatures: dict[str, list],
                 flags: list[str] = BASE_FLAGS) -> None:
        self.source = Path(wrapper).with_name(source)
        self.signatures = signatures
        self.flags = flags
        _registered.append(self)

    def library(self) -> ctypes.CDLL | None:
        """The built library, or None: use the torch path."""
        return load(self.source, self.flags, self.signatures)

    def function(self, name: str, device) -> Callable | None:
        """Kernel `name` where it can run (on the CPU, built), or None: use the torch path."""
        if device.type != "cpu":
            return None
        lib = self.library()
        return None if lib is None else getattr(lib, name)


def build_all() -> KernelStatus:
    """Build (or load from the cache) every kernel library of the engine, once per process;
    which path the kernels take, and why."""
    for module in WRAPPERS:
        import_module(module)
    for kernels in _registered:
        kernels.library()
    return status()


def status() -> KernelStatus:
    """The state of the kernel libraries loaded so far (all of them after `build_all`)."""
    missing = [_unavailable[str(k.source)] for k in _registered if _libraries.get(str(k.source)) is None
               and str(k.source) in _unavailable]
    if not missing:
        return KernelStatus("c")
    reason, detail = missing[0]
    return KernelStatus("torch" if len(missing) == len(_registered) else "partial", reason, detail)


def main(argv: list[str] | None = None) -> int:
    """`python -m pdserve.engine.native [--portable]`: build every library (for this CPU, or
    for any x86-64-v3 one), say what and where; exit 1 if one could not be built (0 when
    PDSERVE_NO_C_KERNELS turns them off)."""
    global _build_portable
    _build_portable = "--portable" in (sys.argv[1:] if argv is None else argv)
    result = build_all()
    for kernels in _registered:
        where = _built_at.get(str(kernels.source))
        print(f"{kernels.source.name}: {where or 'not built: ' + _unavailable[str(kernels.source)][1]}")
    print(f"pdserve: {result.describe()}")
    return 0 if result.state == "c" or result.reason == "disabled" else 1


def lazy_zeros(shape, dtype, device="cpu"):
    """torch.zeros(shape) that costs no memory until written: on CPU, a private anonymous
    mapping, zero by definition, so no page is touched (or counted as used) until the engine
    first writes it, and a large pool costs nothing at start. Not on huge pages: they made
    the prefill's first KV stores slower and decode no faster (docs/kernels.md)."""
    import torch

    numel = math.prod(shape)
    if torch.device(device).type != "cpu" or not numel:
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # frombuffer keeps `region` alive as long as the tensor
    return torch.frombuffer(region, dtype=dtype, count=numel).view(shape)


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (glibc malloc.h)
_MMAP_THRESHOLD = 32 << 20  # the largest glibc accepts
_TRIM_THRESHOLD = 1 << 30
_malloc_tuned = False


def keep_step_buffers() -> bool:
    """Let glibc's malloc keep freed blocks of up to 32 MiB for reuse, instead of handing
    them back to the kernel and faulting fresh zeroed pages in for the next step. Every
    step allocates its activations anew (a prefill's gate|up output of 1024 tokens is 12
    MiB); in the main thread glibc trimmed its heap once a step had freed them, so each
    step faulted them in again, a fault and a zeroing per 4 KiB. A few percent on the
    engine in the main thread; the cost is that a process keeps its largest step's memory
    (measurements in docs/kernels.md).

    Process-wide, once, and only where the C library is glibc (mallopt); True if set."""
    global _malloc_tuned
    if _malloc_tuned:
        return True
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(None)
        ok = libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1
    except (OSError, AttributeError):
        return False
    _malloc_tuned = ok
    return ok


if __name__ == "__main__":
    # runpy runs this file as `__main__`, a second copy of the module: the wrappers
    # register their libraries with the package's copy, so run that one's main.
    from pdserve.engine import native

    sys.exit(native.main())
