"""OpenAI's request and response shapes, converted to and from pdserve.v1 at the edge.

- Requests: a `/v1/completions` or `/v1/chat/completions` body becomes prompt token ids and
  `pdserve_pb2.SamplingParams`. Type errors are caught here (400 naming the field); value
  limits (temperature < 0, top_p > 1, prompt plus max_tokens over the context, ...) by the
  very checks a gRPC request gets (`router/validation.py`), before any node does work.
- Errors: every failure is an `OpenAIError`, rendered as OpenAI's
  `{"error": {"message", "type", "param", "code"}}`; gRPC statuses map to HTTP statuses
  the way Google's HTTP/gRPC mapping does (`HTTP_STATUS`), and `code` is the gRPC status
  name in lower case, so both APIs report the same failure the same way.
- Responses: `GenerateResponse` deltas become completion / chat-completion chunks and
  whole responses.
"""

from __future__ import annotations

import re
import time

import grpc

from pdserve.proto import pdserve_pb2

from .chat import template_options
from .response_format import BadStructure, structured_output
from .tool_dialects import HERMES, Dialect
from .tools import Tools, tools_from_body

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409, grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNIMPLEMENTED: 501, grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 409: "conflict_error", 429: "rate_limit_error"}
# Every request field, and what pdserve does with it (docs/operations.md, "OpenAI
# parameters"). Implemented: what both endpoints take, then each one's own.
IMPLEMENTED = {"model", "max_tokens", "temperature", "top_p", "n", "seed", "stop", "stream",
               "stream_options", "logprobs", "user", "presence_penalty", "frequency_penalty",
               "logit_bias", "response_format",
               # pdserve's extras, as vLLM names them
               "top_k", "min_p", "ignore_eos", "stop_token_ids", "cache_salt", "priority", "repetition_penalty",
               "structured_outputs", "min_tokens", "bad_words", "include_stop_str_in_output",
               "truncate_prompt_tokens", "skip_special_tokens", "prompt_logprobs", "return_token_ids",
               "return_tokens_as_token_ids", "allowed_token_ids", "prompt_cache_key"}
IMPLEMENTED_ONLY = {False: {"prompt", "best_of", "echo", "suffix"},
                    True: {"messages", "max_completion_tokens", "top_logprobs", "tools",
                           "tool_choice", "parallel_tool_calls",
                           # vLLM's, for the chat template (router/chat.py)
                           "add_generation_prompt", "continue_final_message", "chat_template_kwargs",
                           "reasoning_effort", "documents", "safety_identifier"}}
# Accepted only at a value that asks for nothing pdserve lacks (OpenAI's old `functions`,
# audio, storage); any other value is a 400 naming the field.
NEUTRAL = {"functions": ([],), "function_call": ("none",),
           "store": (False,), "metadata": ({},),
           "service_tier": ("auto", "default"), "modalities": (["text"],), "audio": (),
           "prediction": (), "web_search_options": ()}
# "top_p must be ...", "prompt token id 9999 is outside ...", "prompt of 900 tokens is
# longer ...", at the start of the message or after a "...: " prefix; "prompt[1]..." (one
# prompt of a batch); "structured_output.regex ..." (a part of a field); "(900 in the
# prompt, 16 in the completion)" (the context's error).
_FIELD_IN_MESSAGE = re.compile(r"^([a-z_]+)(?:\[\d+\]|\.[a-z_]+ )|(?:^|: )([a-z_]+)(?: token ids?)?(?: -?\d+)? "
                               r"(?:must|of \d+|is)|\d+ in the ([a-z_]+), \d+ in the completion")


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = ERROR_TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.code}}

    @classmethod
    def from_status(cls, code: grpc.StatusCode, message: str, chat: bool = False) -> "OpenAIError":
        """The HTTP error for a gRPC status; `param` is the field the message names."""
        match = _FIELD_IN_MESSAGE.search(message)
        param = next(name for name in match.groups() if name) if match else None
        if param == "prompt" and chat:
            param = "messages"
        return cls(HTTP_STATUS.get(code, 500), message, param, code.name.lower())


def invalid(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param, "invalid_argument")


def _typed(body: dict, name: str, kinds: tuple, what: str):
    value = body.get(name)
    if value is not None and (not isinstance(value, kinds) or isinstance(value, bool) != (bool in kinds)):
        raise invalid(f"{name} must be {what}, got {value!r}", name)
    return value


def flag_of(body: dict, name: str) -> bool:
    """A boolean field of the body (vLLM's `return_token_ids`, ...), default false."""
    return bool(_typed(body, name, (bool,), "a boolean"))


