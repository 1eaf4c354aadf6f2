"""Rank 0's side of a tensor-parallel engine: it starts ranks 1..N-1, gives each its KV
pool, and tells them every step to run (`TPRunner`).

Start-up (`TPGroup`, `assign`, `join`, `attach`): the ranks start first and read the
model's config while rank 0 does, then load the shares rank 0 assigns while it loads its
own; the group forms once all hold theirs, so the pools are sized (memory.kv_cache_pages)
with every rank's weights in memory; then each rank maps its pool and the engine serves.

Each rank's pool is shared memory (a memfd rank 0 creates and maps too, zero and untouched
until written): the rank computes into it, and rank 0's one NIXL agent registers every
rank's pool, so a transfer moves each rank's head slice straight from or into the pool of
the rank that holds it. Invariants:
- The ranks live and die with rank 0: they get SIGKILL when it dies, and when one of them
  exits while the engine runs, rank 0's process exits at once (exit code 3), so routers and
  peers see one node failure and no rank is left holding pages.
- Every rank runs every step, in the order rank 0 broadcast them; a step that fails on a
  collective means a rank died, and the node exits as above.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading

import torch
import torch.distributed as dist

from pdserve.arith import ceil_div

from .. import collectives
from ..kv_pool import mapped_pool
from .shard import TPShard

log = logging.getLogger("pdserve.engine")
RANK_DIED_EXIT = 3


PLAN_KEY = "pdserve/plan"  # every rank's TPShard and the served context, set by `assign`


def loaded_key(rank: int) -> str:
    """Set in the ranks' store once `rank` holds its weights."""
    return f"pdserve/loaded/{rank}"


class TPGroup:
    def __init__(self, config) -> None:
        """Start ranks 1..N-1 (N: config.tensor_parallel_size) at once: each imports what it
        needs and reads the model's config while the caller, rank 0, does; `assign` then gives
        each its share, which it loads while rank 0 loads its own; `join` waits for them."""
        self.config, self.world = config, config.tensor_parallel_size
        self.closing = self.forming = self.joined = False
        self.failed: str | None = None  # a rank that exited before the group formed
        self.pools: list[torch.Tensor] = []  # ranks 1..N-1, mapped here
        self._store = dist.TCPStore("127.0.0.1", 0, self.world, is_master=True, timeout=collectives.TIMEOUT,
                                    wait_for_workers=False)
        self._procs: list[subprocess.Popen] = []
        self._fds: list[int] = []  # each rank's pool, sized once this rank has sized its own
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if config.num_threads:
            env.update(OMP_NUM_THREADS=str(config.num_threads))
        spec_config = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
        for rank in range(1, self.world):
            fd = os.memfd_create(f"pdserve-kv-rank{rank}")
            spec = dict(parent=os.getpid(), config=spec_config, rank=rank, store_port=self._store.port, pool_fd=fd)
            # Not a new session: a signal to the node's process group reaches its ranks too.
            self._procs.append(subprocess.Popen(
                [sys.executable, "-m", "pdserve.engine.tp.follower", json.dumps(spec)], pass_fds=(fd,), env=env))
            self._fds.append(fd)
        # Watched from here on: a rank that exits ends the start (`join` raises) or, once the
        # group forms, the node, at once, where a collective would wait out the timeout.
        for rank, proc in enumerate(self._procs, 1):
            threading.Thread(target=self._watch, args=(proc, rank), name=f"tp-rank{rank}", daemon=True).start()

    def assign(self, shards: list[TPShard], max_model_len: int) -> None:
        """Every rank's share of the model, and the context its tables are built for."""
        self.shards = shards
        self._store.set(PLAN_KEY, json.dumps({"shards": [dataclasses.asdict(s) for s in shards],
                                              "max_model_len": max_model_len}))

    def join(self) -> None:
        """Form the ranks' group once every rank holds its weights; RuntimeError naming a
        rank that exited first (its own errors are on stderr above)."""
        self._store.wait([loaded_key(r) for r in range(1, self.world)])
        if self.failed:
            raise RuntimeError(self.failed)
        self.forming = True
        collectives.join(self._store.port, 0, self.world, self._store)
        self.joined = True

    def attach(self, kv_cache: torch.Tensor) -> None:
        """Give every rank its pool, rank 0's `kv_cache` with that rank's heads (shared
        memory: the shape in any order as indexed), and wait until every rank is ready."""
        shapes = []
        for shard, fd in zip(self.shards[1:], self._fds):
            shape = (*kv_cache.shape[:-2], shard.num_kv_heads, kv_cache.shape[-1])
            os.ftruncate(fd, torch.Size(shape).numel() * kv_cache.dtype.itemsize)
            self.pools.append(mapped_pool(self.config.kv_layout, shape, fd, kv_cache.dtype))
            shapes.append(list(shape))
        self._close_fds()
        collectives.broadcast_object(shapes)
        collectives.barrier()  # every rank mapped its pool

    def _watch(self, proc: subprocess.Popen, rank: int) -> None:
        code = proc.wait()
        if self.closing:
            return
        if self.forming:
            log.error("tensor-parallel rank %d exited (code %s): this node stops", rank, code)
            os._exit(RANK_DIED_EXIT)
        self.failed = f"tensor-parallel rank {rank} exited (code {code}) while loading its weights"
        # Ends `join`'s wait (another connection: the wait holds its own).
        store = collectives.client_store(self._store.port, self.world)
        for other in range(1, self.world):
            store.set(loaded_key(other), "exited")

    def run_step(self, seqs, num_new: list[int], wants: list[bool], page_size: int) -> None:
        """Tell every other rank to run this step (rank 0 runs it next)."""
        step = {"seqs": [(s.num_computed, s.token_ids[s.num_computed:s.num_computed + n],
                          s.pages[:ceil_div(s.num_computed + n, page_size)], s.request.lora, s.long_rope)
                         for s, n in zip(seqs, num_new)],
                "num_new": num_new, "wants": wants}
        try:
            collectives.broadcast_object(step)
        except Exception as err:  # a rank is gone: its watcher ends the node
            self.rank_failed(err)

    def rank_failed(self, err: BaseException) -> None:
        if not self.closing:
            log.error("tensor-parallel step failed (%s): this node stops", err)
            os._exit(RANK_DIED_EXIT)
        raise err

    def close(self) -> None:
        """Stop the ranks (told to, then killed after 10 s; at once before the group formed,
        when they may still be loading) and leave the group."""
        if self.closing:
            return
        self.closing = True
        if self.joined and dist.is_initialized():
            try:
                collectives.broadcast_object(None)  # instead of their pools or the next step
            except Exception:
                pass
        for proc in self._procs:
            try:
                proc.wait(timeout=10 if self.joined else 0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._close_fds()
        collectives.leave()

    def _close_fds(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []


class TPRunner:
    """`ModelRunner.run` for rank 0 of a TP engine: the step goes to every rank first."""

    def __init__(self, runner, group: TPGroup, page_size: int) -> None:
        self.runner, self.group, self.page_size = runner, group, page_size
        self.on_gpu = runner.on_gpu
        self.device = runner.device

    def run(self, seqs, num_new, wants_logits, layer_hook=None):
        self.group.run_step(seqs, num_new, wants_logits, self.page_size)
        try:
            return self.runner.run(seqs, num_new, wants_logits, layer_hook)
        except RuntimeError as err:  # gloo: a peer's socket closed mid-step
            self.group.rank_failed(err)
