"""A receiving peer in its own process, for the transfer benchmark and multi-process tests.

``ReceiverProcess`` spawns a process that owns a KV pool tensor (page-major or
layer-major, see ``layout.py``) and a ``TransferAgent`` over it,
and answers commands over a pipe (wait for a notification, checksum slots, fill the
pool). The pool lives only in the child; the parent sees its metadata and ``KVShards``.
With ``ranks`` > 1 the child is a tensor-parallel node: one pool per rank holding that
rank's ``head_ranges`` heads, all registered by its one agent, as a TP decode node does.
With ``netns`` the child first moves into that network namespace ("another host", see
``link.py``), so its agent's sockets and devices are that host's.
Invariant: every command gets exactly one reply, and ``close()`` always ends the child.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
from dataclasses import dataclass, replace
from typing import Any

from pdserve import process_gc
from pdserve.kvtransfer.layout import PAGE_MAJOR, KVLayout, pool_shape
from pdserve.kvtransfer.shards import KVShard, KVShards, head_ranges


@dataclass(frozen=True)
class PoolSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    num_pages: int
    dtype: str = "float32"
    layout: str = PAGE_MAJOR  # or "layer-major"

    @property
    def shape(self) -> tuple[int, ...]:
        return pool_shape(self.layout, self.num_layers, self.num_kv_heads, self.head_dim,
                          self.page_size, self.num_pages)


def allocate(shape: tuple[int, ...], dtype: str, huge_pages: bool = False) -> Any:
    """An uninitialised tensor; with ``huge_pages`` page-aligned anonymous memory
    advised for transparent huge pages (fewer page-table walks when the kernel pins pages)."""
    import torch

    if not huge_pages:
        return torch.empty(shape, dtype=getattr(torch, dtype))
    import mmap

    nbytes = math.prod(shape) * torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    buf = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    # the tensor keeps the mmap alive through its storage
    return torch.frombuffer(buf, dtype=getattr(torch, dtype), count=math.prod(shape)).view(shape)


def make_pool(spec: PoolSpec, fill_seed: int | None = None, huge_pages: bool = False) -> Any:
    """Allocate a pool; with ``fill_seed`` fill it with seeded random bytes (else zeros)."""
    import torch

    # allocate + zero_ rather than zeros: calloc'd pages would only be faulted in by the
    # first transfer into them, which would then measure the kernel, not the copy
    pool = allocate(spec.shape, spec.dtype, huge_pages).zero_()
    if fill_seed is not None:
        raw = pool.view(torch.uint8).view(-1)
        g = torch.Generator().manual_seed(fill_seed)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))
    return pool


def slot_checksums(pool: Any, slots: Any = None) -> Any:
    """One int64 checksum per (layer, kv, slot): position-weighted byte sum, ``[L, 2, n]``.

    ``pool`` is page-major (6-D) or layer-major (5-D); ``slots`` selects slots (in that
    order), default all. Computed a layer at a time so a large pool does not need an
    int64 copy of itself.
    """
    import torch

    page_major = pool.dim() == 6
    L = pool.shape[1] if page_major else pool.shape[0]
    page_size = pool.shape[3] if page_major else 1
    num_slots = pool.shape[0] * page_size if page_major else pool.shape[2]
    raw = pool.view(torch.uint8).reshape(*pool.shape[:-2], -1)  # last dim: one slot's bytes
    idx = torch.arange(num_slots) if slots is None else torch.as_tensor(slots, dtype=torch.int64)
    weights = torch.arange(1, raw.shape[-1] + 1, dtype=torch.int64) * 2654435761 % 1000003
    out = []
    for layer in range(L):
        if page_major:  # [n, 2, bytes] -> [2, n, bytes]
            part = raw[idx // page_size, layer, :, idx % page_size].transpose(0, 1)
        else:
            part = raw[layer][:, idx]
        out.append((part.to(torch.int64) * weights).sum(-1))
    return torch.stack(out)


def head_checksums(pool: Any, slots: Any) -> Any:
    """One int64 checksum per (layer, kv, slot, head) of the pool's heads, ``[L, 2, n, heads]``:
    a head's checksum does not depend on which pool or head index holds it, so heads moved
    between pools of different TP ranks can be compared."""
    import torch

    page_major = pool.dim() == 6
    page_size = pool.shape[3] if page_major else 1
    raw = pool.view(torch.uint8)  # last dim: one head's bytes
    idx = torch.as_tensor(slots, dtype=torch.int64)
    weights = torch.arange(1, raw.shape[-1] + 1, dtype=torch.int64) * 2654435761 % 1000003
    out = []
    for layer in range(pool.shape[1] if page_major else pool.shape[0]):
        if page_major:  # [n, 2, heads, bytes] -> [2, n, heads, bytes]
            part = raw[idx // page_size, layer, :, idx % page_size].transpose(0, 1)
        else:
            part = raw[layer][:, idx]
        out.append((part.to(torch.int64) * weights).sum(-1))
    return torch.stack(out)


def make_shards(spec: PoolSpec, ranks: int, fill_seed: int | None = None,
                huge_pages: bool = False) -> tuple[list[Any], KVShards]:
    """One pool per rank of a TP node (``spec.num_kv_heads`` is the model's), and their shards."""
    pools, shards = [], []
    for rank, (begin, end) in enumerate(head_ranges(spec.num_kv_heads, ranks)):
        seed = None if fill_seed is None else fill_seed + rank
        pools.append(make_pool(replace(spec, num_kv_heads=end - begin), seed, huge_pages))
        shards.append(KVShard(KVLayout.from_tensor(pools[-1], spec.page_size), begin, rank))
    return pools, KVShards(tuple(shards), spec.num_kv_heads)


def _serve(conn: Any, name: str, spec: PoolSpec, fill_seed: int | None, huge_pages: bool,
           agent_kwargs: dict[str, Any], netns: str | None = None, env: dict[str, str] | None = None,
           ranks: int = 1) -> None:
    process_gc.own_process()
    os.environ.update(env or {})  # before NIXL loads: UCX reads its settings once
    if netns is not None:  # before the agent exists: its sockets and devices are this host's
        from pdserve.netns import enter

        enter(netns)
    import torch

    torch.set_num_threads(1)
    from pdserve.kvtransfer.agent import TransferAgent

    pools, shards = make_shards(spec, ranks, fill_seed, huge_pages)
    # one agent registers every rank's pool (a TP node's one NIXL agent)
    agent = TransferAgent(name, pools[0] if ranks == 1 else shards.regions(), **agent_kwargs)
    conn.send((agent.metadata(), shards.to_dict()))
    try:
        while True:
            cmd, *args = conn.recv()
            if cmd == "close":
                conn.send(True)
                return
            if cmd == "wait":
                conn.send(agent.wait_notification(args[0], args[1]))
            elif cmd == "checksums":
                conn.send(slot_checksums(pools[0], args[0] if args else None).numpy())
            elif cmd == "head_checksums":  # rank, slots
                conn.send(head_checksums(pools[args[0]], args[1]).numpy())
            elif cmd == "add_remote":
                conn.send(agent.add_remote(args[0]))
            elif cmd == "notifications":
                conn.send(agent.take_notifications())
            else:
                conn.send(ValueError(f"unknown command {cmd!r}"))
    finally:
        agent.close()


class ReceiverProcess:
    """Handle on a spawned receiver: ``metadata``, ``shards`` (``layout`` when it has one
    pool), and command helpers."""

    def __init__(self, name: str, spec: PoolSpec, *, fill_seed: int | None = None,
                 huge_pages: bool = False, start_timeout_s: float = 60.0, netns: str | None = None,
                 env: dict[str, str] | None = None, ranks: int = 1, **agent_kwargs: Any) -> None:
        """``agent_kwargs`` go to the child's ``TransferAgent`` (progress mode, UCX params).
        ``netns``: the network namespace (``ip netns``) the child moves into before it
        makes its agent; ``env``: variables (``UCX_*``) it sets before loading NIXL;
        ``ranks``: TP ranks, one pool each (``spec.num_kv_heads`` is the model's)."""
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_serve, args=(child, name, spec, fill_seed, huge_pages, agent_kwargs, netns, env, ranks),
            daemon=True
        )
        self.process.start()
        child.close()
        if not self._conn.poll(start_timeout_s):
            self.kill()
            raise TimeoutError(f"receiver {name!r} did not start within {start_timeout_s}s")
        try:
            self.metadata, shards = self._conn.recv()
        except EOFError:
            self.kill()
            raise RuntimeError(f"receiver {name!r} exited during start-up (exit code {self.process.exitcode})") from None
        self.shards = KVShards.from_dict(shards)
        self.name = name

    @property
    def layout(self) -> KVLayout:
        if len(self.shards.shards) != 1:
            raise ValueError(f"receiver {self.name!r} has {len(self.shards.shards)} pools; use .shards")
        return self.shards.shards[0].layout

    def call(self, *cmd: Any, timeout_s: float = 60.0) -> Any:
        self._conn.send(cmd)
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"receiver did not answer {cmd[0]!r} within {timeout_s}s")
        out = self._conn.recv()
        if isinstance(out, Exception):
            raise out
        return out

    def wait(self, tag: bytes, timeout_s: float = 10.0) -> bool:
        return self.call("wait", tag, timeout_s, timeout_s=timeout_s + 30)

    def checksums(self, slots: Any = None) -> Any:
        return self.call("checksums", slots)

    def head_checksums(self, rank: int, slots: Any) -> Any:
        return self.call("head_checksums", rank, slots)

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(10)

    def close(self) -> None:
        try:
            if self.process.is_alive():
                self.call("close", timeout_s=10)
        except (OSError, EOFError, TimeoutError):
            pass
        self.process.join(10)
        self.kill()

    def __enter__(self) -> "ReceiverProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
