"""Rank 0's side of a tensor-parallel engine: it starts ranks 1..N-1, gives each its KV
pool, and tells them every step to run (`TPRunner`).

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


class TPGroup:
    def __init__(self, config, shards: list[TPShard], kv_cache: torch.Tensor, max_model_len: int) -> None:
        """Start ranks 1..N-1 and join them (the caller, rank 0, joins as rank 0); each
        rank's pool is rank 0's `kv_cache` with that rank's heads."""
        world = len(shards)
        dtype, head_dim = kv_cache.dtype, kv_cache.shape[-1]
        self.closing = False
        self.pools: list[torch.Tensor] = []  # ranks 1..N-1, mapped here
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=collectives.TIMEOUT,
                              wait_for_workers=False)
        self._procs: list[subprocess.Popen] = []
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if config.num_threads:
            env.update(OMP_NUM_THREADS=str(config.num_threads))
        spec_config = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
        for shard in shards[1:]:
            shape = (*kv_cache.shape[:-2], shard.num_kv_heads, head_dim)  # as indexed, in any order
            fd = os.memfd_create(f"pdserve-kv-rank{shard.rank}")
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            os.ftruncate(fd, nbytes)
            self.pools.append(mapped_pool(config.kv_layout, shape, fd, dtype))
            spec = dict(parent=os.getpid(), config=spec_config, shard=dataclasses.asdict(shard),
                        store_port=store.port, pool_shape=list(shape), pool_fd=fd, head_dim=head_dim,
                        max_model_len=max_model_len)
            # Not a new session: a signal to the node's process group reaches its ranks too.
            self._procs.append(subprocess.Popen(
                [sys.executable, "-m", "pdserve.engine.tp.follower", json.dumps(spec)], pass_fds=(fd,), env=env))
            os.close(fd)
        self._store = store
        # Watched from here on: a rank that fails to start ends the node too, at once, where
        # the barrier below would wait out the timeout.
        for proc, shard in zip(self._procs, shards[1:]):
            threading.Thread(target=self._watch, args=(proc, shard.rank), name=f"tp-rank{shard.rank}",
                             daemon=True).start()
        try:
            collectives.join(store.port, 0, world, store)
            collectives.barrier()  # every rank loaded its weights and mapped its pool
        except Exception:
            self.close()
            raise

    def _watch(self, proc: subprocess.Popen, rank: int) -> None:
        code = proc.wait()
        if not self.closing:
            log.error("tensor-parallel rank %d exited (code %s): this node stops", rank, code)
            os._exit(RANK_DIED_EXIT)

    def run_step(self, seqs, num_new: list[int], wants: list[bool], page_size: int) -> None:
        """Tell every other rank to run this step (rank 0 runs it next)."""
        step = {"seqs": [(s.num_computed, s.token_ids[s.num_computed:s.num_computed + n],
                          s.pages[:ceil_div(s.num_computed + n, page_size)], s.request.lora)
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
        """Stop the ranks (told to, then killed after 10 s) and leave the group."""
        if self.closing:
            return
        self.closing = True
        if dist.is_initialized():
            try:
                collectives.broadcast_object(None)
            except Exception:
                pass
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        collectives.leave()


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
