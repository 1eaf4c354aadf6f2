"""LoRA adapters served beside the base model (`--lora-modules NAME=DIR`), as vLLM serves
them: a request names one, and each of its rows adds the adapter's low-rank product to the
projections the adapter targets; rows of other adapters, or of none, share the step.

An adapter is a PEFT directory (adapter_config.json, adapter_model.safetensors) made for
this base model. Each target's delta is computed as PEFT computes it,
`lora_B(lora_A(x)) * scaling` added to the base projection's output, so greedy output
equals PEFT's on transformers. What PEFT can save but this does not run (DoRA, trained
biases, modules saved whole, per-module ranks, adapters of the embeddings or the LM
head) is refused when the adapter loads, naming it.

Requests of an adapter cache their prompt's pages under their own prefix-cache salt: the
same tokens under another adapter have other KV. Under tensor parallelism each rank holds
its share of every adapter (`_rank_share`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

# PEFT's target module -> (our fused projection, which of its parts: an index into `parts`)
_TARGETS = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "qkv_proj": ("qkv", None),
            "o_proj": ("o", None), "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1),
            "gate_up_proj": ("gate_up", None), "down_proj": ("down", None)}
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# adapter_config.json settings this does not run, with the values that mean "not used"
_UNUSED = {"use_dora": (False, None), "bias": ("none", None), "lora_bias": (False, None),
           "modules_to_save": (None, []), "rank_pattern": ({}, None), "alpha_pattern": ({}, None),
           "layer_replication": (None,), "target_parameters": (None, []),
           "trainable_token_indices": (None,), "use_qalora": (False, None),
           "alora_invocation_tokens": (None,), "fan_in_fan_out": (False, None)}


class LoraError(ValueError):
    pass


@dataclass
class LoraAdapter:
    name: str
    path: str
    rank: int
    scale: float  # applied after B (1: none, or folded into B: a power of two)
    # (layer, projection) -> [(A [r, in], B [out part, r], first column, end column)]
    deltas: dict[tuple[int, str], list] = field(default_factory=dict)


def parse_modules(entries) -> list[tuple[str, str]]:
    """[(name, dir)] of `--lora-modules NAME=DIR ...`; LoraError naming a malformed entry."""
    pairs = []
    for entry in entries:
        name, eq, path = str(entry).partition("=")
        if not eq or not name.strip() or not path.strip():
            raise LoraError(f"lora_modules entry {entry!r} is not NAME=DIR")
        if name in (n for n, _ in pairs):
            raise LoraError(f"lora_modules names {name!r} twice")
        pairs.append((name.strip(), path.strip()))
    return pairs


def read_config(name: str, path: str) -> dict:
    """The adapter's adapter_config.json, checked for what this runs."""
    config_file = Path(path) / "adapter_config.json"
    if not config_file.is_file():
        raise LoraError(f"LoRA adapter {name!r}: {config_file} does not exist (a PEFT adapter "
                        f"directory holds adapter_config.json and adapter_model.safetensors)")
    config = json.loads(config_file.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"LoRA adapter {name!r}: peft_type {config.get('peft_type')!r} is not LORA")
    if config.get("target_parameters"):  # PEFT's LoRA of weights that are no Linear: a MoE's experts
        raise LoraError(f"LoRA adapter {name!r}: target_parameters {config['target_parameters']!r:.80} (an "
                        f"adapter of a mixture of experts' expert weights) is not supported; serve an adapter "
                        f"of the attention projections (q, k, v, o) alone")
    for key, neutral in _UNUSED.items():
        if key in config and config[key] not in neutral:
            raise LoraError(f"LoRA adapter {name!r}: {key} {config[key]!r:.80} is not supported "
                            f"(only plain LoRA on the attention and MLP projections)")
    return config


