"""Penalties and logit bias: a sequence's logits adjusted for what it has said, before the
sampler picks its token, with OpenAI's, vLLM's and transformers' meanings:

- `logit_bias[t]` is added to token t's logit (OpenAI: -100 all but bans it, 100 all but
  forces it).
- `repetition_penalty` r (CTRL's, as vLLM and transformers apply it): a token of the prompt
  or of the output so far has its logit divided by r when positive, multiplied by r when
  not. r > 1 discourages repeats, r < 1 encourages them.
- `frequency_penalty` f and `presence_penalty` p (OpenAI's): a token the output has used
  c > 0 times loses c * f + p. The prompt does not count, as in OpenAI and vLLM.

They apply in that order (vLLM's: the bias is a logits processor, the penalties come
after), on greedy rows too. A row's adjustment depends on its own tokens alone, which the
sequence keeps through a preemption, so a recomputed sequence continues exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .device import to_device


@dataclass(eq=False)
class Penalties:
    """One sequence's penalties. `token_ids` is the sequence's own list (prompt, then
    output), read every step as it grows; the tokens it has seen are tallied as they come,
    so a step's cost does not grow with the length of the text."""

    token_ids: list[int]
    num_prompt_tokens: int
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        distinct = list(dict.fromkeys(self.token_ids[:self.num_prompt_tokens]))
        self._where = {t: i for i, t in enumerate(distinct)}  # id -> its index in _ids
        self._ids = np.array(distinct, dtype=np.int64)  # each id seen, prompt's first
        self._counts = np.zeros(len(distinct), dtype=np.float32)  # its count in the output
        self._tallied = self.num_prompt_tokens  # tokens of token_ids tallied so far

    def seen(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, output counts) of every distinct token of the prompt and the output."""
        for t in self.token_ids[self._tallied:]:
            i = self._where.get(t)
            if i is None:
                i = self._where[t] = len(self._where)
                if i == len(self._ids):  # full: double
                    self._ids = np.concatenate([self._ids, np.empty(max(i, 16), dtype=np.int64)])
                    self._counts = np.concatenate([self._counts, np.zeros(max(i, 16), dtype=np.float32)])
                self._ids[i] = t
            self._counts[i] += 1
        self._tallied = len(self.token_ids)
        n = len(self._where)
        return self._ids[:n], self._counts[:n]


def penalties_of(params, token_ids: list[int], num_prompt_tokens: int) -> Penalties | None:
    """The penalties a request's `SamplingParams` ask of one sequence; None when none."""
    if not params.penalized:
        return None
    return Penalties(token_ids, num_prompt_tokens, params.presence_penalty, params.frequency_penalty,
                     params.repetition_penalty, dict(params.logit_bias))


def penalize_(out: torch.Tensor, rows: list[Penalties]) -> torch.Tensor:
    """`out` [P, V] (float32), row j adjusted by `rows[j]`, in place.

    Only the tokens a row has seen change, so the work is over those tokens, not the
    vocabulary: each row's distinct seen ids (prompt and output) with their output counts,
    their logits gathered, adjusted and written back. An id written twice gets the same
    value both times, which is why the padding may repeat a row's first id."""
    device = out.device
    biased = [(j, t, b) for j, r in enumerate(rows) for t, b in r.logit_bias.items()]
    if biased:
        at, ids, bias = zip(*biased)
        out.index_put_((to_device(device, list(at)), to_device(device, list(ids))),
                       to_device(device, list(bias)).to(out.dtype), accumulate=True)
    if all(r.repetition == 1.0 and not r.presence and not r.frequency for r in rows):
        return out
    seen = [r.seen() for r in rows]
    # Rows padded to one width with copies of their first id and its count.
    ids = np.empty((len(rows), max(len(i) for i, _ in seen)), dtype=np.int64)
    counts = np.empty(ids.shape, dtype=np.float32)
    for j, (i, c) in enumerate(seen):
        ids[j, :len(i)], ids[j, len(i):] = i, i[0]
        counts[j, :len(c)], counts[j, len(c):] = c, c[0]
    ids = to_device(device, torch.from_numpy(ids))
    counts = to_device(device, torch.from_numpy(counts)).to(out.dtype)
    per_row = to_device(device, [[float(r.repetition), float(r.frequency), float(r.presence)] for r in rows])
    rep, freq, pres = per_row.to(out.dtype).unsqueeze(2).unbind(1)
    value = out.gather(1, ids)
    value = torch.where(value > 0, value / rep, value * rep)
    value = value - counts * freq - (counts > 0).to(out.dtype) * pres
    return out.scatter_(1, ids, value)
