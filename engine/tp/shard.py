"""How a model splits over tensor-parallel ranks (Megatron-style), and each rank's weights.

KV heads go to ranks in contiguous, nearly equal ranges (rank r holds
[r*Hkv//N, (r+1)*Hkv//N)), uneven where N does not divide them (SmolLM2's 3 heads on 2
ranks: 1 and 2). Each rank computes the query heads of its KV heads, so attention never
crosses ranks. With fewer KV heads than ranks, each KV head is replicated on N/Hkv ranks,
which split its query heads (as vLLM does). The MLP's intermediate dimension splits the
same way, and so does each expert's of a mixture of experts (whose router every rank holds
whole, so all route alike). q|k|v and gate|up are column-parallel (rows of the weight), o and down
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

    @property
    def num_kv_heads(self) -> int:
        return self.kv_end - self.kv_begin

    @property
    def num_heads(self) -> int:
        return self.q_end - self.q_begin

    def share(self, size: int) -> slice:
        """This rank's part of an MLP's intermediate dimension of `size`."""
        return slice(self.rank * size // self.world, (self.rank + 1) * size // self.world)


def split_model(num_heads: int, num_kv_heads: int, intermediate: int, world: int) -> list[TPShard]:
    """Every rank's share; ValueError, naming the numbers, where the heads cannot split.
    `intermediate`: the narrowest MLP's (each splits by `TPShard.share`)."""
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
        shards.append(TPShard(r, world, kv0, kv1, q0, q1))
    return shards


def shard_state(state: dict[str, torch.Tensor], shard: TPShard, head_dim: int, whole_qk_norm: bool = False) -> None:
    """Cut `state` (Hugging Face names) in place down to `shard`'s rows and columns, as views.
    `whole_qk_norm`: the q and k norms' weights span every head (arch.whole_qk_norm), so
    each rank keeps its heads' part, as it does of a weight for each head [H, D]
    (arch.qk_layer_norm); a weight that every head shares is every rank's whole."""
    D = head_dim
    q, kv = slice(shard.q_begin * D, shard.q_end * D), slice(shard.kv_begin * D, shard.kv_end * D)
    rows = {"q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": None, "up_proj": None}
    if whole_qk_norm:
        rows |= {"q_norm": q, "k_norm": kv}
    cols = {"o_proj": q, "down_proj": None}
    # An MLP's cut (None above) is the rank's share of its own intermediate size: a dense
    # MLP's, each expert's and a shared expert's may all differ.
    for key in [k for k in state if k.startswith("model.layers.")]:
        *_, name, kind = key.rsplit(".", 2)
        if kind == "sinks":  # one per query head (GPT-OSS)
            state[key] = state[key][shard.q_begin:shard.q_end]
        elif name in ("q_norm", "k_norm") and state[key].dim() == 2:  # [H, D]: a weight for each head
            heads = slice(shard.q_begin, shard.q_end) if name == "q_norm" else slice(shard.kv_begin, shard.kv_end)
            state[key] = state[key][heads]
        elif name in rows and kind in ("weight", "bias"):
            cut = rows[name] or shard.share(state[key].shape[0])
            state[key] = state[key][cut]
        elif name in cols and kind == "weight":
            cut = cols[name] or shard.share(state[key].shape[1])
            state[key] = state[key][:, cut]
        elif name in cols and shard.rank:
            del state[key]  # the bias: added once, by rank 0
    if shard.rank:
        state.pop("lm_head.weight", None)


def split_for(config, hf_config) -> list[TPShard]:
    """Every rank's share of the model (one rank: the whole), from its config alone."""
    from ..model.arch import geometry

    c = hf_config
    heads, kv_heads, _ = geometry(c)
    widths = (getattr(c, "intermediate_size", 0), getattr(c, "moe_intermediate_size", 0), getattr(c, "shared_expert_intermediate_size", 0),
              getattr(c, "shared_intermediate_size", 0), getattr(c, "intermediate_size_mlp", 0))
    return split_model(heads, kv_heads, min(w for w in widths if w), config.tensor_parallel_size)


def load_rank(config, hf_config, dtype: torch.dtype, max_model_len: int, shard: TPShard):
    """`shard`'s model: the checkpoint's weights cut down to its rows and columns, a layer at
    a time, before any is cast or copied (`weights.Weights`): a rank holds its own part of
    the model, not every rank's."""
    from ..model import LlamaModel
    from ..model.arch import architecture, geometry
    from ..model.names import to_llama_names
    from ..model.weights import Weights, mapped_storages, read_groups

    state = Weights(dtype, config.device)
    for group in read_groups(config.model_dir):
        mapped = mapped_storages(group)
        to_llama_names(group, hf_config, dtype)
        shard_state(group, shard, geometry(hf_config)[2], architecture(hf_config).whole_qk_norm)
        state.add(group, mapped)
    return LlamaModel(hf_config, state, dtype, max_model_len, config.device, shard=shard)
