"""Turns one step's logits into one token per row: greedy, temperature, top-k, top-p, min-p.

Invariants:
- A row's token depends only on its own logits, its own parameters and its own generator:
  the same seed gives the same tokens whatever else is in the batch. Each seeded row draws
  exactly one uniform per step from its own `torch.Generator` (inverse-CDF sampling).
- Temperature below `GREEDY_EPS` means greedy (argmax of the raw logits). When every row is
  greedy nothing but one argmax runs.
- Filters apply in this order: temperature, top-k (exactly k tokens, ties cut by rank),
  top-p (over the top-k survivors, renormalised), min-p (relative to the most likely
  token, which is the same before and after renormalisation). The most likely token
  always survives. Top-p without top-k needs a full sort of the vocabulary (as in vLLM);
  top-k alone needs only a partial top-k.
- Penalties and logit bias (engine/penalties.py), then bans (engine/bans.py), then a
  structured output's mask (engine/structured.py), adjust a copy of a row's logits first,
  greedy rows included; a step with no such row makes no copy.
- Logprobs are the log-softmax of the *unmodified* logits (before penalties, temperature
  and the filters), which is what vLLM reports by default ("raw logprobs"): they describe
  the model, not the sampling policy, so they are comparable across sampling settings.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .bans import Bans, ban_
from .device import to_device
from .penalties import Penalties, penalize_
from .structured import Constraint, mask_

GREEDY_EPS = 1e-5
# Top-p tries this many most likely tokens before sorting the whole vocabulary.
TOP_P_CANDIDATES = 256


@dataclass
class SamplingRow:
    """Sampling parameters of one row of the logits (one sequence of one request)."""

    temperature: float = 1.0
    top_k: int = -1  # -1 or 0: off
    top_p: float = 1.0  # 1.0: off
    min_p: float = 0.0  # 0.0: off
    generator: torch.Generator | None = None  # None: the global torch RNG
    num_logprobs: int | None = None  # None: no logprobs; 0: only the chosen token's
    penalties: Penalties | None = None  # None: its logits are sampled as they are
    constraint: Constraint | None = None  # None: any token may come next
    bans: Bans | None = None  # None: no token is banned (min_tokens, bad_words)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPS


@dataclass
class Sample:
    token_id: int
    logprob: float | None = None  # of token_id, when num_logprobs is not None
    top_logprobs: list[tuple[int, float]] | None = None  # most likely first
    rank: int | None = None  # a prompt token's: 1 + the tokens likelier than it


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> list[Sample]:
    """Choose one token per row of `logits` [B, V] (float32) under `rows[b]`."""
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits of shape {tuple(logits.shape)} for {len(rows)} rows")
    raw = logits = logits.float()
    if any(r.penalties is not None or r.constraint is not None or r.bans is not None for r in rows):
        logits = _adjusted(logits, rows)
    if all(r.is_greedy for r in rows):
        token_ids = logits.argmax(dim=-1)
    else:
        token_ids = _sample_mixed(logits, rows)
    return _with_logprobs(raw, token_ids, rows)


def _adjusted(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """A copy of `logits` with the penalised rows adjusted, banned tokens and what the
    constrained rows' structures refuse masked,
    each in one batched pass (the logprobs want the raw logits)."""
    members = [i for i, r in enumerate(rows) if r.penalties is not None]
    if len(members) == len(rows):
        out = penalize_(logits.clone(), [r.penalties for r in rows])
    else:
        out = logits.clone()
        if members:
            idx = to_device(logits.device, members)
            out[idx] = penalize_(logits[idx], [rows[i].penalties for i in members])
    if any(r.bans is not None for r in rows):
        ban_(out, [r.bans for r in rows])
    if any(r.constraint is not None for r in rows):
        mask_(out, [r.constraint for r in rows])
    return out


def _sample_mixed(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    token_ids = logits.argmax(dim=-1)
    # Rows are grouped by how their candidates are found, so each group costs one batched
    # op: all tokens (no top-k/top-p), a top-k (top-k set), or a full sort (top-p alone).
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        if not r.is_greedy:
            groups.setdefault(_candidate_kind(r, logits.shape[-1]), []).append(i)
    for kind, members in groups.items():
        idx = to_device(logits.device, members)
        token_ids[idx] = _sample_group(logits[idx], [rows[i] for i in members], kind)
    return token_ids


def _candidate_kind(row: SamplingRow, vocab: int) -> str:
    if 0 < row.top_k < vocab:
        return "top_k"
    return "sorted" if row.top_p < 1.0 else "all"


def _sample_group(logits: torch.Tensor, rows: list[SamplingRow], kind: str) -> torch.Tensor:
    device, vocab = logits.device, logits.shape[-1]
    temperature = to_device(device, [r.temperature for r in rows])
    scaled = logits / temperature.unsqueeze(1)

    ids = None  # candidate position -> token id; None: position is the token id
    if kind == "top_k":
        ks = [min(r.top_k, vocab) for r in rows]
        top_k = to_device(device, ks)
        scaled, ids = scaled.topk(max(ks), dim=-1)  # sorted, exactly k even on ties (k from the host)
        rank = torch.arange(scaled.shape[-1], device=device)
        scaled = scaled.masked_fill(rank >= top_k.unsqueeze(1), float("-inf"))
        return _sample_candidates(scaled, ids, rows, scaled.logsumexp(dim=-1, keepdim=True))
    if kind == "sorted":
        return _sample_top_p_only(scaled, rows)
    return _sample_candidates(scaled, None, rows, None)


def _sample_top_p_only(scaled: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Top-p without top-k. A full sort of the vocabulary is slow on CPU, and the nucleus
    of a trained model usually lies within its few hundred most likely tokens: try those
    first and sort fully only the rows whose nucleus reaches past them. Which way a row
    goes depends on that row alone, so seeded rows stay batch-independent."""
    device, vocab = scaled.device, scaled.shape[-1]
    log_total = scaled.logsumexp(dim=-1, keepdim=True)
    top_p = to_device(device, [r.top_p for r in rows])
    vals, ids = scaled.topk(min(vocab, TOP_P_CANDIDATES), dim=-1)
    covered = (vals - log_total).exp().sum(dim=-1) >= top_p
    out = torch.empty(len(rows), dtype=torch.long, device=device)
    for mask, full_sort in ((covered, False), (~covered, True)):
        sel = mask.nonzero().squeeze(1)
        if len(sel) == 0:
            continue
        sub_rows = [rows[i] for i in sel.tolist()]
        if full_sort:
            v, i = scaled[sel].sort(dim=-1, descending=True, stable=True)
        else:
            v, i = vals[sel], ids[sel]
        out[sel] = _sample_candidates(v, i, sub_rows, log_total[sel])
    return out