def check_fields(body: dict, chat: bool) -> None:
    """Every field is one pdserve implements, or one at its neutral value: none is ignored."""
    known = IMPLEMENTED | IMPLEMENTED_ONLY[chat]
    for name, value in body.items():
        if name in known:
            continue
        if name in NEUTRAL:
            if value is not None and value not in NEUTRAL[name]:
                raise invalid(f"{name} is not supported by pdserve (got {value!r:.80})", name)
            continue
        where = "chat completions" if chat else "completions"
        raise invalid(f"unknown parameter {name!r} for {where}", name)
    best_of = body.get("best_of")
    if best_of is not None and best_of != body.get("n", 1):
        raise invalid(f"best_of must equal n (pdserve returns every choice it generates), "
                      f"got best_of={best_of!r}", "best_of")
    if chat and body.get("top_logprobs") is not None and not body.get("logprobs"):
        raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
    for name in ("user", "safety_identifier"):
        value = body.get(name)
        if value is not None and not isinstance(value, str):
            raise invalid(f"{name} must be a string, got {value!r:.80}", name)


def placement_of(body: dict) -> dict:
    """The request's `cache_salt` (vLLM's extra; router/cache_salt.py: absent or null is "",
    any value given a non-empty string), `priority` (vLLM's: lower waits less; a 32-bit
    integer, default 0) and `prompt_cache_key` (OpenAI's: which nodes, router/policies.py),
    as the dispatcher's `generate` takes them."""
    salt, priority, key = body.get("cache_salt"), body.get("priority"), body.get("prompt_cache_key")
    if key is not None and not isinstance(key, str):
        raise invalid(f"prompt_cache_key must be a string, got {key!r:.80}", "prompt_cache_key")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise invalid(f"cache_salt must be a non-empty string if given, got {salt!r:.80}",
                      "cache_salt")
    if priority is not None and (type(priority) is not int or not -2**31 <= priority < 2**31):
        raise invalid(f"priority must be an integer in [-2147483648, 2147483647] (lower is served "
                      f"first), got {priority!r:.80}", "priority")
    return {"cache_salt": salt or "", "priority": priority or 0, "cache_key": key or ""}


def sampling_from_body(body: dict, *, chat: bool, default_max_tokens: int,
                       tools: Tools | None = None) -> pdserve_pb2.SamplingParams:
    """`tools`: the chat request's (`tools_of`), whose tool_choice may hold the answer to a
    structure (router/tools.py)."""
    check_fields(body, chat)
    pb = pdserve_pb2.SamplingParams()
    max_tokens = body.get("max_completion_tokens") if chat and body.get("max_completion_tokens") is not None \
        else body.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)):
        raise invalid(f"max_tokens must be an integer, got {max_tokens!r}", "max_tokens")
    pb.max_tokens = default_max_tokens if max_tokens is None else max_tokens
    echo = not chat and _typed(body, "echo", (bool,), "a boolean")
    if max_tokens == 0 and not chat:
        if not echo:
            raise invalid("max_tokens must be at least 1 (0, the prompt alone, needs echo: true), "
                          "got 0", "max_tokens")
        pb.max_tokens = 1  # the prompt alone: its one token is dropped (router/echo.py)
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        value = _typed(body, name, (int, float), "a number")
        if value is not None:
            setattr(pb, name, float(value))
    for name in ("top_k", "n", "min_tokens"):
        value = _typed(body, name, (int,), "an integer")
        if value is not None:
            setattr(pb, name, value)
    seed = _typed(body, "seed", (int,), "an integer")
    if seed is not None:
        if not 0 <= seed < 2 ** 64:
            raise invalid(f"seed must be in [0, 2**64), got {seed}", "seed")
        pb.seed = seed
    for name in ("ignore_eos", "include_stop_str_in_output"):
        if _typed(body, name, (bool,), "a boolean"):
            setattr(pb, name, True)
    if _typed(body, "skip_special_tokens", (bool,), "a boolean") is not None:  # unset: true
        pb.skip_special_tokens = body["skip_special_tokens"]
    elif tools is not None and tools.reads_special_tokens:  # the calls' markers (tool_dialects.py)
        pb.skip_special_tokens = False
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid(f"stop must be a string or a list of strings, got {stop!r}", "stop")
    pb.stop.extend(stops)
    ids = body.get("stop_token_ids") or []
    if not isinstance(ids, list) or not all(isinstance(t, int) and 0 <= t < 2 ** 31 for t in ids):
        raise invalid(f"stop_token_ids must be a list of token ids, got {ids!r}", "stop_token_ids")
    pb.stop_token_ids.extend(ids)
    words = body.get("bad_words") or []
    if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
        raise invalid(f"bad_words must be a list of strings, got {words!r:.80}", "bad_words")
    pb.bad_words.extend(words)
    allowed = body.get("allowed_token_ids")
    if allowed is not None and (not isinstance(allowed, list) or not allowed or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2 ** 31 for t in allowed)):
        raise invalid(f"allowed_token_ids must be a non-empty list of token ids, got {allowed!r:.80}",
                      "allowed_token_ids")
    pb.allowed_token_ids.extend(allowed or ())
    pb.logit_bias.update(_logit_bias(body.get("logit_bias")))
    try:
        structured = structured_output(body)
    except BadStructure as err:
        raise invalid(str(err), err.param) from None
    forced = tools.structure() if tools is not None else None
    if forced is not None:
        if structured is not None:
            raise invalid(f"tool_choice {tools.mode!r} holds the answer to the tools' arguments, so it "
                          "cannot also follow response_format or structured_outputs: send one",
                          "tool_choice")
        structured = forced
    if structured is not None:
        pb.structured_output.CopyFrom(structured)
    if chat:
        if _typed(body, "logprobs", (bool,), "a boolean"):
            pb.logprobs = _typed(body, "top_logprobs", (int,), "an integer") or 0
    else:
        logprobs = _typed(body, "logprobs", (int,), "an integer")
        if logprobs is not None:
            pb.logprobs = logprobs
            if echo:
                pb.prompt_logprobs = logprobs
    scored = _typed(body, "prompt_logprobs", (int,), "an integer")  # vLLM's: its own field in the answer
    if scored is not None:
        if body.get("stream") or pb.HasField("prompt_logprobs"):
            raise invalid("prompt_logprobs are not available with stream, nor beside echo's prompt logprobs: "
                          "send one", "prompt_logprobs")
        pb.prompt_logprobs = scored
    return pb


