"""How a model splits over tensor-parallel ranks (Megatron-style), and each rank's weights.

KV heads go to ranks in contiguous, nearly equal ranges (rank r holds
[r*Hkv//N, (r+1)*Hkv//N)), uneven where N does not divide them (SmolLM2's 3 heads on 2
ranks: 1 and 2). Each rank computes the query heads of its KV heads, so attention never
crosses ranks. With fewer KV heads than ranks, each KV head is replicated on N/Hkv ranks,
which split its query heads (as vLLM does). The MLP's intermediate dimension splits the
same way. q|k|v and gate|up are column-parallel (rows of the weight), o and down
row-parallel (columns), each followed by one all-reduce; their biases stay on rank 0 so
the sum adds them once. The embedding is held whole by every rank, the LM head by rank 0,
which alone samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TPShard:
    rank: int
    world: int
    kv_begin: int
    kv_end: int
    q_begin: int
    q_end: int
    inter_begin: int
    inter_end: int

    @property
    def num_kv_heads(self) -> int:
        return self.kv_end - self.kv_begin

    @property
    def num_heads(self) -> int:
        return self.q_end - self.q_begin


def split_model(num_heads: int, num_kv_heads: int, intermediate: int, world: int) -> list[TPShard]:
    """Every rank's share; ValueError, naming the numbers, where the heads cannot split."""
    if world < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {world}")
    group = num_heads // num_kv_heads  # query heads per KV head
    if world > intermediate:
        raise ValueError(f"tensor_parallel_size {world} exceeds the model's intermediate size {intermediate}")
    shards = []
    for r in range(world):
        if num_kv_heads >= world:
            kv0, kv1 = r * num_kv_heads // world, (r + 1) * num_kv_heads // world
            q0, q1 = kv0 * group, kv1 * group
        else:
            replicas = world // num_kv_heads
            if world % num_kv_heads or group % replicas:
                raise ValueError(
                    f"tensor_parallel_size {world} cannot split {num_kv_heads} KV heads "
                    f"({num_heads} query heads): with fewer KV heads than ranks, the ranks must be a "
                    f"multiple of the KV heads and split each head's {group} query heads evenly; "
                    f"use a size that divides {num_kv_heads} or a multiple of it")
            kv0 = r // replicas
            kv1 = kv0 + 1
            per = group // replicas
            q0 = kv0 * group + (r % replicas) * per
            q1 = q0 + per
        shards.append(TPShard(r, world, kv0, kv1, q0, q1, r * intermediate // world,
                              (r + 1) * intermediate // world))
    return shards


def shard_state(state: dict[str, torch.Tensor], shard: TPShard, num_layers: int, head_dim: int) -> None:
    """Cut `state` (Hugging Face names) in place down to `shard`'s rows and columns."""
    D = head_dim
    q, kv, i = (slice(shard.q_begin * D, shard.q_end * D), slice(shard.kv_begin * D, shard.kv_end * D),
                slice(shard.inter_begin, shard.inter_end))
    rows = {"q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": i, "up_proj": i}
    cols = {"o_proj": q, "down_proj": i}
    for layer in range(num_layers):
        for part in ("self_attn", "mlp"):
            prefix = f"model.layers.{layer}.{part}."
            for name, cut in rows.items():
                for kind in ("weight", "bias"):
                    key = f"{prefix}{name}.{kind}"
                    if key in state:
                        state[key] = state[key][cut].contiguous()
            for name, cut in cols.items():
                key = prefix + name + ".weight"
                if key in state:
                    state[key] = state[key][:, cut].contiguous()
                if shard.rank and prefix + name + ".bias" in state:
                    del state[prefix + name + ".bias"]  # added once, by rank 0
    if shard.rank:
        state.pop("lm_head.weight", None)


def load_model(config, hf_config, dtype: torch.dtype, max_model_len: int):
    """(rank 0's model, every rank's TPShard): the whole model when one rank."""
    from ..model import LlamaModel
    from ..model.arch import geometry
    from ..model.arch import to_llama_names
    from ..model.weights import load_state_dict

    c = hf_config
    heads, kv_heads, head_dim = geometry(c)
    shards = split_model(heads, kv_heads, c.intermediate_size, config.tensor_parallel_size)
    state = load_state_dict(config.model_dir, dtype, config.device)
    to_llama_names(state, c)
    shard_state(state, shards[0], c.num_hidden_layers, head_dim)
    return LlamaModel(c, state, dtype, max_model_len, config.device, shard=shards[0]), shards