def load_adapter(name: str, path: str, hf_config, sizes: dict[str, list[int]], dtype: torch.dtype,
                 device="cpu", shard=None, head_dim: int = 0, reorder=None) -> LoraAdapter:
    """Adapter `name` from PEFT directory `path`, for a base model whose fused projections
    have output parts `sizes` ({"qkv": [q, k, v], "o": [hidden], ...}, the whole model's), or
    for a tensor-parallel rank's share of it (`shard`: engine/tp/shard.py, None for the whole;
    its heads of `head_dim`). `reorder`: how the model reordered q's and k's rows at load
    (LlamaModel.reorder_qk), done to the adapter's B too."""
    from safetensors import safe_open

    config = read_config(name, path)
    weights = Path(path) / "adapter_model.safetensors"
    if not weights.is_file():
        raise LoraError(f"LoRA adapter {name!r}: {weights} does not exist (adapter_model.bin is "
                        f"not read: save the adapter with safetensors)")
    rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(str(weights), framework="pt", device="cpu") as f:
        for key in sorted(f.keys()):
            m = _KEY.match(key)
            if m is None or m.group(2) not in _TARGETS or int(m.group(1)) >= hf_config.num_hidden_layers:
                raise LoraError(f"LoRA adapter {name!r}: weight {key!r} is not a LoRA of an attention or "
                                f"MLP projection of this model's layers")
            # A copy, not a view of the file's memory map, which an adapter saved again in place
            # would change (or, truncated, make fault) under the node serving it.
            pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = f.get_tensor(key).to(
                device=device, dtype=dtype, copy=True)
    # A power of two scales every product and partial sum exactly, so it can go into B once
    # (a step saves a multiply per target); any other scaling is applied after, as PEFT does.
    folded = math.frexp(scale)[0] == 0.5
    adapter = LoraAdapter(name, path, rank, 1.0 if folded else scale)
    for (layer, module), ab in sorted(pairs.items()):
        projection, part = _TARGETS[module]
        if projection == "gate_up" and len(sizes.get("gate_up", ())) == 1:  # an ungated MLP: up alone
            if module != "up_proj":
                raise LoraError(f"LoRA adapter {name!r}: layer {layer} {module} is not a projection of this "
                                f"model, whose MLPs have no gate (up_proj and down_proj)")
            part = 0
        if projection not in sizes:
            raise LoraError(f"LoRA adapter {name!r}: layer {layer} {module} is an MLP projection, and this "
                            f"model's MLPs are mixtures of experts, which adapters are not run on here; "
                            f"serve an adapter of the attention projections (q, k, v, o) alone")
        edges = np.cumsum([0, *sizes[projection]])
        lo, hi = (edges[0], edges[-1]) if part is None else (edges[part], edges[part + 1])
        A, B = ab.get("A"), ab.get("B")
        if A is None or B is None or A.shape[0] != rank or B.shape != (hi - lo, rank):
            got = "missing" if A is None or B is None else f"A {tuple(A.shape)}, B {tuple(B.shape)}"
            raise LoraError(f"LoRA adapter {name!r}: layer {layer} {module} does not fit this model "
                            f"(rank {rank}, {hi - lo} outputs; got {got}): it was made for another base model")
        if module in ("q_proj", "k_proj") and reorder is not None:  # its rows as the model's (arch.rope_order)
            B = reorder(B)
        elif module == "qkv_proj" and reorder is not None:  # Phi-4-mini's fused q|k|v: its q and k parts
            q, kv = sizes["qkv"][0], sizes["qkv"][1]
            B = torch.cat([reorder(B[:q]), reorder(B[q:q + kv]), B[q + kv:]])
        target = (A, B * scale if folded else B, int(lo), int(hi))
        if shard is not None and shard.world > 1:
            target = _rank_share(target, projection, sizes, shard, head_dim)
        adapter.deltas.setdefault((layer, projection), []).append(target)
    return adapter


