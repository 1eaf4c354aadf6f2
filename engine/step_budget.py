"""How many prompt tokens one step may prefill beside the running decodes, so that every
running stream's inter-token latency stays within a target (stall-free batching, as in
Sarathi-Serve): a long prompt is prefilled in chunks between decode steps instead of
stopping them for seconds.

The chunk follows the measured step cost, not a constant. Two fits, each with exponential
forgetting (about the last `MEMORY` steps count):
- a decode-only step of n sequences takes `a + b * n` (least squares over decode-only
  steps; while one batch size was seen, b = 0 and a its mean time);
- a prompt token costs `c`: what prefill steps took beyond their decodes' predicted time,
  per prompt token.
Kept apart because the batch size hardly varies under steady load: one joint fit of
a, b and c then turned a single cold step into nonsense slopes.

The target is `--decode-itl-target-ms`, or by default `TARGET_FACTOR` times the predicted
decode-only step of the current batch but never under `MIN_DEFAULT_TARGET_S`: below that,
chunks would shrink to a few tokens, costing prefill throughput for gaps nobody reads
slower (and a tiny model's schedule would follow timing noise). The prefill cap is what
the target leaves after the decodes, divided by `c`. Only running sums are kept:
microseconds a step.
Invariants: with no decode running the cap is None (the whole step budget: nothing to
protect); otherwise it is at least `MIN_CHUNK` tokens, so a prompt always progresses, and
`PROBE_CHUNK` until decode steps and `MIN_MEASURED_PROMPT_TOKENS` prompt tokens were
measured: one stalled step among a few short prompts would otherwise set the chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

MEMORY = 256         # steps: recent enough to follow the load and the threads
TARGET_FACTOR = 2.0  # default target: twice the decode-only step
MIN_DEFAULT_TARGET_S = 0.05
MIN_MEASURED_PROMPT_TOKENS = 256
MIN_CHUNK = 16
PROBE_CHUNK = 64
_KEEP = 1.0 - 1.0 / MEMORY


@dataclass(frozen=True)
class StepLoad:
    """What a node reports of its steps (LoadReport), published whole by each schedule so
    any thread may read it: seconds, and prompt tokens waiting to be prefilled here."""

    decodes: int = 0
    prompt_backlog_tokens: int = 0
    decode_step_s: float = 0.0  # predicted decode-only step of `decodes` (0: unmeasured)
    prompt_token_s: float = 0.0  # what a prompt token adds to a step (0: unmeasured)
    itl_target_s: float = 0.0  # the target inter-token latency (0: none)


class StepBudget:
    """`itl_target_s`: None for the default (relative to the measured decode step), 0 to
    disable the cap (the whole step budget, as before), else seconds."""

    def __init__(self, itl_target_s: float | None = None) -> None:
        self.itl_target_s = itl_target_s
        self.forget()

    @classmethod
    def for_target_ms(cls, target_ms: float | None) -> StepBudget:
        return cls(None if target_ms is None else target_ms / 1e3)

    @property
    def enabled(self) -> bool:
        return self.itl_target_s != 0

    def forget(self) -> None:
        """Drop every measurement (the warm-up's first steps include one-time costs)."""
        self._decode = [0.0] * 5  # forgetting sums of 1, n, n*n, t, n*t over decode-only steps
        self._prefill = [0.0, 0.0]  # of extra seconds and of prompt tokens over prefill steps

    def observe(self, decodes: int, prefill_tokens: int, seconds: float) -> None:
        """One finished step: how many decodes and prompt tokens it ran, and its time."""
        if prefill_tokens:
            extra = seconds - self.decode_step_s(decodes)
            p = self._prefill
            p[0], p[1] = _KEEP * p[0] + max(extra, 0.0), _KEEP * p[1] + prefill_tokens
        elif decodes:
            n, d = float(decodes), self._decode
            for i, v in enumerate((1.0, n, n * n, seconds, n * seconds)):
                d[i] = _KEEP * d[i] + v

    def decode_step_s(self, decodes: int) -> float:
        """The predicted time of a decode-only step of `decodes` sequences (0: unmeasured)."""
        s1, sn, snn, st, snt = self._decode
        if s1 == 0:
            return 0.0
        spread = s1 * snn - sn * sn
        if spread <= 1e-6 * s1 * snn:  # one batch size so far: its mean time
            return st / s1
        b = max(0.0, (s1 * snt - sn * st) / spread)
        return max(0.0, (st - b * sn) / s1 + b * decodes)

    @property
    def prompt_token_s(self) -> float | None:
        """What one prompt token adds to a step; None before enough were measured."""
        extra, tokens = self._prefill
        return extra / tokens if tokens >= MIN_MEASURED_PROMPT_TOKENS and extra > 0 else None

    def target_s(self, decodes: int) -> float | None:
        if self.itl_target_s:
            return self.itl_target_s
        step = self.decode_step_s(decodes)
        return max(TARGET_FACTOR * step, MIN_DEFAULT_TARGET_S) if step else None

    def prefill_cap(self, decodes: int) -> int | None:
        """Prompt tokens the next step may compute beside `decodes` running decodes; None:
        no cap."""
        if decodes == 0 or not self.enabled:
            return None
        c, target = self.prompt_token_s, self.target_s(decodes)
        if c is None or target is None or self._decode[0] == 0:
            return PROBE_CHUNK
        return max(MIN_CHUNK, int((target - self.decode_step_s(decodes)) / c))

    def load(self, decodes: int, prompt_backlog_tokens: int) -> StepLoad:
        target = self.target_s(max(decodes, 1)) if self.enabled else None
        return StepLoad(decodes, prompt_backlog_tokens, self.decode_step_s(decodes),
                        self.prompt_token_s or 0.0, target or 0.0)