def _sample_candidates(
    scaled: torch.Tensor, ids: torch.Tensor | None, rows: list[SamplingRow], log_total
) -> torch.Tensor:
    """Sample among candidate logits `scaled` (sorted descending when `ids` is given;
    `ids` maps positions to token ids). `log_total` is the log-sum-exp over the whole
    (top-k-filtered) vocabulary, so top-p sees true probabilities."""
    device = scaled.device
    if ids is not None:
        top_p = to_device(device, [r.top_p for r in rows]).unsqueeze(1)
        probs = (scaled - log_total).exp()
        # Mass of the tokens strictly before this one: a token stays while that is < top_p,
        # so the most likely token always stays and the kept set is the smallest reaching
        # top_p.
        mass_before = probs.cumsum(dim=-1) - probs
        scaled = scaled.masked_fill(mass_before >= top_p, float("-inf"))

    # Unnormalised probabilities with the most likely token at exactly 1, so min-p is a
    # plain threshold.
    weights = (scaled - scaled.amax(dim=-1, keepdim=True)).exp_()
    if any(r.min_p > 0.0 for r in rows):
        min_p = to_device(device, [r.min_p for r in rows]).unsqueeze(1)
        weights = weights.masked_fill_(weights < min_p, 0.0)

    pos = _inverse_cdf(weights, _uniforms(rows, device))
    return pos if ids is None else ids.gather(1, pos.unsqueeze(1)).squeeze(1)


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index i with probability weights[i] / sum(weights), per row, from one uniform each.

    One uniform per row (not one per token) keeps both the cost and the generator's
    consumption independent of the vocabulary. A zero-weight index is never returned:
    searching right of u * total lands only where the cumulative sum strictly grows.
    """
    cdf = weights.cumsum(dim=-1)
    total = cdf[:, -1:]
    pos = torch.searchsorted(cdf, u.unsqueeze(1) * total, right=True).squeeze(1)
    # u * total can round up to total; the last index with weight is the first reaching it.
    last_with_weight = (cdf < total).sum(dim=-1)
    return torch.minimum(pos, last_with_weight)


def _uniforms(rows: list[SamplingRow], device: torch.device) -> torch.Tensor:
    """One uniform per row: a seeded row's from its own generator (a host one, as
    engine/intake.py makes them), the others' from the global RNG on `device`. The seeded
    draws cross to the device in one copy that does not wait (`to_device`), not one copy a row."""
    if all(r.generator is None for r in rows):
        return torch.rand(len(rows), device=device)
    drawn = to_device(device, [-1.0 if r.generator is None else  # -1: none drawn, take the global one
                               torch.rand((), generator=r.generator, device=r.generator.device).item()
                               for r in rows])
    return torch.where(drawn >= 0, drawn, torch.rand(len(rows), device=device))


def _with_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, rows: list[SamplingRow], ranks: bool = False
) -> list[Sample]:
    chosen = token_ids.tolist()
    samples = [Sample(token_id=t) for t in chosen]
    wanted = [i for i, r in enumerate(rows) if r.num_logprobs is not None]
    if not wanted:
        return samples
    if len(wanted) < len(rows):
        idx = to_device(logits.device, wanted)
        logits, token_ids = logits[idx], token_ids[idx]
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    n_max = min(max(rows[i].num_logprobs for i in wanted), logits.shape[-1])
    top_vals, top_ids = logprobs.topk(n_max, dim=-1)  # n_max == 0 gives empty lists
    # One copy to the host, not three (each waits for the device): float64 holds the
    # float32 logprobs and the token ids exactly.
    # With `ranks`, a last column: how many tokens are likelier than the chosen one, plus 1.
    rank = (logprobs > chosen).sum(dim=1, keepdim=True) + 1 if ranks else chosen[:, :0]
    packed = torch.cat([chosen.double(), top_vals.double(), top_ids.double(), rank.double()], dim=1).tolist()
    for j, i in enumerate(wanted):
        n = rows[i].num_logprobs
        row = packed[j]
        samples[i].logprob = row[0]
        samples[i].top_logprobs = [(int(t), v) for t, v in zip(row[1 + n_max:1 + n_max + n], row[1:1 + n])]
        if ranks:
            samples[i].rank = int(row[-1])
    return samples


def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_logprobs: int) -> list[Sample]:
    """Row i of `logits` scored at token_ids[i] (a prompt's logprobs): its logprob and the
    `num_logprobs` likeliest tokens, as a sampled token's, and its rank."""
    rows = [SamplingRow(num_logprobs=num_logprobs)] * len(token_ids)
    return _with_logprobs(logits.float(), to_device(logits.device, token_ids), rows, ranks=True)
