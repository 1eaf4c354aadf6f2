"""Turns one scheduled step into model inputs, runs the model, returns the logits rows that
will be sampled.

Rows are laid out decodes first (sorted by context length, so the torch path groups them
into tightly padded batches), then prefill chunks; the caller never sees this order: logits
come back in the order of the sequences it passed. Only rows that will be sampled go
through the LM head, and past the last layer's K/V write only they are computed.

On a GPU the logits stay on the device (the sampler copies only the chosen ids back), the
step's index tensors cross in one pinned copy, and a step of decodes alone replays a
CUDA graph (`decode_graphs`) when the Triton backend runs.
"""

from __future__ import annotations

import numpy as np
import torch

from pdserve.arith import ceil_div

from ..attention import cpu_ops
from ..lora import row_groups
from .decode_graphs import DecodeGraphs
from .llama import LlamaModel, StepAttention
from .rope import rope_index


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: torch.Tensor, page_size: int, attention_backend: str = "torch",
                 device="cpu", max_batch: int = 0, max_model_len: int = 0, cuda_graphs: bool = True):
        self.model = model
        self.kv_cache = kv_cache
        self.page_size = page_size
        self.device = torch.device(device)
        self.backend = attention_backend
        if attention_backend == "triton":
            from ..attention import triton_ops

            self.ops = triton_ops
        else:
            self.ops = cpu_ops
        self.on_gpu = self.device.type == "cuda"
        self.graphs = None
        # A mixture of experts reads how many tokens each expert got on the host, which a
        # graph cannot: its steps run eagerly.
        if self.on_gpu and cuda_graphs and attention_backend == "triton" and max_batch > 0 and model.moe is None:
            self.graphs = DecodeGraphs(model, kv_cache, page_size, max_batch, max_model_len)

    @torch.inference_mode()
    def run(self, seqs, num_new: list[int], wants_logits: list[int], layer_hook=None) -> torch.Tensor:
        """Compute KV for positions [num_computed, num_computed + num_new) of each sequence
        (pages must already cover them); logits of the last wants_logits[j] (0, 1 or, for a
        prompt's logprobs, up to num_new[j]) new positions of each sequence j, in the order
        given: [sum(wants_logits), V]."""
        if self.on_gpu and self.backend == "triton":
            return self._run_gpu(seqs, num_new, wants_logits, layer_hook)
        ps = self.page_size
        # Decodes, then prefills; each by its LoRA adapter (its rows one run: engine/lora.py),
        # then by context length; on every tensor-parallel rank alike, as the all-reduces
        # sum their rows.
        lora = [seq.request.lora for seq in seqs] if self.model.adapters else [-1] * len(seqs)
        order = sorted(range(len(seqs)), key=lambda j: (num_new[j] != 1, lora[j], seqs[j].num_computed + num_new[j]))
        input_ids, positions, slots = [], [], []
        query_lens, seq_lens, page_lists = [], [], []
        last_row = [0] * len(seqs)
        for j in order:
            seq, n = seqs[j], num_new[j]
            begin, end = seq.num_computed, seq.num_computed + n
            pages = seq.pages
            input_ids.extend(seq.token_ids[begin:end])
            positions.extend(range(begin, end))
            slots.extend(pages[p // ps] * ps + p % ps for p in range(begin, end))
            query_lens.append(n)
            seq_lens.append(end)
            page_lists.append(pages)
            last_row[j] = len(input_ids) - 1
        dev = self.device
        ids_t = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        pos_t = torch.tensor(positions, dtype=torch.int64, device=dev)
        slot_t = torch.tensor(slots, dtype=torch.int64, device=dev)
        step = StepAttention(slot_t, self.ops.store_kv, self._attend_fn(query_lens, seq_lens, page_lists))
        step.rope_positions = self._rope_rows(seqs, order, num_new, positions)
        # A window no context of the step outgrows masks nothing: the sliding layers attend as the others.
        window = self.model.window if self.model.window and max(seq_lens) > self.model.window else 0
        if window:
            step.attend_window = self._attend_fn(query_lens, seq_lens, page_lists, window)
        if layer_hook is not None:
            step.layer_hook = layer_hook
        kept = [j for j in range(len(seqs)) if wants_logits[j]]
        rows = torch.tensor(_rows(last_row, wants_logits, kept), dtype=torch.int64, device=dev)
        if len(kept) < len(input_ids) and len(rows) == len(kept):
            step.keep = rows
            if kept:  # each kept row is the last query of its sequence: a decode's shape
                kept_shape = ([1] * len(kept), [seqs[j].num_computed + num_new[j] for j in kept],
                              [seqs[j].pages for j in kept])
                step.attend_kept = self._attend_fn(*kept_shape)
                if window:
                    step.attend_kept_window = self._attend_fn(*kept_shape, window)
        self._lora(step, seqs, num_new, order, rows.numpy())
        hidden = self.model.forward(ids_t, pos_t, self.kv_cache, step)
        if not kept:
            return torch.empty(0, self.model.vocab_size)
        picked = hidden if step.keep is not None else hidden.index_select(0, rows)
        return self.model.logits(picked)

    def _run_gpu(self, seqs, num_new, wants_logits, layer_hook) -> torch.Tensor:
        # A graph runs the base model alone: a step with a LoRA adapter's rows runs eagerly.
        decodes_only = (layer_hook is None and all(n == 1 for n in num_new) and all(wants_logits)
                        and not (self.model.adapters and any(seq.request.lora >= 0 for seq in seqs)))
        if self.graphs is not None and decodes_only and len(seqs) <= self.graphs.max_batch:
            return self.graphs.run(seqs)
        ps, total = self.page_size, sum(num_new)
        ids, positions, slots = (np.empty(total, dtype=np.int64) for _ in range(3))
        query_lens, seq_lens, page_lists, last_row = [], [], [], []
        at = 0
        for seq, n in zip(seqs, num_new):
            begin, end = seq.num_computed, seq.num_computed + n
            pos = np.arange(begin, end)
            pages = np.asarray(seq.pages[:ceil_div(end, ps)], dtype=np.int64)
            ids[at:at + n] = seq.token_ids[begin:end]
            positions[at:at + n] = pos
            slots[at:at + n] = pages[pos // ps] * ps + pos % ps
            query_lens.append(n)
            seq_lens.append(end)
            page_lists.append(pages)
            at += n
            last_row.append(at - 1)
        kept = [j for j in range(len(seqs)) if wants_logits[j]]
        rows = np.asarray(_rows(last_row, wants_logits, kept), dtype=np.int64)
        attention = self._attention_inputs(query_lens, seq_lens, page_lists)
        kept_attention = self._attention_inputs(
            [1] * len(kept), [seq_lens[j] for j in kept], [page_lists[j] for j in kept]) if kept else []
        rope_rows = self._rope_rows(seqs, range(len(seqs)), num_new, positions)
        rope = [] if rope_rows is None else [rope_rows]
        ids_t, pos_t, slot_t, rows_t, *dev = pinned_inputs(
            [ids, positions, slots, rows, *rope, *attention, *kept_attention], self.device)
        rope_t, dev = (dev[0], dev[1:]) if rope else (None, dev)
        step = StepAttention(slot_t, self.ops.store_kv, self._device_attend(dev[:3], max(query_lens)), rope_positions=rope_t)
        window = self.model.window  # the kernel masks it: no separate plan to build
        if window:
            step.attend_window = self._device_attend(dev[:3], max(query_lens), window)
        if layer_hook is not None:
            step.layer_hook = layer_hook
        if len(kept) < total and len(rows) == len(kept):
            step.keep = rows_t
            if kept:
                step.attend_kept = self._device_attend(dev[3:], 1)
                if window:
                    step.attend_kept_window = self._device_attend(dev[3:], 1, window)
        self._lora(step, seqs, num_new, range(len(seqs)), rows)
        hidden = self.model.forward(ids_t, pos_t, self.kv_cache, step)
        if not kept:
            return torch.empty(0, self.model.vocab_size, device=self.device)
        return self.model.logits(hidden if step.keep is not None else hidden.index_select(0, rows_t))

    def _rope_rows(self, seqs, order, num_new, positions):
        """The rotary tables' row of each of the step's positions (`order`: the sequences'
        order in them): None where the tables have one half (no LongRoPE past its original
        context); a tensor on the CPU path, an array on the GPU's (it goes with the others)."""
        if not self.model.long_rope_from:
            return None
        long = np.repeat([seqs[j].long_rope for j in order], [num_new[j] for j in order])
        rows = rope_index(np.asarray(positions, dtype=np.int64), self.model.max_positions, long)
        return rows if self.on_gpu and self.backend == "triton" else torch.from_numpy(rows).to(self.device)

    def _lora(self, step: StepAttention, seqs, num_new, order, kept_rows: np.ndarray) -> None:
        """The step's LoRA rows (`order`: the sequences' order in the rows), if any has one."""
        if not self.model.adapters or all(seq.request.lora < 0 for seq in seqs):
            return
        of_row = np.repeat([seqs[j].request.lora for j in order], [num_new[j] for j in order])
        step.lora = row_groups(of_row, self.model.adapters, self.device)
        if step.keep is not None:
            step.lora_kept = row_groups(of_row[kept_rows], self.model.adapters, self.device)

    def _attention_inputs(self, query_lens, seq_lens, page_lists) -> list[np.ndarray]:
        """Block tables, query start offsets and context lengths, as host arrays."""
        ps = self.page_size
        # A multiple of 16 always: Triton compiles a kernel per class of an integer argument
        # (1, a multiple of 16, other), and warm-up cannot foresee every class a prompt hits.
        width = 16 * ceil_div(max(ceil_div(n, ps) for n in seq_lens), 16)
        tables = np.zeros((len(seq_lens), width), dtype=np.int64)
        for b, (pages, n) in enumerate(zip(page_lists, seq_lens)):
            used = ceil_div(n, ps)
            tables[b, :used] = pages[:used]
        starts = np.zeros(len(query_lens) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=starts[1:])
        return [tables, starts, np.asarray(seq_lens, dtype=np.int64)]

    def _device_attend(self, tensors, max_query_len: int, window: int = 0):
        tables, starts, lens = tensors
        ps, softcap = self.page_size, self.model.attn_softcap
        return lambda q, k_cache, v_cache, scale, sinks=None: self.ops.paged_attention(
            q, k_cache, v_cache, tables, starts, lens, ps, scale, max_query_len=max_query_len, window=window,
            softcap=softcap, sinks=sinks)

    def _attend_fn(self, query_lens, seq_lens, page_lists, window: int = 0):
        ps = self.page_size
        if self.backend == "torch":
            plan = cpu_ops.plan_attention(query_lens, seq_lens, page_lists, ps, self.device, self.kv_cache.dtype,
                                          window, self.model.attn_softcap)
            return lambda q, k_cache, v_cache, scale, sinks=None: cpu_ops.attend(q, k_cache, v_cache, plan, scale, sinks)
        tensors = [torch.from_numpy(a).to(self.device) for a in self._attention_inputs(query_lens, seq_lens, page_lists)]
        return self._device_attend(tensors, max(query_lens), window)


def pinned_inputs(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """int64 device tensors of `arrays`, moved in one copy through pinned memory (one
    transfer instead of one synchronous copy from pageable memory per array)."""
    sizes = [a.size for a in arrays]
    host = torch.empty(sum(sizes), dtype=torch.int64, pin_memory=device.type == "cuda")
    flat = host.numpy()
    at = 0
    for a, n in zip(arrays, sizes):
        flat[at:at + n] = a.reshape(-1)
        at += n
    dev = host.to(device, non_blocking=True)
    out, at = [], 0
    for a, n in zip(arrays, sizes):
        out.append(dev[at:at + n].view(a.shape))
        at += n
    return out


def _rows(last_row: list[int], wants_logits: list[int], kept: list[int]) -> list[int]:
    """The batch rows whose logits sequence j wants: its last wants_logits[j] new positions.
    A step that wants more than each sequence's last row computes every row to the end."""
    return [r for j in kept for r in range(last_row[j] - wants_logits[j] + 1, last_row[j] + 1)]
