"""Jitting the engine's Triton kernels on first use (`attention/triton_ops.py`,
`model/triton_fused.py`).

Kernels are plain functions of their module whose globals name `triton` and `tl`;
`kernel(namespace, name)` binds those two in the module on first use and jits the function
then, so importing a kernel module never imports triton (CPU-only installs keep working),
and `TRITON_INTERPRET=1` (the CPU interpreter the tests use) only has to be set before the
first call. A kernel is jitted anew if the interpreter setting changed since.
"""

from __future__ import annotations


def kernel(namespace: dict, name: str):
    """The jitted `namespace[name]` (a module's globals())."""
    import triton
    import triton.language as tl

    namespace["triton"], namespace["tl"] = triton, tl
    cache = namespace.setdefault("_jitted", {})
    key = (name, bool(triton.knobs.runtime.interpret))
    if key not in cache:
        cache[key] = triton.jit(namespace[name])
    return cache[key]
