"""One request's GenerateResponse messages as OpenAI's answer: streamed chunks or one whole
response, completions' or chat's. A chat request with tools passes each choice's text
through its `CallStream` (router/tools.py), so the same content and tool calls come out
streamed or whole."""

from __future__ import annotations

import json
import secrets

from pdserve.router.echo import Echo
from pdserve.router.choice_logprobs import ChoiceLogprobs
from pdserve.router.openai_protocol import chunk, invalid, now, usage_body
from pdserve.router.harmony import HarmonyStream
from pdserve.router.reasoning import ReasoningStream
from pdserve.router.tools import CallStream, Tools, merge_calls


class Shape:
    def __init__(self, chat: bool, response_id: str, model: str, logprobs: ChoiceLogprobs,
                 echo: Echo | None = None, tools: Tools | None = None, thinking: bool | None = None,
                 harmony: bool = False) -> None:
        """`thinking`: None for a model that does not think, else whether the prompt opened
        its think block (router/reasoning.py); `harmony`: the model answers in channels
        (router/harmony.py), its reasoning in one."""
        self.chat, self.id, self.model, self.logprobs, self.echo = chat, response_id, model, logprobs, echo
        self.tools, self.thinking, self.harmony = tools, thinking, harmony
        self.thoughts: dict[int, ReasoningStream | HarmonyStream] = {}
        self.reasoning: dict[int, str] = {}
        self.kind = "chat.completion" if chat else "text_completion"
        self.created = now()
        self.started: set[int] = set()
        self.text: dict[int, str] = {}
        self.calls: dict[int, list[dict]] = {}
        self.streams: dict[int, CallStream] = {}
        self.entries: dict[int, list] = {}
        self.finish: dict[int, str | None] = {}
        self.stop: dict[int, str | int | None] = {}  # vLLM's stop_reason, by choice
        self.usage = None
        self.include_usage = self.obfuscate = False  # a stream's `stream_options` (stream_usage)
        self.continuous: list[int] | None = None  # [prompt tokens, completion tokens so far]
        self.scored: dict[int, list] | None = None  # vLLM's prompt_logprobs, by choice, when asked
        # vLLM's return_token_ids: each choice's output ids so far, and its prompt's ids (of
        # choice i: prompts[i // n], as a batch numbers them); None when not asked
        self.ids: dict[int, list[int]] | None = None
        self.prompt_ids: tuple[list[list[int]], int] | None = None

    def return_token_ids(self, prompts: list[list[int]], n: int) -> None:
        self.ids, self.prompt_ids = {}, (prompts, n)

    def _prompt_of(self, index: int) -> list[int]:
        prompts, n = self.prompt_ids
        return prompts[index // n]

    def _new_ids(self, msg) -> list[int]:
        """The ids `msg` adds to its choice: none of the token a scoring echo drops."""
        return list(msg.token_ids) if self.echo is None or self.echo.generate else []

    def stream_usage(self, include_usage: bool, continuous: bool, obfuscate: bool, prompt_tokens: int) -> None:
        """`stream_options_of`'s choices: the usage chunk at the end, (vLLM's
        continuous_usage_stats) the usage so far on every chunk, and padded chunks."""
        self.include_usage, self.obfuscate = include_usage, obfuscate
        self.continuous = [prompt_tokens, 0] if continuous else None

    def add(self, msg) -> None:
        if msg.HasField("usage"):
            self.usage = self._usage(msg.usage)
            return
        i = msg.index
        text, reasoning, deltas, entries, finish = self._parts(msg)
        if self.ids is not None:
            self.ids.setdefault(i, []).extend(self._new_ids(msg))
        self.text[i] = self.text.get(i, "") + text
        self.reasoning[i] = self.reasoning.get(i, "") + reasoning
        merge_calls(self.calls.setdefault(i, []), deltas)
        self.entries.setdefault(i, []).extend(entries)
        if self.scored is not None and msg.prompt_logprobs and i not in self.scored:
            self.scored[i] = self._prompt_logprobs(msg.prompt_logprobs)
        if finish:
            self.finish[i], self.stop[i] = finish, stop_reason_of(msg)

    def _parts(self, msg) -> tuple[str, str, list[dict], list, str]:
        """(text, reasoning, tool-call deltas, logprob entries, finish reason) of a choice's
        message: the model's reasoning first taken out, then the calls."""
        text, entries, finish = self.echo.choice(msg) if self.echo else \
            (msg.text, list(msg.logprobs), msg.finish_reason)
        reasoning = ""
        if self.harmony or self.thinking is not None:
            thought = self.thoughts.setdefault(msg.index, HarmonyStream() if self.harmony else
                                               ReasoningStream(self.thinking))
            reasoning, text = thought.feed(text)
            if finish:
                more_reasoning, more_text = thought.finish()
                reasoning, text = reasoning + more_reasoning, text + more_text
        if self.tools is None:
            return text, reasoning, [], entries, finish
        stream = self.streams.setdefault(msg.index, CallStream(self.tools))
        text, deltas = stream.feed(text)
        if finish:
            more_text, more_deltas, finish = stream.finish(finish)
            text, deltas = text + more_text, deltas + more_deltas
        return text, reasoning, deltas, entries, finish

    def _usage(self, usage):
        return self.echo.usage(usage) if self.echo else usage

    def chunks(self, msg, include_usage: bool | None = None) -> list[dict]:
        """The stream's chunks for `msg`; `include_usage`: None for the stream's own choice."""
        include_usage = self.include_usage if include_usage is None else include_usage
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        extra = {"usage": None} if include_usage else {}
        if self.continuous is not None and not msg.HasField("usage"):
            self.continuous[1] += len(msg.token_ids)
            prompt, done = self.continuous
            extra = {"usage": {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}}
        if msg.HasField("usage"):
            if not include_usage:
                return []
            return [chunk(kind, self.id, self.created, self.model, [], usage_body(self._usage(msg.usage)))]
        out = []
        text, reasoning, deltas, entries, finish = self._parts(msg)
        logprobs = self.logprobs.render(entries, msg.index)
        finish = finish or None
        first, opening = msg.index not in self.started, not self.started  # its choice's, the stream's
        self.started.add(msg.index)
        ids = {} if self.ids is None else {"token_ids": self._new_ids(msg)}
        if self.chat:
            if first:
                head = chunk(kind, self.id, self.created, self.model, [{
                    "index": msg.index, "delta": {"role": "assistant", "content": ""},
                    "logprobs": None, "finish_reason": None}])
                if self.ids is not None and opening:  # vLLM's: on the stream's first chunk
                    head["prompt_token_ids"] = self._prompt_of(0)
                out.append({**head, **extra})
            delta = {"reasoning_content": reasoning} if reasoning else {}
            if text:
                delta["content"] = text
            if deltas:
                delta["tool_calls"] = deltas
            if (self.tools or self.thinking is not None or self.harmony) and not delta and logprobs is None and finish is None \
                    and not ids.get("token_ids"):
                return out  # text held back (a tag, the calls): nothing to say yet
            choice = {"index": msg.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish, **ids}
        else:
            choice = {"index": msg.index, "text": text, "logprobs": logprobs, "finish_reason": finish, **ids}
        if finish:
            choice["stop_reason"] = stop_reason_of(msg)
            if ids and first:
                choice["prompt_token_ids"] = self._prompt_of(msg.index)
        out.append({**chunk(kind, self.id, self.created, self.model, [choice]), **extra})
        return out

    def whole(self) -> dict:
        choices = []
        for i in sorted(self.text):
            logprobs = self.logprobs.render(self.entries.get(i), i)
            if self.chat:
                message = {"role": "assistant", "content": self.text[i]}
                if self.thinking is not None or self.harmony:
                    message["reasoning_content"] = self.reasoning[i] or None
                if self.calls.get(i):  # OpenAI's: no content but what the calls left
                    message.update(content=self.text[i].strip() or None, tool_calls=self.calls[i])
                choices.append({"index": i, "message": message, "logprobs": logprobs,
                                "finish_reason": self.finish.get(i), "stop_reason": self.stop.get(i)})
            else:
                choices.append({"index": i, "text": self.text[i], "logprobs": logprobs,
                                "finish_reason": self.finish.get(i), "stop_reason": self.stop.get(i)})
                if self.scored is not None:
                    choices[-1]["prompt_logprobs"] = self.scored.get(i)
                if self.ids is not None:
                    choices[-1]["prompt_token_ids"] = self._prompt_of(i)
            if self.ids is not None:
                choices[-1]["token_ids"] = self.ids.get(i, [])
        whole = chunk(self.kind, self.id, self.created, self.model, choices, usage_body(self.usage))
        if self.chat and self.ids is not None:  # vLLM's place for a conversation's
            whole["prompt_token_ids"] = self._prompt_of(0)
        if self.chat and self.scored is not None:  # vLLM's place for a conversation's
            whole["prompt_logprobs"] = self.scored.get(0)
        return whole

    def _prompt_logprobs(self, entries) -> list[dict | None]:
        """vLLM's `prompt_logprobs`: per prompt token, None for the first (nothing scores
        it), then {token id: {logprob, rank, decoded_token}} of the token and its likeliest."""
        text = self.logprobs.token_text
        scored: list[dict | None] = [None]
        for e in entries:
            ranked = {str(e.token_id): {"logprob": e.logprob, "rank": e.rank or None,
                                        "decoded_token": text(e.token_id)}}
            for rank, t in enumerate(e.top, 1):
                ranked.setdefault(str(t.token_id), {"logprob": t.logprob, "rank": rank,
                                                    "decoded_token": text(t.token_id)})
            scored.append(ranked)
        return scored


def stop_reason_of(msg) -> str | int | None:
    """vLLM's `stop_reason` of a choice's last message: the stop string or stop token id
    that ended it, None for an end of sequence or anything else."""
    which = msg.WhichOneof("stop_reason")
    return None if which is None else getattr(msg, which)


STREAM_OPTIONS = ("include_usage", "continuous_usage_stats", "include_obfuscation")


def stream_options_of(body: dict) -> tuple[bool, bool, bool]:
    """(include_usage, continuous_usage_stats, include_obfuscation) of the request's
    `stream_options`: given only with `stream: true`, booleans each; vLLM's continuous
    stats need include_usage too."""
    options = body.get("stream_options")
    if options is None:
        return False, False, False
    if body.get("stream") is not True:
        raise invalid("stream_options is only allowed when stream is true", "stream_options")
    if not isinstance(options, dict) or not all(k in STREAM_OPTIONS and isinstance(v, bool)
                                                for k, v in options.items()):
        raise invalid(f"stream_options must be an object of booleans among {', '.join(STREAM_OPTIONS)}, "
                      f"got {options!r:.80}", "stream_options")
    if options.get("continuous_usage_stats") and not options.get("include_usage"):
        raise invalid("stream_options.continuous_usage_stats needs include_usage: true", "stream_options")
    return (bool(options.get("include_usage")), bool(options.get("continuous_usage_stats")),
            bool(options.get("include_obfuscation")))


# OpenAI's stream obfuscation: an `obfuscation` field of random characters pads each event
# to a whole number of blocks, so an eavesdropper who sees only encrypted sizes cannot read
# each token's length from them. At least MIN_PAD characters, so a token whose text is up
# to that much longer still lands in the same block.
BLOCK, MIN_PAD = 128, 32


def encoded(event: dict, obfuscate: bool = False) -> str:
    """`event` as JSON; with `obfuscate`, padded as above."""
    if not obfuscate:
        return json.dumps(event)
    bare = len(json.dumps({**event, "obfuscation": ""}))
    pad = MIN_PAD + (-(bare + MIN_PAD)) % BLOCK
    return json.dumps({**event, "obfuscation": secrets.token_urlsafe(pad)[:pad]})
