"""The sampler keeps to each filter's support, is reproducible per seed, and reports the
model's logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.sampler import Sample, SamplingRow, sample

SETTINGS = settings(max_examples=60, deadline=None)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _logits(seed: int, batch: int, vocab: int) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=_gen(seed)) * 3


def test_greedy_rows_take_the_argmax():
    logits = _logits(0, 5, 100)
    out = sample(logits, [SamplingRow(temperature=0.0) for _ in range(5)])
    assert [s.token_id for s in out] == logits.argmax(-1).tolist()
    assert all(s.logprob is None and s.top_logprobs is None for s in out)


def test_greedy_rows_in_a_mixed_batch_take_the_argmax():
    logits = _logits(1, 6, 100)
    rows = [SamplingRow(temperature=0.0 if i % 2 else 5.0) for i in range(6)]
    out = sample(logits, rows)
    argmax = logits.argmax(-1).tolist()
    assert [out[i].token_id for i in (1, 3, 5)] == [argmax[i] for i in (1, 3, 5)]


def test_top_k_one_is_greedy_at_any_temperature():
    logits = _logits(2, 8, 1000)
    out = sample(logits, [SamplingRow(temperature=10.0, top_k=1) for _ in range(8)])
    assert [s.token_id for s in out] == logits.argmax(-1).tolist()


@SETTINGS
@given(seed=st.integers(0, 2**31), k=st.integers(1, 20), temperature=st.floats(0.2, 5.0))
def test_top_k_samples_stay_in_the_k_most_likely(seed, k, temperature):
    logits = _logits(seed, 16, 64)
    out = sample(logits, [SamplingRow(temperature=temperature, top_k=k) for _ in range(16)])
    allowed = logits.topk(k, dim=-1).indices
    for row, s in enumerate(out):
        assert s.token_id in allowed[row].tolist()


def _nucleus(logits_row: torch.Tensor, temperature: float, top_p: float) -> set[int]:
    probs = torch.softmax(logits_row / temperature, -1)
    p, ids = probs.sort(descending=True)
    before = p.cumsum(0) - p
    return set(ids[before < top_p].tolist())


@SETTINGS
@given(seed=st.integers(0, 2**31), top_p=st.floats(0.05, 0.95), temperature=st.floats(0.3, 3.0))
def test_top_p_samples_stay_in_the_nucleus(seed, top_p, temperature):
    logits = _logits(seed, 16, 64)
    out = sample(logits, [SamplingRow(temperature=temperature, top_p=top_p) for _ in range(16)])
    for row, s in enumerate(out):
        assert s.token_id in _nucleus(logits[row], temperature, top_p)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31), top_p=st.floats(0.05, 0.99), scale=st.sampled_from([0.1, 1.0, 8.0]))
def test_top_p_over_a_large_vocabulary_stays_in_the_nucleus(seed, top_p, scale):
    # Flat logits put the nucleus beyond the first candidates (full sort), peaked ones not.
    logits = _logits(seed, 8, 2000) * scale
    rows = [SamplingRow(temperature=1.0, top_p=top_p, generator=_gen(seed + i)) for i in range(8)]
    for row, s in enumerate(sample(logits, rows)):
        assert s.token_id in _nucleus(logits[row], 1.0, top_p)


@SETTINGS
@given(seed=st.integers(0, 2**31), min_p=st.floats(0.01, 1.0), temperature=st.floats(0.3, 3.0))
def test_min_p_samples_are_at_least_min_p_of_the_top_probability(seed, min_p, temperature):
    logits = _logits(seed, 16, 64)
    out = sample(logits, [SamplingRow(temperature=temperature, min_p=min_p) for _ in range(16)])
    probs = torch.softmax(logits / temperature, -1)
    for row, s in enumerate(out):
        assert probs[row, s.token_id] >= min_p * probs[row].max() * (1 - 1e-5)


def test_top_k_cuts_ties_at_exactly_k():
    logits = torch.zeros(1, 10)  # all tied: top_k=3 must allow exactly three tokens
    seen = {sample(logits, [SamplingRow(top_k=3, generator=_gen(s))])[0].token_id for s in range(200)}
    assert len(seen) == 3


def test_samples_follow_the_softmax_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 20000
    logits = probs.log().expand(n, 4).contiguous()
    torch.manual_seed(0)
    out = sample(logits, [SamplingRow(temperature=1.0) for _ in range(n)])
    freq = torch.bincount(torch.tensor([s.token_id for s in out]), minlength=4).float() / n
    # 4 standard deviations of a binomial proportion at n=20000 is at most 0.0142.
    assert torch.allclose(freq, probs, atol=0.015)


def test_temperature_sharpens_and_flattens():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).expand(4000, 4).contiguous()
    torch.manual_seed(1)

    def top_share(t):
        out = sample(logits, [SamplingRow(temperature=t) for _ in range(4000)])
        return sum(s.token_id == 0 for s in out) / 4000

    assert top_share(0.25) > top_share(1.0) > top_share(4.0)


def test_same_seed_gives_same_tokens_whatever_the_batch():
    steps = [_logits(100 + i, 4, 500) for i in range(10)]
    alone_gen = _gen(1234)
    alone = [
        sample(l[2:3], [SamplingRow(temperature=1.0, top_p=0.9, generator=alone_gen)])[0].token_id
        for l in steps
    ]
    # The same row, now third in a batch with unseeded, greedy and differently seeded rows.
    gen, other = _gen(1234), _gen(99)
    batched = []
    for l in steps:
        rows = [
            SamplingRow(temperature=0.7),
            SamplingRow(temperature=0.0),
            SamplingRow(temperature=1.0, top_p=0.9, generator=gen),
            SamplingRow(temperature=2.0, top_k=5, generator=other, num_logprobs=3),
        ]
        batched.append(sample(l, rows)[2].token_id)
    assert batched == alone
    assert len(set(alone)) > 1, "the seeded row should actually be random"


def test_different_seeds_give_different_tokens():
    logits = torch.zeros(1, 1000)
    g1, g2 = _gen(1), _gen(2)
    a = [sample(logits, [SamplingRow(generator=g1)])[0].token_id for _ in range(5)]
    b = [sample(logits, [SamplingRow(generator=g2)])[0].token_id for _ in range(5)]
    assert a != b


def test_logprobs_are_of_the_raw_logits_whatever_the_temperature():
    logits = _logits(7, 3, 50)
    rows = [
        SamplingRow(temperature=0.0, num_logprobs=5),
        SamplingRow(temperature=3.0, top_k=4, generator=_gen(0), num_logprobs=2),
        SamplingRow(temperature=1.0, num_logprobs=0),
    ]
    out = sample(logits, rows)
    ref = torch.log_softmax(logits, -1)
    for row, s in enumerate(out):
        assert s.logprob == pytest.approx(ref[row, s.token_id].item(), abs=1e-5)
    top5 = ref[0].topk(5)
    assert [t for t, _ in out[0].top_logprobs] == top5.indices.tolist()
    assert [lp for _, lp in out[0].top_logprobs] == pytest.approx(top5.values.tolist(), abs=1e-5)
    assert len(out[1].top_logprobs) == 2 and out[2].top_logprobs == []
    assert all(a[1] >= b[1] for a, b in zip(out[0].top_logprobs, out[0].top_logprobs[1:]))


def test_logprobs_only_for_rows_that_ask():
    out = sample(_logits(8, 2, 20), [SamplingRow(0.0, num_logprobs=1), SamplingRow(0.0)])
    assert out[0].logprob is not None and len(out[0].top_logprobs) == 1
    assert out[1] == Sample(token_id=out[1].token_id)
    assert math.isfinite(out[0].logprob)


def test_logits_of_the_wrong_shape_are_rejected():
    with pytest.raises(ValueError, match="3 rows"):
        sample(torch.zeros(2, 10), [SamplingRow()] * 3)


def _host_to_device_ops(fn) -> int:
    """Ops run under `fn` that take a host tensor and give one on the device (the meta
    device stands in for a GPU: it runs every op's shapes without one)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    crossings = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
            if isinstance(out, torch.Tensor) and out.device.type == "meta" and \
                    any(a.device.type == "cpu" for a in inputs):
                crossings.append(func)
            return out

    with Count():
        fn()
    return len(crossings)


@pytest.mark.parametrize("batch", [1, 64])
def test_seeded_rows_cross_to_the_device_in_one_copy_whatever_the_batch(batch):
    from pdserve.engine.sampler import _uniforms

    rows = [SamplingRow(generator=_gen(i)) if i % 2 == 0 else SamplingRow() for i in range(batch)]
    assert _host_to_device_ops(lambda: _uniforms(rows, torch.device("meta"))) == 1
    assert _host_to_device_ops(lambda: _uniforms([SamplingRow()] * batch, torch.device("meta"))) == 0


def test_a_seeded_row_draws_one_uniform_of_its_own_generator_a_step():
    from pdserve.engine.sampler import _uniforms

    gen, twin = _gen(5), _gen(5)
    torch.manual_seed(0)
    u = _uniforms([SamplingRow(), SamplingRow(generator=gen), SamplingRow()], torch.device("cpu"))
    assert u[1].item() == torch.rand((), generator=twin).item()  # exactly its own next draw
    assert 0 <= u.min().item() and u.max().item() < 1 and u[0] != u[2]
