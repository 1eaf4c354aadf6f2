"""The chaos soak's pure pieces: seeded prompts, Poisson arrivals, the fault plan, the
verdict, and the link fault's rule cleanup (where iptables works)."""

from __future__ import annotations

import subprocess

import pytest

from pdserve.benchmarks.chaos import firewall, report
from pdserve.benchmarks.chaos.plan import (FAULT_KINDS, WORKERS, fault_plan, parse_every,
                                   poisson_arrivals, prompt_set)
from pdserve.benchmarks.chaos.traffic import Outcome, picks
from pdserve.benchmarks.serve.workload import LOW_TOKEN_ID


def test_poisson_arrivals_are_seeded_within_the_duration_at_the_rate():
    times = poisson_arrivals(20.0, 100.0, seed=1)
    assert times == poisson_arrivals(20.0, 100.0, seed=1) != poisson_arrivals(20.0, 100.0, seed=2)
    assert times[0] == 0.0 and times == sorted(times) and times[-1] < 100.0
    assert 1800 < len(times) < 2200  # 2000 expected; a 4.5-sigma band
    with pytest.raises(ValueError):
        poisson_arrivals(0.0, 10.0, seed=0)


def test_kinds_victims_and_router_signals_come_in_seeded_shuffled_rounds():
    plan = fault_plan(FAULT_KINDS, 600.0, (10.0, 20.0), seed=7, quiet_tail_s=5.0)
    assert plan == fault_plan(FAULT_KINDS, 600.0, (10.0, 20.0), seed=7, quiet_tail_s=5.0)
    kinds = [f.kind for f in plan]
    rounds = [kinds[i:i + 4] for i in range(0, len(kinds) - 3, 4)]
    assert len(rounds) >= 6 and all(sorted(r) == sorted(FAULT_KINDS) for r in rounds)
    assert len({tuple(r) for r in rounds}) > 1, "the order within a round is shuffled"
    gaps = [b.at_s - a.at_s for a, b in zip(plan, plan[1:])]
    assert 10.0 <= plan[0].at_s <= 20.0 and all(10.0 - 1e-3 <= g <= 20.0 + 1e-3 for g in gaps)
    assert plan[-1].at_s <= 595.0
    victims = [f.target for f in plan if f.target != "router"]
    signals = [f.how for f in plan if f.kind == "router"]
    assert all(sorted(victims[i:i + 4]) == sorted(WORKERS) for i in range(0, len(victims) - 3, 4))
    assert all(sorted(signals[i:i + 2]) == ["SIGKILL", "SIGTERM"]
               for i in range(0, len(signals) - 1, 2))
    for f in plan:
        assert (f.target == "router") == (f.kind == "router")
        assert f.target in (*WORKERS, "router")
        assert f.how == {"kill": "SIGKILL", "stop": "", "link": ""}.get(f.kind, f.how)
        assert f.kind != "router" or f.how in ("SIGTERM", "SIGKILL")


@pytest.mark.parametrize("minutes, gaps", [(2, (10.0, 20.0)), (1, (7.0, 13.0))])  # the latter test_chaos.py's
def test_a_short_plan_with_short_gaps_covers_every_kind(minutes, gaps):
    for seed in range(20):
        plan = fault_plan(FAULT_KINDS, minutes * 60.0, gaps, seed=seed, quiet_tail_s=5.0)
        assert {f.kind for f in plan} == set(FAULT_KINDS), seed


def test_a_plan_takes_only_the_kinds_asked_for():
    plan = fault_plan(("kill", "stop"), 300.0, (15.0, 30.0), seed=0)
    assert {f.kind for f in plan} == {"kill", "stop"}
    with pytest.raises(ValueError):
        fault_plan(("meteor",), 300.0, (15.0, 30.0), seed=0)


@pytest.mark.parametrize("text,want", [("15,30", (15.0, 30.0)), ("20", (20.0, 20.0))])
def test_fault_interval_parses(text, want):
    assert parse_every(text) == want


@pytest.mark.parametrize("text", ["30,15", "0,5", "a,b", "1,2,3", ""])
def test_bad_fault_interval_is_refused_naming_it(text):
    with pytest.raises(ValueError, match="MIN,MAX"):
        parse_every(text)


def test_prompts_are_seeded_and_in_range():
    prompts = prompt_set(16, vocab_size=512, seed=3)
    assert prompts == prompt_set(16, vocab_size=512, seed=3) != prompt_set(16, 512, seed=4)
    for p in prompts:
        assert 16 <= len(p.token_ids) <= 200 and 8 <= p.max_tokens <= 64
        assert all(LOW_TOKEN_ID <= t < 512 for t in p.token_ids)
    assert picks(50, 16, seed=3) == picks(50, 16, seed=3)
    assert set(picks(500, 16, seed=3)) == set(range(16))


def _outcome(rid, index, tokens, status="OK", elapsed=1.0, sent=50.0):
    return Outcome(rid, index, sent, elapsed, status, "", list(tokens), "length")


def test_verdict_counts_wrong_truncated_late_and_failed_requests():
    expected = [[5, 6, 7], [8, 9]]
    faults = [{"kind": "kill", "at_s": 10.0, "healed_s": 14.0}]
    outcomes = [
        _outcome("right", 0, [5, 6, 7]),
        _outcome("wrong", 1, [8, 3]),
        _outcome("truncated", 0, [5, 6]),  # ended without an error: still wrong
        _outcome("late", 1, [8, 9], elapsed=31.5),
        _outcome("refused", 0, [], status="UNAVAILABLE", sent=12.0),
        _outcome("unexplained", 0, [], status="INTERNAL", sent=100.0),
    ]
    req = report.requests(outcomes, expected, deadline_s=30.0, faults=faults)
    assert (req["sent"], req["completed"], req["wrong_output"], req["outlived_deadline"]) == (6, 4, 2, 1)
    assert req["failed"] == {"INTERNAL": 1, "UNAVAILABLE": 1}
    assert req["failed_away_from_faults"] == 1
    assert [w["first_diff"] for w in req["samples"]["wrong"]] == [1, 2]
    result = {"requests": req, "pages": {"leaked": 0}}
    assert report.checks(result) == {"outlived_deadline": 1, "wrong_output": 2, "pages_leaked": 0}


LINK_UNAVAILABLE = firewall.available()  # "" where iptables works (root, kernel support)


@pytest.mark.skipif(bool(LINK_UNAVAILABLE), reason=LINK_UNAVAILABLE)
def test_a_blocked_port_is_unblocked_even_when_the_block_raises():
    def ours() -> list[str]:
        listed = subprocess.run(["iptables", "-S", "INPUT"], capture_output=True, text=True)
        return [line for line in listed.stdout.splitlines() if firewall.COMMENT in line]

    with pytest.raises(KeyboardInterrupt):
        with firewall.block(1):
            assert len(ours()) == 1 and "--dport 1 " in ours()[0]
            raise KeyboardInterrupt
    assert ours() == []


def test_without_iptables_the_soak_leaves_the_link_fault_out_and_clears_nothing(monkeypatch):
    # A machine without iptables: the soak's clear() at start and end finds no rules (it had
    # raised FileNotFoundError, failing the whole soak), and available() says why.
    monkeypatch.setattr(firewall.shutil, "which", lambda name: None)
    assert firewall.clear(mine_only=False) == 0
    assert firewall.clear() == 0
    assert "not installed" in firewall.available() or "not root" in firewall.available()
