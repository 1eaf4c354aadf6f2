"""`PanelWeight`: a weight packed for gemm.c, the CPU matmul of every linear layer.

Why: at decode batch sizes oneDNN's GEMM on its own packed weights ran at 55-75% of the
machine's peak on the dev machine (2 cores of an AMD EPYC, AVX-512 with BF16, no AMX),
and the decode step of SmolLM2-135M is mostly matmuls. gemm.c's one kernel (8 rows x 48
columns of sums in registers over all of K, panels split between threads, the next
panel prefetched) measured, per step of all 30 layers' weights (plus the LM head where
marked), cold as in the model, the best of 3-5 alternating runs:

| rows | float32 oneDNN -> gemm.c (ms) | bfloat16 oneDNN -> gemm.c (ms) |
| --- | --- | --- |
| 1, with the LM head, before the prefetch | 27.1 -> 21.7 | 14.2 -> 9.6 |
| 32, with the LM head, before the prefetch | 55.2 -> 44.4 | 28.3 -> 21.4 |
| 256 | 293 -> 278 | 145 -> 140 |
| 512 | 536 -> 531 | 270 -> 251 |
| 1024 | 1137 -> 1113 | 580 -> 563 |
| 1536, 1792 | 1502 -> 1492, 1754 -> 1744 | |
| 2048 | 2315 -> 2203, 2139 -> 2051, 2094 -> 2083 | 1118 -> 1099, 1309 -> 1292 |

Inside the engine (a decode step at batch 32, 256-token prompts, the two alternating twice),
the matmuls took 36.4 / 35.0 -> 25.1 / 24.6 ms a step in bfloat16 and 68.8 / 74.2 -> 56.8 /
53.9 in float32 (a noisy VM). Past 2048 rows gemm.c works in chunks of 2048 (one pass over
4096 rows measured 6% slower than oneDNN). So where it runs it replaces oneDNN, and the
weight is held once, in this layout.

On a CPU with AVX2 and FMA but no AVX-512 (2 cores of an AMD EPYC Zen 3: 190 GFLOP/s peak
float32, 23 GB/s read), gemm.c has a second kernel on the same panels: blocks of 6 rows take
a panel in thirds (6 x 16 sums in 12 registers), one or two rows take it whole. float32, all
30 layers' weights cold, against oneDNN, alternating, best of 4 (ms):

| rows | 1 | 8 | 32 | 64 | 2048 |
| --- | --- | --- | --- | --- | --- |
| oneDNN -> gemm.c | 22.8 -> 19.7 | 33.9 -> 33.0 | 62.2 -> 53.9 | 107.6 -> 96.1 | 2646 -> 2597 |

x is copied first into blocks of 6 rows interleaved, so a step's broadcasts read one line
(3-7% faster at 256-2048 rows than reading the six rows in place).

Later, on the same kind of machine but with its L3 and memory shared with busier tenants, a
tile wrote its sums with masked stores (`vmaskmovps`, microcoded on Zen 3) even where the
panel was whole, the copy of x went row by row (k apart), and rows came in chunks of 2048.
Plain stores for whole tiles, the copy written block by block in order, and chunks of 192
rows: the 30 layers' linears at 2048 rows, built both ways and alternating, best of 6, went
from 74-96 to 112-122 GFLOP/s; the prefill of the engine benchmark's uniform workload (32
prompts of 256 tokens, one output token each), the two trees alternating, from 29.3-30.6
and 25.8-26.7 s to 18.8-20.4 s (chunks of 2048 instead of 192: 18.6-22.6 s).

Then float32 from 3 rows took K in chunks of up to 256 steps, as BLIS does: a third of a
panel's chunk (16 KiB) stays in L1 while every block of rows runs past it, and the tiles of
later chunks resume from the sums already in `out` (the same multiply-adds in the same
order: bit for bit the same results). Over all of K at once every tile had read its third
of the panel (36-96 KiB) from L2 again. The 30 layers' linears, both builds alternating,
best of 4-6 (ms):

| rows | 3 | 4 | 8 | 16 | 32 | 64 | 192 | 512 | 2048 |
| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |
| whole K -> chunks | 54.5 -> 37.5 | 64.2 -> 37.9 | 60.2 -> 46.1 | 73.7 -> 54.7 | 101 -> 79 | 156 -> 112 | 383 -> 336 | 1024 -> 933 | 3989 -> 3870 |

One or two rows keep the whole-K tiles over the full panel width (38.4 and 39.2 ms against
42.8 and 44.5 in chunks). In the engine, the benchmark's long-mixed workload (fp32, the two
trees alternating): 90.0 / 83.7 s -> 84.6 / 78.7 s, its matmuls 62.4 / 58.4 -> 56.8 / 53.9 s;
its prefill alone level (47.4 / 51.1 -> 47.3 / 47.4 s): the gain is in decode.

Rows then came in ceil(rows / 6) blocks as even as they go (32 rows: 6, 6, 5, 5, 5, 5, where
five blocks of 6 had left one of 2 rows, whose tiles' 4 chains of sums a step leave the FMA
units half idle; the same sums, bit for bit). The 30 layers' linears and the LM head, best
of 5, two runs each: 8 rows 27.7 / 28.4 -> 26.8 / 26.5 ms, 32 rows 58.6 / 57.5 -> 54.7 /
55.3 (16 and 64 level); a decode step at batch 32 in `pdserve bench step`, its matmuls
58.4 / 56.1 -> 53.0 / 53.4 ms.

There oneDNN has no bfloat16 linear at all (its reorder needs AVX-512), and `F.linear` in
bfloat16 ran a prefill step's matmuls at ~25 GFLOP/s. The AVX2 kernel converts x to float32
once; up to 8 rows it splits each bfloat16 pair of the panel into two float32 vectors (a
shift, a mask) on every step, reading half the bytes (at 4 rows 24.3 ms against 30.0 for
converting the panel first); past 8 rows it converts each panel once into a float32 one and
runs the float32 tiles (the split on every step had run at ~60% of the float32 rate, 90
against 150 GFLOP/s at 2048 rows; now level with it). In `pdserve bench step --dtype bfloat16
--batch 16` a prefill step went from 17.8 s to 2.7 s, a decode step from 291 to 99 ms.

`PanelWeight.pack(weight)` is None where the kernel cannot run: neither AVX-512 nor AVX2 with
FMA; bfloat16 on an AVX-512 CPU without AVX512-BF16 (oneDNN's bfloat16 runs there), or with
AMX (oneDNN's tiles win there); an odd K in bfloat16; an empty weight; other dtypes or
devices; PDSERVE_NO_C_KERNELS. `Linear` then uses oneDNN or `F.linear`.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .. import native

_NR = 48  # output columns per panel, as in gemm.c
_SOURCE = Path(__file__).with_name("gemm.c")
_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_SIGNATURES = {"gemm_supported": []}
for _s in ("f32", "bf16"):
    _SIGNATURES[f"pack_{_s}"] = [_ptr, _i64, _i64, _ptr]
    _SIGNATURES[f"gemm_{_s}"] = [_ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr, _int]
_KINDS = {torch.float32: ("f32", 1), torch.bfloat16: ("bf16", 2)}  # suffix, gemm_supported bit


def _library() -> ctypes.CDLL | None:
    return native.load(_SOURCE, native.BASE_FLAGS, _SIGNATURES)


class PanelWeight:
    def __init__(self, lib: ctypes.CDLL, weight: torch.Tensor):
        suffix, _ = _KINDS[weight.dtype]
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        panels = -(-self.out_features // _NR)
        self.data = torch.empty(panels * _NR * self.in_features, dtype=weight.dtype)
        w = weight.contiguous()
        getattr(lib, f"pack_{suffix}")(w.data_ptr(), self.out_features, self.in_features, self.data.data_ptr())
        self._gemm = getattr(lib, f"gemm_{suffix}")

    @staticmethod
    def pack(weight: torch.Tensor) -> PanelWeight | None:
        kind = _KINDS.get(weight.dtype)
        if kind is None or weight.device.type != "cpu" or weight.dim() != 2:
            return None
        if (weight.dtype == torch.bfloat16 and weight.shape[1] % 2) or 0 in weight.shape:
            return None
        lib = _library()
        if lib is None or not lib.gemm_supported() & kind[1]:
            return None
        return PanelWeight(lib, weight)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., in_features] -> x @ W.T + bias, [..., out_features]; bias [out_features] of
        the weight's dtype."""
        if x.dtype != self.dtype or x.device.type != "cpu" or x.shape[-1] != self.in_features:
            raise ValueError(f"a {self.dtype} weight [{self.out_features}, {self.in_features}] cannot take "
                             f"a {x.dtype} input of shape {tuple(x.shape)} on {x.device}")
        flat = x.reshape(-1, self.in_features).contiguous()
        rows = flat.shape[0]
        out = torch.empty(rows, self.out_features, dtype=self.dtype)
        if rows:
            failed = self._gemm(flat.data_ptr(), rows, self.in_features, self.data.data_ptr(), self.out_features,
                                bias.data_ptr() if bias is not None else None, out.data_ptr(), torch.get_num_threads())
            if failed:
                raise MemoryError(f"gemm.c could not allocate float32 rows for a [{rows}, {self.in_features}] input")
        return out.view(*x.shape[:-1], self.out_features)
