"""Structured output: a sequence's tokens held to a JSON Schema, any JSON object, a regular
expression, a list of choices or an EBNF grammar, with xgrammar (the library vLLM and
SGLang use). Every other token's logit is set to -inf before the sampler picks.

- `Grammars` compiles a request's `StructuredOutput` for this engine's tokenizer, once per
  distinct spec (xgrammar caches them), when the request enters the engine. One that does
  not compile is a ValueError naming it, so the request is refused before anything is
  allocated. The tokenizer's tables are built on the first such request, not at start-up.
- Each sequence gets its own `Constraint` (a matcher). It sees every token the sequence
  appends, so its state follows the text through a preemption (the tokens stay).
- The grammar's end-of-sequence tokens are the engine's: once the text is complete they
  are the only tokens allowed, and the sequence stops there.
- Rows are masked in one batched pass: each matcher fills its row of a bitmask on the host,
  which crosses to the device in one copy.
"""

from __future__ import annotations

import json
import re

import torch

from pdserve.sampling import StructuredOutput

from .device import to_device


_XGRAMMAR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


class Grammars:
    """One engine's compiler of structured outputs: its tokenizer, vocabulary and EOS ids."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int]) -> None:
        self._tokenizer, self._vocab_size, self._eos = tokenizer, vocab_size, sorted(eos_token_ids)
        self._compiler = None

    def constraints(self, spec: StructuredOutput, n: int) -> list["Constraint"]:
        """`n` fresh matchers of `spec`, one per sequence, from one compilation; ValueError
        naming the spec if it does not compile."""
        compiled = self.compiled(spec)
        return [Constraint(_xgrammar().GrammarMatcher(compiled)) for _ in range(n)]

    def compiled(self, spec: StructuredOutput):
        """`spec` compiled for this tokenizer (xgrammar caches it); ValueError naming it if
        it does not compile."""
        compiler = self._compiler_for_tokenizer()
        try:
            if spec.kind == "json_schema":
                return compiler.compile_json_schema(spec.spec, any_whitespace=False)
            if spec.kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if spec.kind == "regex":
                return compiler.compile_regex(spec.spec)
            if spec.kind == "choice":
                return compiler.compile_grammar("root ::= " + " | ".join(
                    json.dumps(c, ensure_ascii=False) for c in spec.spec))
            return compiler.compile_grammar(spec.spec)
        except RuntimeError as err:  # xgrammar's parse and schema errors, after a "[time] file:line: "
            reason = _XGRAMMAR_PREFIX.sub("", str(err).strip()) or type(err).__name__
            raise ValueError(f"structured_output.{spec.kind} does not compile: {reason[:300]}") from None

    def _compiler_for_tokenizer(self):
        if self._compiler is None:
            xgr = _xgrammar()
            info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size,
                                                      stop_token_ids=self._eos)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler


def _xgrammar():
    try:
        import xgrammar
    except ImportError:  # a server installed without it (the server extra brings it)
        raise ValueError("structured_output needs the xgrammar package on the decode node, which this "
                         "one lacks: pip install xgrammar there, or send the request without it") from None
    return xgrammar


class Constraint:
    """One sequence's matcher: which tokens may come next, and each token that came."""

    def __init__(self, matcher) -> None:
        self.matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Advance past `token_id`; False if the grammar does not allow it, which happens only
        where the mask allowed nothing (a dead end for this tokenizer) and so did not bind."""
        return self.matcher.accept_token(token_id)


def mask_(logits: torch.Tensor, constraints: list[Constraint | None]) -> torch.Tensor:
    """Row b of `logits` [B, V] keeps only what `constraints[b]` allows (None: every token),
    in place."""
    xgr = _xgrammar()
    rows = [b for b, c in enumerate(constraints) if c is not None]
    bitmask = xgr.allocate_token_bitmask(len(constraints), logits.shape[-1])
    for b in rows:
        constraints[b].matcher.fill_next_token_bitmask(bitmask, b)
    xgr.apply_token_bitmask_inplace(logits, to_device(logits.device, bitmask), vocab_size=logits.shape[-1],
                                    indices=rows)
    return logits
