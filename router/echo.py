"""OpenAI's completions `echo`: each choice starts with its prompt, and with `logprobs` the
prompt's tokens are scored too (what lm-eval-harness and other scorers read).

- The prompt's text is the prompt as sent: a string as is, token ids decoded.
- Its logprobs come from the node that generates (`SamplingParams.prompt_logprobs`, with
  the request's `logprobs` count); the first token has nothing before it, so its logprob
  and alternatives are null, as in OpenAI's answer.
- `max_tokens: 0` asks for the prompt alone. The node generates one token (the prompt's
  last position is computed anyway, as in vLLM) and the answer drops it: no text, no
  logprob, finish reason "length", 0 completion tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


class Unscored(NamedTuple):
    """The prompt's first token: nothing before it scores it."""
    token_id: int
    logprob: None = None
    top: None = None


@dataclass
class Echo:
    texts: list[str]       # prompt i's text
    first_ids: list[int]   # prompt i's first token
    n: int                 # choices per prompt: choice k echoes prompt k // n
    logprobs: bool         # the request asked for logprobs
    generate: bool         # False: max_tokens 0, the prompt alone
    _echoed: set[int] = field(default_factory=set)

    def choice(self, msg) -> tuple[str, list, str]:
        """(text, logprob entries, finish reason) of a choice's message, echoed."""
        text, entries = (msg.text, list(msg.logprobs)) if self.generate else ("", [])
        # The dropped token's "stop" is no reason of the prompt's; an abort stays an abort.
        finish = msg.finish_reason if self.generate or msg.finish_reason in ("", "abort") else "length"
        if msg.index not in self._echoed:
            self._echoed.add(msg.index)
            p = msg.index // self.n
            text = self.texts[p] + text
            if self.logprobs:
                entries = [Unscored(self.first_ids[p]), *msg.prompt_logprobs, *entries]
        return text, entries, finish

    def usage(self, usage):
        if not self.generate:
            usage.completion_tokens = 0
            usage.total_tokens = usage.prompt_tokens
        return usage


def echo_of(body: dict, prompts: list[list[int]], tokenizer, logprobs: bool) -> Echo | None:
    """The request's echo, or None without one. `prompts`: each prompt's ids."""
    if not body.get("echo"):
        return None
    given = body.get("prompt")
    given = given if isinstance(given, list) and given and isinstance(given[0], (str, list)) else [given]
    texts = [p if isinstance(p, str) else tokenizer.decode(ids) for p, ids in zip(given, prompts)]
    return Echo(texts, [ids[0] for ids in prompts], body.get("n") or 1, logprobs,
                body.get("max_tokens") != 0)
