"""Decode steps replayed as CUDA graphs, one graph per batch-size bucket.

Why: a decode step of a 16-layer model is ~150 kernels of a few microseconds each; launched
one by one from Python the host, not the GPU, sets the pace. Captured once, a step is
one replay (as vLLM and nano-vllm do).

How: every graph reads its inputs from one device buffer at fixed addresses and writes its
logits into the first rows of one shared buffer (one tensor per graph would hold
sum(buckets) x vocab floats: 16 GiB at 1024 sequences and a 128k vocabulary). A step
fills a pinned host buffer with the batch's token ids, positions, rotary table rows, slots,
context lengths and block tables, copies it to the device in one transfer and replays the
graph of the smallest bucket that holds the batch. Rows past the batch are padding: slot -1 (the KV
store skips it), context length 1, page 0.

Invariants:
- Nothing a graph runs reads a tensor's values on the host (attention is given
  `max_query_len=1`), so capture never synchronises and a replay never waits.
- Graphs are captured at construction, on the engine's thread, before any other thread
  uses the device (`capture_error_mode="thread_local"` all the same), and share one
  memory pool: they replay one at a time.
- The host buffer and the logits rows are rewritten only after the previous step's
  logits were read (the sampler copies the chosen ids to the host every step), so no copy
  is in flight then and no reader is left.
"""

from __future__ import annotations

import numpy as np
import torch

from pdserve.arith import ceil_div

from ..attention import triton_ops
from .llama import LlamaModel, StepAttention
from .rope import rope_index

# Batch sizes with a graph: small ones exactly, then every 16 (a batch of 17 runs the
# graph of 32, so at most 15 padding rows).
_SMALL = (1, 2, 4, 8)
_STRIDE = 16
# token id, position, rotary table row (rope.rope_index), slot, context length; then the block table row
_FIELDS = 5


def bucket_sizes(max_batch: int) -> list[int]:
    sizes = [b for b in _SMALL if b < max_batch]
    sizes += list(range(_STRIDE, max_batch, _STRIDE))
    return sizes + [max_batch]