def _logit_bias(given) -> dict[int, float]:
    """OpenAI's `logit_bias`: token ids, written as JSON keys (strings), to numbers. Its
    bounds (ids in the vocabulary, biases in [-100, 100]) are the shared rules'."""
    if given is None:
        return {}
    try:
        if not isinstance(given, dict) or any(isinstance(b, bool) or not isinstance(b, (int, float))
                                               for b in given.values()):
            raise ValueError
        out = {int(token): float(bias) for token, bias in given.items()}
    except ValueError:
        raise invalid(f"logit_bias must map token ids (JSON keys, e.g. \"13\") to numbers in [-100, 100], "
                      f"got {given!r:.80}", "logit_bias") from None
    bad = [t for t in out if not 0 <= t < 2 ** 31]
    if bad:
        raise invalid(f"logit_bias must be keyed by token ids, got {bad[0]}", "logit_bias")
    return out


def completion_prompts(body: dict, encode, max_chars: int) -> list[list[int]]:
    """Token ids of each prompt in a completions `prompt`: a string, a list of token ids, or
    a list of either (a batch: one request each, router/prompt_batch.py). A text longer than
    `max_chars` is refused untokenized, as a gRPC prompt is (router/validation.py)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return [_prompt_ids(p, encode, max_chars, f"prompt[{i}]") for i, p in enumerate(prompt)]
    return [_prompt_ids(prompt, encode, max_chars, "prompt")]


def _prompt_ids(prompt, encode, max_chars: int, name: str) -> list[int]:
    if isinstance(prompt, str):
        if len(prompt) > max_chars:
            raise invalid(f"{name} of {len(prompt)} characters is longer than the model's "
                          f"context can hold (at most {max_chars} characters)", "prompt")
        ids = encode(prompt)
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
        if any(not 0 <= t < 2 ** 31 for t in ids):
            raise invalid(f"{name} token ids must be non-negative, got {min(ids)}", "prompt")
    else:
        raise invalid(f"{name} must be a string, a list of token ids, or a list of those, "
                      f"got {prompt!r:.80}", "prompt")
    if not ids:
        raise invalid(f"{name} is empty", "prompt")
    return ids


def tools_of(body: dict, dialect: Dialect = HERMES) -> Tools | None:
    """The chat request's checked tools (router/tools.py) for a model that calls them in
    `dialect`, or None."""
    try:
        return tools_from_body(body, dialect)
    except BadStructure as err:
        raise invalid(str(err), err.param) from None


def chat_prompt(body: dict, tokenizer, tools: Tools | None = None) -> list[int]:
    """Token ids of `messages`, and of the `tools` offered, as the model's chat template
    renders them: the very function (and checks) a gRPC request's messages go through
    (`PromptTokenizer.chat_ids`), with the template options the body asks for."""
    try:
        options = template_options(body, tokenizer.tokenizer.chat_template)
    except ValueError as err:
        raise invalid(str(err), str(err).split(" ", 1)[0]) from None
    try:
        return tokenizer.chat_ids(body.get("messages"), tools, options)
    except ValueError as err:
        raise invalid(str(err), "messages") from None


def usage_body(usage: pdserve_pb2.Usage | None) -> dict | None:
    if usage is None:
        return None
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
            "timings": {name: getattr(usage, name) for name in TIMINGS}}


# pdserve's extra usage field `timings` (seconds), the same as gRPC's Usage.
TIMINGS = ("time_to_first_token_s", "time_per_output_token_s", "time_per_output_token_p90_s",
           "queue_time_s", "prefill_time_s", "kv_transfer_time_s")


def chunk(kind: str, response_id: str, created: int, model: str, choices: list, usage=None) -> dict:
    body = {"id": response_id, "object": kind, "created": created, "model": model,
            "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return body


def now() -> int:
    return int(time.time())
