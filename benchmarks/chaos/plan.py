"""What the chaos soak asks and when it strikes: pure functions of the seed.

- `prompt_set`: the fixed prompts (token ids) and their output lengths; requests draw from
  it, so the same prompts recur and exercise the decode nodes' prefix caches, and the
  oracle computes each distinct prompt once.
- `poisson_arrivals`: send times of an open-loop Poisson load over a duration.
- `fault_plan`: when each fault starts, which kind, and which node. Kinds, victims (the
  four workers) and the router's signal each come in shuffled rounds (every item once per
  round, in a random order), so a short soak still sees every kind strike both roles; the
  gap between two starts is uniform in `every_s`.
Invariants: the same seed gives the same prompts, arrivals and plan; prompts, arrivals and
faults use separate random streams, so changing the rate moves no prompt and no fault.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from pdserve.benchmarks.serve.workload import synthetic

FAULT_KINDS = ("kill", "stop", "router", "link")
WORKERS = ("p1", "p2", "d1", "d2")


@dataclass(frozen=True)
class Prompt:
    token_ids: tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True)
class PlannedFault:
    at_s: float  # planned start, seconds from the soak's start
    kind: str    # one of FAULT_KINDS
    target: str  # a worker name, or "router"
    how: str     # kill: always SIGKILL; router: "SIGTERM" or "SIGKILL"; else ""


def prompt_set(num: int, vocab_size: int, seed: int, input_len=(16, 200),
               output_len=(8, 64)) -> list[Prompt]:
    """`num` distinct prompts of ids below `vocab_size` (special ids avoided)."""
    return [Prompt(tuple(r.prompt), r.output_len)
            for r in synthetic(num, input_len, output_len, vocab_size, seed=f"chaos-{seed}")]


def poisson_arrivals(rate: float, duration_s: float, seed: int) -> list[float]:
    """Send times in [0, duration_s): exponential gaps of mean 1/rate, the first at 0."""
    if rate <= 0 or duration_s <= 0:
        raise ValueError(f"rate and duration must be > 0, got {rate}, {duration_s}")
    rng = random.Random(f"pdserve-chaos-arrivals-{seed}")
    out, t = [], 0.0
    while t < duration_s:
        out.append(t)
        t += rng.expovariate(rate)
    return out


def parse_every(text: str) -> tuple[float, float]:
    """`"15,30"` or `"20"` -> (lo, hi) seconds; raises ValueError naming the text."""
    try:
        parts = [float(p) for p in text.split(",")]
    except ValueError:
        parts = []
    if len(parts) not in (1, 2) or not 0 < parts[0] <= parts[-1]:
        raise ValueError(f"expected MIN,MAX or S seconds with 0 < MIN <= MAX, got {text!r}")
    return parts[0], parts[-1]


def fault_plan(kinds: tuple[str, ...], duration_s: float, every_s: tuple[float, float],
               seed: int, quiet_tail_s: float = 0.0) -> list[PlannedFault]:
    """Faults starting at every_s[0]..every_s[1] gaps from 0, none later than
    `duration_s - quiet_tail_s` (the soak's end stays fault-free so the last one heals)."""
    unknown = set(kinds) - set(FAULT_KINDS)
    if unknown or not kinds:
        raise ValueError(f"fault kinds must be a non-empty subset of {FAULT_KINDS}, got {kinds}")
    rng = random.Random(f"pdserve-chaos-faults-{seed}")
    kind_of, victim_of = _rounds(rng, kinds), _rounds(rng, WORKERS)
    router_signal = _rounds(rng, ("SIGTERM", "SIGKILL"))
    out: list[PlannedFault] = []
    t = rng.uniform(*every_s)
    while t <= duration_s - quiet_tail_s:
        kind = next(kind_of)
        target = "router" if kind == "router" else next(victim_of)
        how = {"kill": "SIGKILL", "router": next(router_signal) if kind == "router" else ""}
        out.append(PlannedFault(round(t, 3), kind, target, how.get(kind, "")))
        t += rng.uniform(*every_s)
    return out


def _rounds(rng: random.Random, items: tuple[str, ...]):
    """`items` forever, each round a fresh shuffle."""
    while True:
        order = list(items)
        rng.shuffle(order)
        yield from order
