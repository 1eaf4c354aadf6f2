"""Which device a worker should run on here: `pdserve up` picks its workers' by it, and a
worker told to run on the CPU of a machine with a usable GPU says so at start. Apart from
`runtime/identity.py` because it may import torch, which the router never does."""

from __future__ import annotations

import glob
import importlib.util
from pathlib import Path


def default_device() -> str:
    """A worker's default device: "cuda" when torch can use a GPU here, else "cpu". torch
    (a second or more to import) is asked only when an NVIDIA device and a CUDA build of
    torch are both present."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return "cpu"
    torch_lib = Path(next(iter(spec.submodule_search_locations))) / "lib"
    if not glob.glob(str(torch_lib / "libtorch_cuda*.so*")) or not glob.glob("/dev/nvidia[0-9]*"):
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
