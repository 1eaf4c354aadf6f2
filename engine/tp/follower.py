"""`python -m pdserve.engine.tp.follower CONFIG_JSON`: a tensor-parallel rank other than 0.

It starts with rank 0 and reads the model's config while rank 0 does, then loads the share
rank 0 assigns it (while rank 0 loads its own), joins the ranks' group, maps the KV pool
rank 0 sizes then (shared memory rank 0 made and registers with NIXL), and runs every step
rank 0 broadcasts until told to stop. It never outlives rank 0: it gets SIGKILL when its
parent dies, and exits at once if the parent is already gone. A step that fails (rank 0
died mid-collective) ends it too. It ignores SIGTERM and SIGINT, which rank 0 answers by
draining, then stopping it.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
from types import SimpleNamespace

from pdserve import process_gc

PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    # SIGTERM and SIGINT reach the node's whole process group; rank 0 drains its requests
    # first and then stops this rank, so a rank must not end before it.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != parent:  # the parent died before the line above ran
        os._exit(1)


class _Tokens:
    """The step's token ids of one sequence, indexed by absolute position as the runner
    reads them (only [begin, end) came over)."""

    def __init__(self, begin: int, ids: list[int]) -> None:
        self.begin, self.ids = begin, ids

    def __getitem__(self, cut: slice) -> list[int]:
        return self.ids[cut.start - self.begin:cut.stop - self.begin]


class _StepSequence:
    """What `ModelRunner.run` reads of a sequence (of its request, the LoRA adapter: every
    rank orders the step's rows alike, by adapter, and adds its share of each delta; and
    whether LongRoPE's long factors rotate its prompt)."""

    def __init__(self, num_computed: int, ids: list[int], pages: list[int], lora: int, long_rope: bool) -> None:
        self.num_computed, self.pages = num_computed, pages
        self.token_ids = _Tokens(num_computed, ids)
        self.request, self.long_rope = SimpleNamespace(lora=lora), long_rope


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    _die_with_parent(spec["parent"])
    process_gc.own_process(server=True)
    import torch

    from ..config import EngineConfig
    from ..kv_pool import mapped_pool
    from ..lora import load_adapters
    from ..model import ModelRunner
    from ..model.weights import load_config
    from ..native import keep_step_buffers
    from .. import collectives
    from .group import PLAN_KEY, loaded_key
    from .shard import TPShard, load_rank

    config = EngineConfig(**spec["config"])
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    keep_step_buffers()
    rank, world, dtype = spec["rank"], config.tensor_parallel_size, getattr(torch, config.dtype)
    hf = load_config(config.model_dir)
    store = collectives.client_store(spec["store_port"], world)
    plan = json.loads(store.get(PLAN_KEY))  # once rank 0 has read the config too
    shard = TPShard(**plan["shards"][rank])
    model = load_rank(config, hf, dtype, plan["max_model_len"], shard)
    load_adapters(config.lora_modules, model, hf, dtype, config.device, shard)
    store.set(loaded_key(rank), "loaded")  # rank 0 waits for every rank's weights
    collectives.join(spec["store_port"], rank, world, store)
    shapes = collectives.broadcast_object()  # once rank 0 has sized the pools
    if shapes is None:  # rank 0 failed to start
        collectives.leave()
        return 0
    kv_cache = mapped_pool(config.kv_layout, tuple(shapes[rank - 1]), spec["pool_fd"], dtype)
    os.close(spec["pool_fd"])
    runner = ModelRunner(model, kv_cache, config.page_size, config.resolved_attention_backend, config.device)
    process_gc.serving()
    collectives.barrier()  # ready: rank 0 returns from its start
    while True:
        step = collectives.broadcast_object()
        if step is None:
            break
        seqs = [_StepSequence(*s) for s in step["seqs"]]
        runner.run(seqs, step["num_new"], step["wants"])
    collectives.leave()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
