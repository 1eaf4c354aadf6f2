"""The collectives a tensor-parallel step needs, on `torch.distributed` (gloo; the ranks run
on the CPU, see EngineConfig.validate): the layers' all-reduces, and rank 0 telling every
rank what to run.

One process group per process (the default group): a process holds one TP engine.
"""

from __future__ import annotations

import os
import pickle
from datetime import timedelta

import torch
import torch.distributed as dist

# A rank that stops answering (frozen, its host swapping) fails the step after this long,
# not after torch's 30 minutes; a rank that dies fails it at once (its sockets close).
TIMEOUT = timedelta(minutes=5)


def join(store_port: int, rank: int, world: int, store=None) -> None:
    """Join the node's group: rank 0's TCPStore on 127.0.0.1 (every rank is on its host),
    or `store`, a connection to it made already."""
    # gloo would otherwise pick the interface the host name resolves to, which a node in a
    # network namespace may not have; the ranks talk over loopback.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if store is None:
        store = client_store(store_port, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=TIMEOUT)


def client_store(store_port: int, world: int) -> dist.TCPStore:
    """A connection to rank 0's TCPStore."""
    return dist.TCPStore("127.0.0.1", store_port, world, is_master=False, timeout=TIMEOUT)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(x)
    return x


def barrier() -> None:
    dist.barrier()


def broadcast_object(obj=None):
    """Rank 0's `obj` on every rank (pickled: a step's token ids, positions and pages)."""
    if dist.get_rank() == 0:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        dist.broadcast(size, 0)
        dist.broadcast(data, 0)
        return obj
    size = torch.empty(1, dtype=torch.int64)
    dist.broadcast(size, 0)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(data, 0)
    return pickle.loads(data.numpy().tobytes())


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
