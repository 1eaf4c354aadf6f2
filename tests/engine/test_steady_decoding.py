"""A long prompt prefilled beside running decodes goes in chunks sized by the measured step
cost, so every running stream gets a token every step and no step outlasts the target
inter-token latency (engine/step_budget.py, engine/scheduler.py).

The engine runs on a fake clock: each step "costs" what a linear cost model says, so the
budget learns that model and the test asserts in steps and modelled seconds, never in the
machine's own time."""

from __future__ import annotations

import pytest

from pdserve.engine import SamplingParams
from pdserve.engine import engine as engine_module
from pdserve.engine.step_budget import (MIN_CHUNK, MIN_DEFAULT_TARGET_S, MIN_MEASURED_PROMPT_TOKENS,
                                        PROBE_CHUNK, TARGET_FACTOR, StepBudget)

# seconds = A + B * decodes + C * prompt tokens: a prompt token costs 20 decodes
A, B, C = 0.010, 0.001, 0.0005


def modelled(decodes: int, prefill_tokens: int) -> float:
    return A + B * decodes + C * prefill_tokens


def taught(budget: StepBudget, steps: int = 40) -> StepBudget:
    """Decode-only steps of several batch sizes, then mixed ones, all on the model."""
    for i in range(steps):
        decodes, tokens = i % 7, (i * 37) % 300 if i % 3 and i > 14 else 0
        budget.observe(decodes, tokens, modelled(decodes, tokens))
    return budget


def test_the_cap_is_what_the_target_leaves_after_the_decodes():
    budget = taught(StepBudget.for_target_ms(50))
    assert budget.prefill_cap(4) == pytest.approx((0.050 - modelled(4, 0)) / C, abs=2)
    # A target the decodes alone exceed still lets a prompt progress.
    assert taught(StepBudget.for_target_ms(5)).prefill_cap(4) == MIN_CHUNK


def test_the_default_target_follows_the_measured_decode_step():
    budget = taught(StepBudget())
    assert budget.prompt_token_s == pytest.approx(C, rel=0.02)
    assert budget.target_s(40) == pytest.approx(TARGET_FACTOR * modelled(40, 0), rel=1e-6)
    assert budget.prefill_cap(40) == pytest.approx((TARGET_FACTOR - 1) * modelled(40, 0) / C, rel=0.03)
    # A fast decode step gets the floor, not chunks of a few tokens.
    assert budget.target_s(2) == MIN_DEFAULT_TARGET_S > TARGET_FACTOR * modelled(2, 0)


def test_no_cap_without_decodes_or_when_disabled_and_a_probe_before_measuring():
    assert taught(StepBudget()).prefill_cap(0) is None
    assert taught(StepBudget.for_target_ms(0)).prefill_cap(3) is None
    assert StepBudget().prefill_cap(3) == PROBE_CHUNK


class ModelClock:
    """The engine's `time`: only the modelled seconds pass, never the machine's."""

    def __init__(self) -> None:
        self.now = 1000.0

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def perf_counter(self) -> float:
        return self.now


class CostedRun:
    """Stands in for the model runner's `run` on the fake clock: the real forward, then the
    clock moves by the cost model's seconds for the batch it ran."""

    def __init__(self, engine, clock: ModelClock) -> None:
        self.run, self.clock = engine.runner.run, clock
        self.steps: list[tuple[int, int, float]] = []  # decodes, prompt tokens, seconds

    def __call__(self, seqs, num_new, wants, hook):
        logits = self.run(seqs, num_new, wants, hook)
        decodes = sum(1 for s, n in zip(seqs, num_new) if n == 1 and s.num_computed + 1 == s.num_tokens)
        seconds = modelled(decodes, sum(num_new) - decodes)
        self.steps.append((decodes, sum(num_new) - decodes, seconds))
        self.clock.advance(seconds)
        return logits


def _long_prompt_beside_streams(make_engine, prompts_of_lengths, monkeypatch, target_ms):
    """Four streams decoding, then a 400-token prompt arrives: each step's decodes, prompt
    tokens and modelled seconds, and how many tokens each stream got per step."""
    clock = ModelClock()
    monkeypatch.setattr(engine_module, "time", clock)
    engine = make_engine("llama", max_num_batched_tokens=512, decode_itl_target_ms=target_ms)
    costed = engine.runner.run = CostedRun(engine, clock)
    params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    short = prompts_of_lengths([8, 9, 10, 11], seed=41)
    for i, p in enumerate(short):
        engine.add_request(f"s{i}", p, params)
    for _ in range(20):  # streams under way; prompts of 8-11 tokens teach the prefill cost
        engine.step()
    first = len(costed.steps)
    engine.add_request("long", prompts_of_lengths([400], seed=42)[0],
                       SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    gaps = []
    long_seq = engine.requests["long"].seqs[0]
    streams = [engine.requests[f"s{i}"].seqs[0] for i in range(4)]
    while not long_seq.output_token_ids:  # its prompt is being prefilled
        before = [len(s.output_token_ids) for s in streams]
        engine.step()
        gaps.append([len(s.output_token_ids) - n for s, n in zip(streams, before)])
    while engine.has_unfinished():
        engine.step()
    return costed.steps[first:first + len(gaps)], gaps


def test_streams_keep_their_gaps_while_a_long_prompt_is_prefilled(make_engine, prompts_of_lengths,
                                                                   monkeypatch):
    target_s = 0.040
    steps, gaps = _long_prompt_beside_streams(make_engine, prompts_of_lengths, monkeypatch, 40)
    assert all(g == [1, 1, 1, 1] for g in gaps), "a running stream missed a step"
    assert len(steps) > 3, "the prompt should have gone in several chunks"
    # Probe chunks until enough prompt tokens were measured, then chunks the target holds.
    probes = -(-MIN_MEASURED_PROMPT_TOKENS // PROBE_CHUNK)
    assert [t for _, t, _ in steps[:probes]] == [PROBE_CHUNK] * probes
    assert max(s for _, _, s in steps[probes:]) <= target_s, steps
    assert sum(t for _, t, _ in steps) == 400


def test_without_a_target_the_prompt_stalls_the_streams_for_one_long_step(make_engine, prompts_of_lengths,
                                                                         monkeypatch):
    """The test above can fail: with the cut disabled, one step prefills the whole prompt."""
    steps, gaps = _long_prompt_beside_streams(make_engine, prompts_of_lengths, monkeypatch, 0)
    assert len(steps) == 1 and steps[0][2] > 0.040 * 3
