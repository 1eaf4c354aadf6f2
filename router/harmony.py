"""GPT-OSS's answers, written in OpenAI's harmony format, as OpenAI's API gives them: the
`analysis` channel as `reasoning_content`, the `final` channel (and a `commentary` preamble
with no recipient) as `content`, and a message to `functions.NAME` as a call of NAME.

An answer is messages, each a header and a body: `<|channel|>analysis<|message|>...<|end|>`,
then `<|start|>assistant<|channel|>final<|message|>...<|return|>`; a call's header names its
recipient (`<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>`),
its body is the arguments and `<|call|>` ends it. The markers are special tokens, so a
harmony model's chat answers keep special tokens in their text (unless the request says
otherwise) for this reader to see them.

A call is handed on as a Hermes `<tool_call>` block (router/tool_dialects.py), which the
call reader already checks (a function offered, arguments that parse, `parallel_tool_calls`)
and which leaves the whole answer as text when it does not hold. A message to any other
recipient (the built-in `browser` and `python` tools, which pdserve does not run) is
reasoning. Text before any header (an answer whose markers were dropped) is content.
"""

from __future__ import annotations

import json
import re

from .tool_dialects import HERMES_CLOSE, HERMES_OPEN

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
TURN_ENDS = ("<|return|>", "<|call|>")  # the answer's end: the last message's, or a call's
ENDS = ("<|end|>", *TURN_ENDS)  # a message's
RECIPIENT = re.compile(r"\bto=([^\s<]+)")


def speaks_harmony(chat_template: str | None) -> bool:
    """Whether a chat template renders the harmony format (GPT-OSS's)."""
    return isinstance(chat_template, str) and CHANNEL in chat_template and MESSAGE in chat_template


class HarmonyStream:
    """One choice's text, as it arrives, split into (reasoning, content): `feed` and
    `finish` as router/reasoning.py's ReasoningStream, so a Shape takes either."""

    def __init__(self) -> None:
        self.state = "start"  # "header" (until <|message|>), "body", or "plain" (no markers)
        self.held = ""
        self.kind = ""  # the body's: "reasoning", "content" or "call"
        self.recipient = ""

    def feed(self, text: str) -> tuple[str, str]:
        self.held += text
        reasoning, content = [], []
        while self.held:
            if self.state == "start":
                head = self.held.lstrip()
                if head.startswith((START, CHANNEL)):
                    self.state = "header"
                elif any(marker.startswith(head) for marker in (START, CHANNEL)):
                    break  # may still become a header
                else:
                    self.state = "plain"
            if self.state == "plain":
                content.append(self.held)
                self.held = ""
            elif self.state == "header":
                header, found, body = self.held.partition(MESSAGE)
                if not found:
                    break
                self._open(header)
                self.state, self.held = "body", body
            else:
                at, end = min(((self.held.find(e), e) for e in ENDS if e in self.held), default=(-1, ""))
                if at < 0:
                    cut = self._safe_end()
                    if self.kind != "call":
                        self._send(self.held[:cut], reasoning, content)
                        self.held = self.held[cut:]
                    break
                self._send(self.held[:at], reasoning, content, closing=True)
                self.state, self.held = "header", self.held[at + len(end):]
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What is still held: an unfinished header is dropped, an unfinished body sent."""
        reasoning, content = [], []
        if self.state == "body":
            self._send(self.held, reasoning, content, closing=True)
        elif self.state in ("start", "plain"):
            content.append(self.held)
        self.held = ""
        return "".join(reasoning), "".join(content)

    def _open(self, header: str) -> None:
        channel = header.partition(CHANNEL)[2].split("<|")[0].split()
        found = RECIPIENT.search(header)
        self.recipient = found.group(1) if found else ""
        if self.recipient.startswith("functions."):
            self.kind = "call"
        elif self.recipient or not channel or channel[0] == "analysis":
            self.kind = "reasoning"
        else:
            self.kind = "content"  # final, or commentary with no recipient: a preamble for the user

    def _send(self, text: str, reasoning: list, content: list, closing: bool = False) -> None:
        if self.kind == "reasoning":
            reasoning.append(text)
        elif self.kind == "content":
            content.append(text)
        elif closing:  # a call: whole, once its body ended
            content.append(_hermes_call(self.recipient.removeprefix("functions."), text))

    def _safe_end(self) -> int:
        """Where the held body may be cut: before a tail that could still become an end marker."""
        for k in range(min(max(map(len, ENDS)) - 1, len(self.held)), 0, -1):
            if any(e.startswith(self.held[-k:]) for e in ENDS):
                return len(self.held) - k
        return len(self.held)


def _hermes_call(name: str, arguments: str) -> str:
    """A Hermes block of the call; its arguments as written when they are not JSON (the call
    reader then leaves the answer as text)."""
    try:
        return f"{HERMES_OPEN}{json.dumps({'name': name, 'arguments': json.loads(arguments)}, ensure_ascii=False)}" \
               f"{HERMES_CLOSE}"
    except ValueError:
        return f"{HERMES_OPEN}{arguments}{HERMES_CLOSE}"
