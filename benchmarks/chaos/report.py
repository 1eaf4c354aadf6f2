"""The soak's verdict: what clients saw, checked against the oracle, the clock and the pools.

Must be 0 (`checks`; the soak exits non-zero otherwise):
- `outlived_deadline`: requests whose client-side time exceeded their deadline plus
  `DEADLINE_SLACK_S` (a deadline is a promise to the client, faults or not);
- `wrong_output`: completed requests whose tokens differ from the colocated oracle's greedy
  output for the same prompt (a truncated stream that ended without an error included);
- `pages_leaked`: pages not back in the workers' pools once faults and requests stopped.
The requests of the capacity phase (before any fault) are judged by the same rules.
Failures (errors the client saw) are counted by gRPC status, not judged: faults cause them.
`failed_away_from_faults` counts those whose request overlapped no fault (nor the
`SETTLE_S` after it healed): the errors faults do not explain.
"""

from __future__ import annotations

from collections import Counter

from pdserve.benchmarks.chaos.traffic import Outcome

DEADLINE_SLACK_S = 1.0
SETTLE_S = 5.0  # after a fault heals, errors this soon after are still its doing
SAMPLES = 10


def _first_diff(got: list[int], want: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))


def _near_fault(o: Outcome, faults: list[dict]) -> bool:
    end = o.sent_s + o.elapsed_s
    return any(o.sent_s <= f.get("healed_s", f["at_s"]) + SETTLE_S and end >= f["at_s"]
               for f in faults)


def requests(outcomes: list[Outcome], expected: list[list[int]], deadline_s: float,
             faults: list[dict]) -> dict:
    failed = [o for o in outcomes if not o.completed]
    outlived = [o for o in outcomes if o.elapsed_s > deadline_s + DEADLINE_SLACK_S]
    wrong = [o for o in outcomes if o.completed and o.token_ids != expected[o.prompt_index]]
    away = [o for o in failed if not _near_fault(o, faults)]
    return {
        "sent": len(outcomes),
        "completed": len(outcomes) - len(failed),
        "failed": dict(sorted(Counter(o.status for o in failed).items())),
        "failed_away_from_faults": len(away),
        "outlived_deadline": len(outlived),
        "wrong_output": len(wrong),
        "latency_s_max": round(max((o.elapsed_s for o in outcomes), default=0.0), 2),
        "samples": {
            "wrong": [{"request_id": o.request_id, "prompt": o.prompt_index,
                       "sent_s": round(o.sent_s, 2), "first_diff": _first_diff(
                           o.token_ids, expected[o.prompt_index]),
                       "got_len": len(o.token_ids), "want_len": len(expected[o.prompt_index]),
                       "finish_reason": o.finish_reason, "route": o.route,
                       "near_fault": _near_fault(o, faults)} for o in wrong[:SAMPLES]],
            "outlived": [_failure(o) for o in outlived[:SAMPLES]],
            "failed_away_from_faults": [_failure(o) for o in away[:SAMPLES]],
            "failed": [_failure(o) for o in failed[:SAMPLES]],
        },
    }


def _failure(o: Outcome) -> dict:
    return {"request_id": o.request_id, "sent_s": round(o.sent_s, 2),
            "elapsed_s": round(o.elapsed_s, 2), "status": o.status, "detail": o.detail}


def checks(result: dict) -> dict:
    """The must-be-0 figures; the capacity phase's requests (no faults) count too."""
    phases = [result["requests"], result.get("capacity_requests") or {}]
    return {k: sum(p.get(k, 0) for p in phases) for k in ("outlived_deadline", "wrong_output")} \
        | {"pages_leaked": result["pages"]["leaked"]}


def fault_counts(faults: list[dict]) -> dict:
    return dict(sorted(Counter(f["kind"] for f in faults if "error" not in f).items()))


def table(result: dict) -> str:
    req, lines = result["requests"], []
    lines.append(f"chaos soak: {result['minutes']} min on {result['model']['name']}, "
                 f"{result['rate_rps']} req/s ({result['rate_source']}), seed {result['seed']}")
    lines.append(f"requests: {req['sent']} sent, {req['completed']} completed, failed "
                 f"{req['failed'] or 'none'} ({req['failed_away_from_faults']} away from faults)")
    if cap := result.get("capacity_requests"):
        lines.append(f"capacity phase (no faults): {cap['sent']} sent, {cap['completed']} "
                     f"completed, capacity {result['capacity_rps']} req/s")
    lines.append(f"faults: {fault_counts(result['faults'])}; left out: "
                 f"{result['faults_left_out'] or 'none'}")
    for f in result["faults"]:
        lines.append(f"  {f['at_s']:7.1f}s  {f['kind']:<6} {f['target']:<6} {f['how']:<7} "
                     f"healed {f.get('healed_s', '?')}s {f.get('error', '')}")
    for name, runs in result["memory"].items():
        growth = ", ".join(f"{r['rss_growth_mb']}" for r in runs)
        lines.append(f"  rss growth MiB {name:<6}: {growth}")
    lines.append("must be 0: " + ", ".join(f"{k} {v}" for k, v in result["checks"].items())
                 + ("  OK" if result["ok"] else "  FAILED"))
    return "\n".join(lines)
