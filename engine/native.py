"""Small C kernels for the CPU, compiled on first use and called through ctypes.

Why ctypes and not a torch C++ extension: a C file with no torch headers compiles in a
second or two, so a cold start still answers within seconds; a C++ extension takes
minutes. Each library is compiled with the system C compiler into the pdserve cache
directory, keyed by its source, its flags and the CPU, into a temporary name and renamed,
so concurrent first uses never load half a file. torch has already loaded its libgomp, so
the kernels' OpenMP shares torch's thread pool (one pool, not two spinning against each
other).

`load(source, flags, signatures)` returns the library, or None when there is no compiler,
the build fails, the system is not Linux or PDSERVE_NO_C_KERNELS is set: callers then use
their torch path. PDSERVE_KERNEL_CFLAGS adds compiler flags after the kernel's own: for
example `-mno-avx512f` builds the AVX2 paths on an AVX-512 CPU (the tests run both).
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
import tempfile
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

# Every kernel library: OpenMP, position independent, -march=native (the key holds the CPU).
BASE_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
_libraries: dict[str, ctypes.CDLL | None] = {}
_HEADERS = Path(__file__).parent  # engine/*.h, shared by the kernels


def _cpu_id() -> str:
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor()


def _build(source: Path, flags: list[str]) -> ctypes.CDLL | None:
    from .checkpoint import default_cache_dir

    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None or platform.system() != "Linux":
        return None
    # The source and every header beside it in the engine package (what it may #include).
    text = source.read_bytes() + b"".join(h.read_bytes() for h in sorted(_HEADERS.glob("*.h")))
    key = hashlib.sha256(text + " ".join(flags).encode() + _cpu_id().encode()).hexdigest()[:16]
    target = default_cache_dir() / "kernels" / f"{source.stem}-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            subprocess.run([compiler, *flags, str(source), "-o", tmp, "-lm"], check=True, capture_output=True, timeout=120)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return ctypes.CDLL(str(target))


def load(source: Path, flags: list[str], signatures: dict[str, list]) -> ctypes.CDLL | None:
    """The library built from `source` with `flags`, its functions typed by `signatures`
    (name -> argtypes; every function returns int), or None (use the torch path)."""
    key = str(source)
    if key not in _libraries:
        lib = None
        if not os.environ.get("PDSERVE_NO_C_KERNELS"):
            try:
                lib = _build(source, [*flags, *shlex.split(os.environ.get("PDSERVE_KERNEL_CFLAGS", ""))])
                if lib is not None:
                    for name, argtypes in signatures.items():
                        fn = getattr(lib, name)
                        fn.argtypes = argtypes
                        fn.restype = ctypes.c_int
            except (OSError, AttributeError, subprocess.SubprocessError) as e:
                detail = getattr(e, "stderr", b"") or b""
                log.warning("C kernels of %s unavailable, using the torch path: %s %s", source.name, e, detail.decode()[-500:])
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

    def library(self) -> ctypes.CDLL | None:
        """The built library, or None: use the torch path."""
        return load(self.source, self.flags, self.signatures)

    def function(self, name: str, device) -> Callable | None:
        """Kernel `name` where it can run (on the CPU, built), or None: use the torch path."""
        if device.type != "cpu":
            return None
        lib = self.library()
        return None if lib is None else getattr(lib, name)


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
