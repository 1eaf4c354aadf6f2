"""A KV pool in GPU memory, as the prefill role sends it.

The engine's kernels are asynchronous: when a step (or a layer hook) returns on the engine
thread, the K/V stores it launched may not have run yet. `kv_stored` is a CUDA event
recorded on the engine's current stream: complete once everything launched before it has
run (the layer's K/V store included). It is recorded on the engine thread, whose stream it
is, and waited for by whoever reads the bytes; nothing here synchronizes the whole device.

The threads that post NIXL WRITEs of the pool (and drive them: without NIXL's own thread
the poster moves the data) run with the pool's device current (`bind_device`), as the
engine thread does, so UCX's CUDA copies find the pool's context there.
"""

from __future__ import annotations


def on_gpu(device: str) -> bool:
    return device.startswith("cuda")


def kv_stored(device: str):
    """A CUDA event after everything the engine's stream on `device` was given so far.
    Call it on the engine thread."""
    import torch

    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def bind_device(device: str) -> None:
    """Make the pool's device (its CUDA context) current on the calling thread; nothing on
    the CPU."""
    if on_gpu(device):
        import torch

        torch.cuda.set_device(device)