class DecodeGraphs:
    def __init__(self, model: LlamaModel, kv_cache: torch.Tensor, page_size: int, max_batch: int,
                 max_model_len: int, capture: bool = True):
        """`capture=False` runs the same static-buffer forward eagerly, without graphs: the
        tests check the buffers' layout and padding that way on a CPU."""
        self.model, self.kv_cache, self.page_size = model, kv_cache, page_size
        self.device = kv_cache.device
        self.width = ceil_div(max_model_len, page_size)  # block table entries per row
        self.sizes = bucket_sizes(max_batch)
        self.max_batch = max_batch
        n = max_batch * (_FIELDS + self.width)
        self.host = torch.zeros(n, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        self.host_np = self.host.numpy()
        self.inputs = torch.zeros(n, dtype=torch.int64, device=self.device)
        self.query_start = torch.arange(max_batch + 1, dtype=torch.int32, device=self.device)
        self.logits = torch.empty(max_batch, model.vocab_size, dtype=torch.float32, device=self.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._rows: list = []  # per row of the host buffer: (pages list, entries) it holds
        self._rows_bucket = 0
        self.captured = capture
        if capture:
            self._capture()

    def _views(self, b: int):
        """(ids, positions, rotary rows, slots, seq_lens, block_tables) of the bucket of size b."""
        x = self.inputs
        ids, pos, rope, slots, lens = (x[i * b:(i + 1) * b] for i in range(_FIELDS))
        return ids, pos, rope, slots, lens, x[_FIELDS * b:(_FIELDS + self.width) * b].view(b, self.width)

    def _forward(self, b: int) -> torch.Tensor:
        ids, pos, rope, slots, lens, tables = self._views(b)
        ps, qsl = self.page_size, self.query_start[:b + 1]
        softcap, window = self.model.attn_softcap, self.model.window  # the model's: constants of the graph

        def attend(q, k_cache, v_cache, scale, sinks=None, window=0):
            return triton_ops.paged_attention(q, k_cache, v_cache, tables, qsl, lens, ps, scale, max_query_len=1,
                                              window=window, softcap=softcap, sinks=sinks)

        step = StepAttention(slots, triton_ops.store_kv, attend, rope_positions=rope)
        if window:  # the sliding layers'
            step.attend_window = lambda q, k_cache, v_cache, scale, sinks=None: attend(q, k_cache, v_cache, scale,
                                                                                       sinks, window)
        hidden = self.model.forward(ids, pos, self.kv_cache, step)
        return self.model.logits(hidden, out=self.logits[:b])

    @torch.inference_mode()
    def _capture(self) -> None:
        with torch.cuda.device(self.device):  # capture and Triton use the current device
            pool = torch.cuda.graph_pool_handle()
            for b in reversed(self.sizes):  # largest first: the pool is sized once
                self._rows_bucket = 0  # the padding below overwrites table rows
                self._fill_padding(0, b)
                self._copy(b)
                self._forward(b)  # compiles the Triton kernels outside the capture
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    self._forward(b)
                self.graphs[b] = graph
            torch.cuda.synchronize(self.device)

    def bucket(self, n: int) -> int | None:
        """The smallest captured batch size >= n (None: no graph holds n rows)."""
        for b in self.sizes:
            if b >= n:
                return b
        return None

    def _fill_padding(self, start: int, b: int) -> None:
        h = self.host_np
        h[start:b] = 0  # token id
        h[b + start:2 * b] = 0  # position
        h[2 * b + start:3 * b] = 0  # rotary row
        h[3 * b + start:4 * b] = -1  # slot: nothing stored
        h[4 * b + start:5 * b] = 1  # context: one position, page 0 offset 0
        h[5 * b + start * self.width:5 * b + b * self.width:self.width] = 0

    def _copy(self, b: int) -> None:
        n = b * (_FIELDS + self.width)
        self.inputs[:n].copy_(self.host[:n], non_blocking=True)

    def run(self, seqs) -> torch.Tensor:
        """Logits [len(seqs), V] (float32, on the device) of one decode step: each sequence's
        position num_computed, whose page is already allocated."""
        n = len(seqs)
        b = self.bucket(n)
        h, ps, w = self.host_np, self.page_size, self.width
        if b != self._rows_bucket:
            self._rows, self._rows_bucket = [None] * b, b
        rows, base = self._rows, _FIELDS * b
        ids, positions, slots = [], [], []
        for i, seq in enumerate(seqs):
            p = seq.num_computed
            pages = seq.pages
            ids.append(seq.token_ids[p])
            positions.append(p)
            slots.append(pages[p // ps] * ps + p % ps)
            used = p // ps + 1
            # A row's table changes only when its sequence gains a page (every page_size
            # steps) or another sequence takes the row: rewrite it only then. Pages lists
            # are only ever extended; a preempted sequence gets a new list.
            row = rows[i]
            if row is None or row[0] is not pages or row[1] != used:
                h[base + i * w:base + i * w + used] = pages[:used]
                rows[i] = (pages, used)
        h[0:n] = ids
        h[b:b + n] = positions
        m = self.model
        h[2 * b:2 * b + n] = positions if not m.long_rope_from else rope_index(
            h[b:b + n], m.max_positions, np.array([seq.long_rope for seq in seqs]))
        h[3 * b:3 * b + n] = slots
        h[4 * b:4 * b + n] = positions
        h[4 * b:4 * b + n] += 1  # context length: the position's own token included
        if n < b:
            self._fill_padding(n, b)
            rows[n:b] = [None] * (b - n)
        self._copy(b)
        if not self.captured:
            return self._forward(b)[:n]
        self.graphs[b].replay()
        return self.logits[:n]
