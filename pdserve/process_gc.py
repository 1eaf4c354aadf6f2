"""Python's garbage collector in pdserve's own programs: the `pdserve` command, a node's
tensor-parallel ranks and the benchmarks run as scripts. A program that imports pdserve as
a library keeps its collector as it is: these calls do nothing there.

Why: a node imports torch and transformers, hundreds of thousands of objects the collector
tracks that never become garbage. It scans them again each time the heap grows by a
quarter, every full collection while serving scans them once more, and at exit Python
collects them one by one. So a server starts with the collector off; once it serves, one
collection frees start-up's garbage, what is left is frozen (left out of every later scan)
and the collector turns on; and every program freezes all it holds at exit, where Python
does not promise to run the finalizers of objects still alive anyway. (docs/operations.md,
"Start-up", has what it saves.) A server that serves also hands back the memory that its
start freed, which glibc would otherwise keep in its heap (`trim_heap`).
"""

from __future__ import annotations

import atexit
import ctypes
import gc

_own = False


def own_process(server: bool = False) -> None:
    """Called first by a program of pdserve's own; `server`: it starts a server, which
    calls `serving()` once it serves (until then the collector is off)."""
    global _own
    _own = True
    atexit.register(gc.freeze)  # before the program registers its own: it runs after them
    if server:
        gc.disable()


def serving() -> None:
    """Start-up is over (a node serves, a rank joined its group): collect what it left as
    garbage (one full collection: thousands of import-time cycles, which a freeze would
    keep for good), freeze the rest, turn the collector on, and hand the heap's free memory
    back to the system."""
    if _own:
        gc.collect()
        gc.freeze()
        gc.enable()
        trim_heap()


def trim_heap() -> None:
    """glibc keeps the blocks a program frees in its heap rather than unmapping them, and
    start-up frees a model's worth (its weights copied, cut and fused as they load):
    malloc_trim returns their pages. Elsewhere (musl, macOS) there is nothing to do."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)
