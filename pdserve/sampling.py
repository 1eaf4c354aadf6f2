"""What a request asks of the model's output (`SamplingParams`) and the rules its values
obey, in one place for every layer: the engine checks them on entry, the router and a
colocated node at the front door, before any node does work. The lowest layer, beside
`arith`: it imports nothing of pdserve's, so the router may use it without the engine.

Every check raises `ValueError` naming the field and the value, so a server passes it back
as INVALID_ARGUMENT. `check_context` refuses in vLLM's words, naming both numbers.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

# Bounds on what one request may make a node allocate (choices, stop lists, logprobs).
MAX_CHOICES = 16
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_LOGPROBS = 20
MAX_SEED = 2**63 - 1 - MAX_CHOICES  # seed + i of sample i must fit a torch generator seed
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2], as OpenAI's
MAX_BIAS = 100.0  # a logit bias lies in [-100, 100], as OpenAI's: -100 bans a token, 100 forces it
MAX_LOGIT_BIAS = 1024  # biased tokens of one request (each is added at every step)
MAX_STRUCTURE_CHARS = 64 * 1024  # a structured output's schema, expression or grammar
MAX_CHOICES_LISTED = 256  # strings of a `choice` structured output
MAX_BAD_WORDS = 64  # each is checked at every step of every sequence of the request
MAX_ALLOWED_TOKEN_IDS = 65536
STRUCTURE_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """What the text must match: `kind` is one of STRUCTURE_KINDS, `spec` its JSON Schema
    (JSON text), regular expression, grammar, or choices (a tuple); None for json_object."""

    kind: str
    spec: str | tuple[str, ...] | None = None

    def validate(self) -> None:
        name = f"structured_output.{self.kind}"
        if self.kind not in STRUCTURE_KINDS:
            _bad("structured_output", self.kind, f"one of {', '.join(STRUCTURE_KINDS)}")
        if self.kind == "json_object":
            return
        if self.kind == "choice":
            spec = self.spec
            if not isinstance(spec, tuple) or not 1 <= len(spec) <= MAX_CHOICES_LISTED or any(
                    not isinstance(c, str) or not c or len(c) > MAX_STRUCTURE_CHARS for c in spec):
                _bad(name, spec if not isinstance(spec, tuple) else list(spec[:4]),
                     f"1 to {MAX_CHOICES_LISTED} non-empty strings")
            return
        if not isinstance(self.spec, str) or not self.spec or len(self.spec) > MAX_STRUCTURE_CHARS:
            _bad(name, self.spec if not isinstance(self.spec, str) else f"{len(self.spec)} characters",
                 f"a non-empty text of at most {MAX_STRUCTURE_CHARS} characters")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.spec)
            except ValueError as err:
                raise ValueError(f"{name} must be a JSON Schema in JSON: {err}") from None
            if not isinstance(schema, (dict, bool)):
                _bad(name, self.spec[:80], "a JSON Schema (a JSON object)")


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    seed: int | None = None  # sample i of n draws from torch.Generator(seed + i)
    n: int = 1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs of each chosen token; 0: only its own
    prompt_logprobs: int | None = None  # the same of each prompt token after the first
    # What the sequence has said, held against it (engine/penalties.py): OpenAI's presence
    # and frequency penalties (output tokens), vLLM's repetition penalty (prompt and output;
    # 1: off) and OpenAI's logit bias (token id -> added to its logit).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    structured_output: StructuredOutput | None = None  # None: free text
    # Banned tokens (engine/bans.py, vLLM's meanings): no stop token or stop string ends the
    # output before it has `min_tokens` tokens; no `bad_words` word is ever written.
    min_tokens: int = 0
    bad_words: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False  # the stop string that ended the text stays in it
    skip_special_tokens: bool = True  # special tokens are left out of the text
    allowed_token_ids: list[int] | None = None  # vLLM's: only these may be sampled (None: any)

    @property
    def penalized(self) -> bool:
        """Its logits are adjusted before sampling (any penalty or bias is on)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)

    def validate(self, vocab_size: int | None = None, max_model_len: int | None = None) -> None:
        """The one place sampling values are checked: the router's front door, every entry
        into the engine and every role's edge call it. Raises ValueError naming the field
        and the value."""
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            _bad("max_tokens", self.max_tokens, "an integer >= 1")
        if max_model_len is not None and self.max_tokens > max_model_len:
            _bad("max_tokens", self.max_tokens, f"in [1, {max_model_len}] (the model's context)")
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            _bad("temperature", self.temperature, ">= 0")
        if not 0.0 < self.top_p <= 1.0:
            _bad("top_p", self.top_p, "in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            _bad("top_k", self.top_k, "-1, 0 (off) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            _bad("min_p", self.min_p, "in [0, 1]")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            _bad("seed", self.seed, f"None or an integer in [0, {MAX_SEED}]")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_CHOICES:
            _bad("n", self.n, f"an integer in [1, {MAX_CHOICES}]")
        if len(self.stop) > MAX_STOP_STRINGS or any(
                not isinstance(s, str) or not s or len(s) > MAX_STOP_CHARS for s in self.stop):
            _bad("stop", self.stop[:4], f"at most {MAX_STOP_STRINGS} non-empty strings of at most "
                f"{MAX_STOP_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            _bad("stop_token_ids", len(self.stop_token_ids), f"at most {MAX_STOP_TOKEN_IDS} ids")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0 or (vocab_size is not None and t >= vocab_size):
                _bad("stop_token_ids", t, f"token ids in [0, {vocab_size})")
        limit = MAX_LOGPROBS if vocab_size is None else min(MAX_LOGPROBS, vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= limit):
                _bad(name, value, f"None or an integer in [0, {limit}]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and -MAX_PENALTY <= value <= MAX_PENALTY):
                _bad(name, value, f"in [{-MAX_PENALTY:g}, {MAX_PENALTY:g}]")
        if not (isinstance(self.repetition_penalty, (int, float)) and math.isfinite(self.repetition_penalty)
                and self.repetition_penalty > 0):
            _bad("repetition_penalty", self.repetition_penalty, "> 0 (1: off)")
        self._check_logit_bias(vocab_size)
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            _bad("min_tokens", self.min_tokens, f"an integer in [0, max_tokens = {self.max_tokens}]")
        if len(self.bad_words) > MAX_BAD_WORDS or any(
                not isinstance(w, str) or not w.strip() or len(w) > MAX_STOP_CHARS for w in self.bad_words):
            _bad("bad_words", self.bad_words[:4], f"at most {MAX_BAD_WORDS} words, each with a non-space "
                 f"character and at most {MAX_STOP_CHARS} characters")
        allowed = self.allowed_token_ids
        if allowed is not None and (not isinstance(allowed, list) or not 0 < len(allowed) <= MAX_ALLOWED_TOKEN_IDS):
            _bad("allowed_token_ids", allowed if not isinstance(allowed, list) else f"{len(allowed)} ids",
                 f"None or a list of 1 to {MAX_ALLOWED_TOKEN_IDS} token ids")
        for t in allowed or ():
            if not _is_int(t) or t < 0 or (vocab_size is not None and t >= vocab_size):
                _bad("allowed_token_ids", t, f"token ids in [0, {vocab_size})" if vocab_size else "token ids >= 0")
        if self.structured_output is not None:
            self.structured_output.validate()
            for name in ("ignore_eos", "min_tokens"):
                if getattr(self, name):
                    raise ValueError(f"{name} cannot be combined with structured_output: a structured "
                                     "text ends with its end-of-sequence token once complete")

    def _check_logit_bias(self, vocab_size: int | None) -> None:
        if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS:
            _bad("logit_bias", f"{len(self.logit_bias)} entries" if isinstance(self.logit_bias, dict)
                else self.logit_bias, f"a map of at most {MAX_LOGIT_BIAS} token ids to biases")
        for token, bias in self.logit_bias.items():
            if not _is_int(token) or token < 0 or (vocab_size is not None and token >= vocab_size):
                _bad("logit_bias", token, "keyed by token ids" + (f" in [0, {vocab_size})" if vocab_size else ""))
            if not (isinstance(bias, (int, float)) and -MAX_BIAS <= bias <= MAX_BIAS):
                _bad(f"logit_bias[{token}]", bias, f"in [{-MAX_BIAS:g}, {MAX_BIAS:g}]")


def _bad(name: str, value, why: str):
    raise ValueError(f"{name} must be {why}, got {value!r}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_context(prompt_tokens: int, max_tokens: int, max_model_len: int,
                  prompt_in: str = "prompt") -> None:
    """The prompt and every token `max_tokens` allows must fit the model's context (vLLM's
    rule and words; `prompt_in` is "prompt" or, for a conversation, "messages")."""
    total = prompt_tokens + max_tokens
    if total > max_model_len:
        raise ValueError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {total} tokens ({prompt_tokens} in the {prompt_in}, {max_tokens} in "
            f"the completion). Please reduce the length of the {prompt_in} or completion.")
