"""The device an engine runs on, checked against this machine before anything loads.

Why: torch only fails at the first tensor placed there, deep in loading the weights, with
"Torch not compiled with CUDA enabled" or "invalid device ordinal", which name neither the
flag nor what to pass instead. `usable_device` says both in one line.
"""

from __future__ import annotations

import re

import torch

_FORM = re.compile(r"cpu|cuda(:\d+)?")


def usable_device(name: str) -> torch.device:
    """`name` ("cpu", "cuda" or "cuda:N") as a torch device this process can use; else
    ValueError naming the device, what this machine has, and what to pass."""
    if not isinstance(name, str) or not _FORM.fullmatch(name):
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {name!r}")
    device = torch.device(name)
    if device.type == "cpu":
        return device
    if not torch.backends.cuda.is_built():  # (a ROCm build counts: it runs "cuda" through HIP)
        raise ValueError(f"device {name} needs a CUDA build of torch, and this one ({torch.__version__}) "
                         "has none: pass --device cpu, or install torch built for CUDA")
    count = torch.cuda.device_count()
    if count == 0:
        raise ValueError(f"device {name}: torch sees no GPU here (CUDA_VISIBLE_DEVICES, the driver, "
                         "or none in this machine or container): pass --device cpu")
    if device.index is not None and device.index >= count:
        have = "cuda:0" if count == 1 else f"cuda:0 to cuda:{count - 1}"
        raise ValueError(f"device {name} is not here: torch sees {count} GPU{'s' if count > 1 else ''} "
                         f"({have}); pass one of those")
    return device


def to_device(device: torch.device, values) -> torch.Tensor:
    """`values` (a list, or a host tensor) on `device`. To a GPU through pinned memory,
    without waiting: a copy from pageable memory waits for everything queued on the stream
    (the step's forward first of all), which a step would pay once per parameter vector."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)
