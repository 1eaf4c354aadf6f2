"""A thinking model's reasoning apart from its answer, on /v1/chat/completions:
`message.reasoning_content` (streamed as `delta.reasoning_content`), the name vLLM and
DeepSeek's API give it, while `content` holds the answer alone.

- Which models think: those whose chat template knows `</think>` (Qwen3's, DeepSeek-R1's,
  SmolLM3's). For any other the answer's text is left as it is.
- Where the reasoning is: between `<think>` and `</think>` at the start of the answer
  (Qwen3 writes both tags), or from the start when the prompt itself ends by opening it
  (DeepSeek-R1's template does). A prompt that closed an empty block (Qwen3 with
  `chat_template_kwargs: {"enable_thinking": false}`) leaves an answer with no tags: all
  content.
- An answer cut short inside its reasoning is all reasoning, with no content; the
  whitespace between `</think>` and the answer is dropped.
- Streaming: a tag split across pieces is held back until it is known, never sent as text.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def thinks(chat_template: str | None) -> bool:
    """Whether a model with this chat template writes its reasoning in think tags."""
    return chat_template is not None and CLOSE in chat_template


def opened(prompt_text: str) -> bool:
    """Whether a rendered prompt (its end is enough) leaves a think block open."""
    return prompt_text.rstrip().endswith(OPEN)


class ReasoningStream:
    """One choice's text, as it arrives, split into (reasoning, content)."""

    def __init__(self, started: bool) -> None:
        self.state = "reasoning" if started else "start"  # then "answer", once past </think>
        self.held = ""
        self.answering = False  # the answer's first non-space character went out

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) to send for the next `text`."""
        self.held += text
        reasoning = ""
        if self.state == "start":
            head = self.held.lstrip()
            if head.startswith(OPEN):
                self.state, self.held = "reasoning", head[len(OPEN):]
            elif OPEN.startswith(head):
                return "", ""  # may still become <think>
            else:
                self.state, self.answering = "answer", True  # no reasoning: the text as it is
        if self.state == "reasoning":
            at = self.held.find(CLOSE)
            if at < 0:
                keep = next(k for k in range(min(len(CLOSE) - 1, len(self.held)), -1, -1)
                            if self.held.endswith(CLOSE[:k]))
                cut = len(self.held) - keep
                reasoning, self.held = self.held[:cut], self.held[cut:]
                return reasoning, ""
            reasoning, self.held, self.state = self.held[:at], self.held[at + len(CLOSE):], "answer"
        content, self.held = self.held, ""
        if not self.answering:
            content = content.lstrip()
            self.answering = bool(content)
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """(reasoning, content) still held when the choice ends."""
        held, self.held = self.held, ""
        if self.state == "reasoning":
            return held, ""
        return "", held if self.state == "start" or self.answering else held.lstrip()