def _rank_share(target, projection: str, sizes: dict[str, list[int]], shard, D: int) -> tuple:
    """A target of the whole model cut to a rank's share, as its projection is cut
    (engine/tp/shard.py): a column-parallel one's B keeps the rank's output rows, a
    row-parallel one's A the rank's input columns (the layer's all-reduce sums the ranks'
    deltas, as it sums their outputs)."""
    A, B, lo, hi = target
    q_size, kv_size = sizes["qkv"][0], sizes["qkv"][1]
    inter = sizes.get("gate_up", [0])[0]  # 0: no MLP adapters (a mixture of experts)
    q = np.arange(shard.q_begin * D, shard.q_end * D)
    mine = np.arange(inter)[shard.share(inter)]  # the rank's part of the MLP's intermediate dimension
    if projection in ("o", "down"):
        cols = torch.from_numpy(q if projection == "o" else mine).to(A.device)
        return A[:, cols].contiguous(), B, lo, hi
    # The whole projection's rows this rank holds, in the rank's order (q | k | v, or gate | up).
    if projection == "qkv":
        kv = np.arange(shard.kv_begin * D, shard.kv_end * D)
        held = np.concatenate([q, q_size + kv, q_size + kv_size + kv])
    else:
        held = np.concatenate([mine, inter + mine])
    inside = np.flatnonzero((held >= lo) & (held < hi))  # one run: the target's parts are adjacent
    rows = torch.from_numpy(held[inside] - lo).to(B.device)
    return A, B[rows].contiguous(), int(inside[0]), int(inside[-1]) + 1


class Adapters:
    """The engine's adapters by name; requests name them, rows carry their index."""

    def __init__(self, adapters: list[LoraAdapter]):
        self.all = adapters
        self._index = {a.name: i for i, a in enumerate(adapters)}

    def index(self, name: str) -> int:
        """The adapter's index, -1 for "" (the base model); ValueError for an unknown name."""
        if not name:
            return -1
        if name not in self._index:
            have = ", ".join(self._index) or "none (start the server with --lora-modules NAME=DIR)"
            raise ValueError(f"lora {name!r} is not an adapter of this engine; it has: {have}")
        return self._index[name]


def row_groups(adapter_of_row: np.ndarray, adapters: list[LoraAdapter], device) -> list | None:
    """[(adapter, rows)] of a step's rows, from each row's adapter index (-1: none); None
    when no row has one. `rows`: None for every row; a slice where the adapters' rows lie
    in few runs (the runner orders them so: a view costs no copy); else an int64 tensor."""
    used = np.unique(adapter_of_row)
    used = used[used >= 0]
    if not len(used):
        return None
    if len(used) == 1 and (adapter_of_row == used[0]).all():
        return [(adapters[used[0]], None)]
    starts = np.flatnonzero(np.diff(adapter_of_row, prepend=-2))  # where each run begins
    if len(starts) <= 2 * len(used) + 1:
        ends = [*starts[1:], len(adapter_of_row)]
        return [(adapters[adapter_of_row[b]], slice(int(b), int(e))) for b, e in zip(starts, ends)
                if adapter_of_row[b] >= 0]
    return [(adapters[a], torch.from_numpy(np.flatnonzero(adapter_of_row == a)).to(device)) for a in used]


def add_deltas(out: torch.Tensor, x: torch.Tensor, layer: int, projection: str, groups: list) -> None:
    """out[rows] += lora_B(lora_A(x[rows])) * scaling for each adapter's rows (in place).
    Each target is its own two products, as PEFT runs them: stacking q's, k's and v's A
    into one product would round some sums otherwise, and greedy output would drift from PEFT's."""
    for adapter, rows in groups:
        targets = adapter.deltas.get((layer, projection), ())
        if rows is None or isinstance(rows, slice):
            xs = x if rows is None else x[rows]
        elif targets:
            xs = x.index_select(0, rows)  # once for q, k and v
        for A, B, lo, hi in targets:
            delta = F.linear(F.linear(xs, A), B)
            if adapter.scale != 1:
                delta.mul_(adapter.scale)
            if rows is None:
                out[:, lo:hi] += delta
            elif isinstance(rows, slice):
                out[rows, lo:hi] += delta
            else:
                out[:, lo:hi].index_add_(0, rows, delta)


def load_adapters(entries, model, hf_config, dtype: torch.dtype, device, shard=None) -> Adapters:
    """The adapters of `--lora-modules` entries (NAME=DIR), loaded for `model` (a
    tensor-parallel rank's: `shard`), which its rows then reach (`model.adapters`)."""
    adapters = Adapters([load_adapter(name, path, hf_config, model.lora_sizes(), dtype, device, shard, model.head_dim,
                                      model.reorder_qk) for name, path in parse_modules(entries)])
    model.adapters = adapters.all
    return adapters
