"""Anthropic's Messages API, POST /v1/messages and /v1/messages/count_tokens, as a view of
chat completions, as /v1/responses is (router/responses_api.py): the request becomes a chat
request (`chat_body`), served as one (the same template, tools, structure, checks and
dispatch), and the chat answer's chunks become the message's content blocks and stream
events (`MessageStream`). The Anthropic SDK talks to it with `base_url` at the server.

- Input: `system` (a text or text blocks), `messages` of `user` and `assistant` turns, each
  a text or a list of blocks: `text`; `tool_use` (an assistant's call, its `input` the
  arguments) and `tool_result` (a user's answer to one, a text or text blocks, written
  "Error: ..." when `is_error`); an
  assistant's earlier `thinking` is left out, as templates leave it. A last `assistant`
  message is the start of the answer, which goes on from it (Anthropic's prefill: chat's
  `continue_final_message`). `cache_control` marks are taken as the hint they are: every
  prompt's prefix is cached by the nodes anyway.
- Mapped: `max_tokens` (required), `stop_sequences`, `temperature`, `top_p`, `top_k`,
  `metadata.user_id` (the log line's user, and the `prompt_cache_key` unless one is given:
  a user's requests go to the nodes that hold its prefixes, router/policies.py), `tools` (custom ones: name, description,
  input_schema), `tool_choice` (auto, any, tool, none; `disable_parallel_tool_use`),
  `thinking` (disabled, enabled, adaptive) and `output_config.effort` (a thinking model's
  reasoning effort), `output_config.format` (a JSON Schema the text is held to), `stream`;
  pdserve's extras (`seed`, `min_p`, `priority`, `prompt_cache_key`, ...) pass as on chat.
  Anything else (images, documents, server tools, containers) is a 400 naming it.
- Output: `thinking` blocks (a thinking model's reasoning), `text`, then one `tool_use` per
  call. `stop_reason`: `end_turn`, `max_tokens`, `stop_sequence` (with `stop_sequence`,
  the one that matched) or `tool_use`. `usage.input_tokens` counts the prompt's tokens
  not read from the prefix cache, `cache_read_input_tokens` those that were. Streamed,
  the events are Anthropic's (`message_start`, `content_block_start`,
  `content_block_delta`, `content_block_stop`, `message_delta`, `message_stop`).
- Errors: Anthropic's `{"type": "error", "error": {"type", "message"}}`, with the status
  a chat request would get; an error after the stream began is its `error` event.
"""

from __future__ import annotations

import copy
import datetime
import json

from .openai_protocol import OpenAIError

# pdserve's chat extras that mean the same on /v1/messages
EXTRAS = {"seed", "min_p", "min_tokens", "repetition_penalty", "presence_penalty", "frequency_penalty",
          "ignore_eos", "stop_token_ids", "priority", "cache_salt", "chat_template_kwargs", "logit_bias",
          "prompt_cache_key"}
PASSED = {"model", "max_tokens", "temperature", "top_p", "top_k", "stream"} | EXTRAS
MAPPED = {"messages", "system", "stop_sequences", "metadata", "tools", "tool_choice", "thinking", "output_config",
          "cache_control"}
NEUTRAL = {"service_tier": ("auto", "standard_only"), "speed": ("standard",)}
TOOL_FIELDS = {"name", "description", "input_schema", "type", "cache_control", "strict", "eager_input_streaming"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "xhigh", "max": "xhigh"}


def refused(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param, "invalid_argument")


def error_body(err: OpenAIError) -> dict:
    kind = ERROR_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def model_info(model_id: str, created: int, max_model_len: int) -> dict:
    """/v1/models/{id} as Anthropic's clients read it (they send `anthropic-version`)."""
    created_at = datetime.datetime.fromtimestamp(created, datetime.timezone.utc)
    return {"type": "model", "id": model_id, "display_name": model_id, "lifecycle": "active",
            "created_at": created_at.isoformat().replace("+00:00", "Z"),
            "max_input_tokens": max_model_len, "max_tokens": max_model_len}


def model_page(infos: list[dict], query) -> dict:
    """/v1/models as Anthropic's list of `infos` (the model's names), paged by `limit`,
    `after_id` and `before_id` (an id not listed: nothing past it)."""
    limit = query.get("limit", "20")
    if not limit.isdigit() or not 1 <= int(limit) <= 1000:
        raise refused(f"limit must be an integer in [1, 1000], got {limit!r:.40}", "limit")
    ids, after, before = [m["id"] for m in infos], query.get("after_id"), query.get("before_id")
    if after or before:
        infos = (infos[ids.index(after) + 1:] if after in ids else []) if after else \
            (infos[:ids.index(before)] if before in ids else [])
    page = infos[-int(limit):] if before and not after else infos[:int(limit)]
    return {"data": page, "has_more": len(page) < len(infos),
            "first_id": page[0]["id"] if page else None, "last_id": page[-1]["id"] if page else None}


def chat_body(body: dict, counting: bool = False) -> dict:
    """The chat completions request that serves the Messages request `body` (`counting`:
    only its prompt is wanted, for count_tokens); a 400 naming the field for anything it
    cannot be."""
    for name, value in body.items():
        if name not in PASSED | MAPPED and not (name in NEUTRAL and value in (None, *NEUTRAL[name])):
            raise refused(f"{name} is not served on /v1/messages (got {value!r:.80}): leave it out", name)
    chat = {k: v for k, v in body.items() if k in PASSED}
    if not counting and (type(body.get("max_tokens")) is not int or body["max_tokens"] < 1):
        raise refused(f"max_tokens is required: a positive integer, got {body.get('max_tokens')!r:.80}",
                      "max_tokens")
    if counting:
        chat.pop("max_tokens", None)
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise refused(f"stop_sequences must be a list of non-empty strings, got {stops!r:.80}", "stop_sequences")
        chat["stop"] = stops
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict) or set(metadata) - {"user_id"} or \
                not isinstance(metadata.get("user_id", ""), (str, type(None))):
            raise refused(f'metadata must be {{"user_id": string}}, got {metadata!r:.80}', "metadata")
        if metadata.get("user_id"):  # a user's requests share prefixes: to the same nodes, unless keyed otherwise
            chat["user"] = metadata["user_id"]
            chat.setdefault("prompt_cache_key", metadata["user_id"])
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
    chat.update(_tool_choice(body.get("tool_choice")))
    effort = _effort(body.get("thinking"), body.get("output_config"))
    if effort is not None:
        chat["reasoning_effort"] = effort
    fmt = (body.get("output_config") or {}).get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise refused(f'output_config.format must be {{"type": "json_schema", "schema": {{...}}}}, got '
                          f"{fmt!r:.80}", "output_config")
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    chat["messages"] = _messages(body.get("system"), body.get("messages"))
    if chat["messages"][-1]["role"] == "assistant":  # the answer's beginning, which it goes on from
        chat.update(continue_final_message=True, add_generation_prompt=False)
    return chat


def _effort(thinking, config) -> str | None:
    """The chat reasoning effort that `thinking` and `output_config.effort` ask for."""
    if config is not None and (not isinstance(config, dict) or set(config) - {"effort", "format"}):
        raise refused(f'output_config must be {{"effort", "format"}}, got {config!r:.80}', "output_config")
    effort = (config or {}).get("effort")
    if effort is not None and effort not in EFFORTS:
        raise refused(f"output_config.effort must be one of {', '.join(EFFORTS)}, got {effort!r:.80}",
                      "output_config")
    if thinking is None:
        return EFFORTS.get(effort)
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in ("enabled", "disabled", "adaptive"):
        raise refused(f'thinking must be {{"type": "enabled" | "disabled" | "adaptive"}}, got {thinking!r:.80}',
                      "thinking")
    if kind == "disabled":
        return "none"
    budget = thinking.get("budget_tokens")
    if kind == "enabled" and (type(budget) is not int or budget < 1):
        raise refused(f"thinking.budget_tokens must be a positive integer, got {budget!r:.80}", "thinking")
    return EFFORTS.get(effort, "medium")


def _tools(tools) -> list[dict]:
    if not isinstance(tools, list):
        raise refused(f"tools must be a list of tools, got {tools!r:.80}", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "custom") not in ("custom", None):
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise refused(f"tools[{i}] of type {kind!r:.80} is not served: pdserve calls custom tools "
                          "(name, description, input_schema), which the client runs", "tools")
        extra = sorted(set(tool) - TOOL_FIELDS)
        if extra:
            raise refused(f"tools[{i}].{extra[0]} is not served: leave it out", "tools")
        function = {"name": tool.get("name"), "parameters": tool.get("input_schema")}
        for name in ("description", "strict"):
            if tool.get(name) is not None:
                function[name] = tool[name]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice) -> dict:
    if choice is None:
        return {}
    kind = choice.get("type") if isinstance(choice, dict) else None
    modes = {"auto": "auto", "any": "required", "none": "none"}
    if kind == "tool":
        out = {"tool_choice": {"type": "function", "function": {"name": choice.get("name")}}}
    elif kind in modes:
        out = {"tool_choice": modes[kind]}
    else:
        raise refused(f'tool_choice must be {{"type": "auto" | "any" | "tool" | "none"}}, got {choice!r:.80}',
                      "tool_choice")
    if choice.get("disable_parallel_tool_use"):
        out["parallel_tool_calls"] = False
    return out


def _messages(system, given) -> list[dict]:
    out = [] if system is None else [{"role": "system", "content": _text(system, "system")}]
    if not isinstance(given, list) or not given:
        raise refused(f"messages must be a non-empty list of user and assistant messages, got {given!r:.80}",
                      "messages")
    for i, message in enumerate(given):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant"):
            raise refused(f"messages[{i}].role must be user or assistant (the system prompt is the top-level "
                          f"system), got {role!r:.80}", "messages")
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise refused(f"messages[{i}].content must be a text or a list of blocks, got {content!r:.80}",
                          "messages")
        texts, calls = [], []
        for j, block in enumerate(content):
            kind, where = block.get("type") if isinstance(block, dict) else None, f"messages[{i}].content[{j}]"
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "tool_use" and role == "assistant":
                calls.append({"id": block.get("id"), "type": "function", "function": {
                    "name": block.get("name"), "arguments": json.dumps(block.get("input", {}))}})
            elif kind == "tool_result" and role == "user":  # a failed call's result says so to the model
                result = _text(block.get("content", ""), where)
                out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                            "content": f"Error: {result}" if block.get("is_error") is True else result})
            elif kind not in ("thinking", "redacted_thinking") or role != "assistant":
                raise refused(f"{where} of type {kind!r:.40} is not served in a {role} message: pdserve takes "
                              "text, an assistant's tool_use and thinking, a user's tool_result", "messages")
        if calls:
            out.append({"role": role, "content": "".join(texts) or None, "tool_calls": calls})
        elif texts or not out or out[-1]["role"] != "tool":  # a turn of tool results alone is those
            out.append({"role": role, "content": "".join(texts)})
    return out


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text"
                                         and isinstance(b.get("text"), str) for b in content):
        return "".join(b["text"] for b in content)
    raise refused(f"{where} must be a text or a list of text blocks (pdserve serves text only), got "
                  f"{content!r:.80}", where.split("[")[0])


class MessageStream:
    """One message, built from its chat answer's chunks: `start`, `feed` each chunk (with
    usage), `end`; each gives the stream events to send. `response` is the whole."""

    obfuscate = False  # Anthropic's events carry no padding

    def __init__(self, request_id: str, model: str, body: dict, prompt_tokens: int) -> None:
        self.response = {"id": f"msg_{request_id}", "type": "message", "role": "assistant", "model": model,
                         "content": [], "stop_reason": None, "stop_sequence": None,
                         "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}
        self.stop_sequences = body.get("stop_sequences") or []
        self.open: int | None = None  # the content block being written
        self.calls: dict[int, int] = {}  # a chat tool call's index -> its block's
        self.arguments: dict[int, str] = {}  # a tool_use block's input so far, as JSON text
        self.finish, self.stop = None, None

    def start(self) -> list[dict]:
        return [{"type": "message_start", "message": copy.deepcopy(self.response)}]

    def feed(self, chunk: dict) -> list[dict]:
        usage = chunk.get("usage")
        if usage:
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            self.response["usage"] = {"input_tokens": usage["prompt_tokens"] - cached,
                                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached,
                                      "output_tokens": usage["completion_tokens"]}
        events = []
        for choice in chunk["choices"]:
            delta = choice["delta"]
            if delta.get("reasoning_content"):
                events += self._more("thinking", delta["reasoning_content"])
            if delta.get("content"):
                events += self._more("text", delta["content"])
            for call in delta.get("tool_calls") or ():
                events += self._call(call)
            if choice["finish_reason"]:
                self.finish, self.stop = choice["finish_reason"], choice.get("stop_reason")
        return events

    def end(self) -> list[dict]:
        """The last events: the open block closed, then why it stopped and the usage."""
        events = self._close()
        matched = self.stop if self.finish == "stop" and self.stop in self.stop_sequences else None
        # A forced tool's call ends "stop" on chat (as OpenAI's does); here it is a tool_use.
        reason = "max_tokens" if self.finish == "length" else "tool_use" if self.calls else \
            "stop_sequence" if matched else "end_turn"
        self.response.update(stop_reason=reason, stop_sequence=matched)
        return [*events, {"type": "message_delta", "usage": dict(self.response["usage"]),
                          "delta": {"stop_reason": self.response["stop_reason"], "stop_sequence": matched}},
                {"type": "message_stop"}]

    def failed(self, error: OpenAIError) -> list[dict]:
        return [error_body(error)]

    def _more(self, kind: str, text: str) -> list[dict]:
        """Events for more of the thinking or the text, in the block of that kind open now or a new one."""
        events = []
        if self.open is None or self.response["content"][self.open]["type"] != kind:
            events = self._open({"type": "text", "text": ""} if kind == "text" else
                                {"type": "thinking", "thinking": "", "signature": ""})
        self.response["content"][self.open][kind] += text
        delta = {"type": f"{kind}_delta", kind: text}
        return [*events, {"type": "content_block_delta", "index": self.open, "delta": delta}]

    def _call(self, delta: dict) -> list[dict]:
        events = []
        if "id" in delta:
            events = self._open({"type": "tool_use", "id": delta["id"], "name": delta["function"]["name"],
                                 "input": {}})
            self.calls[delta["index"]] = self.open
            self.arguments[self.open] = ""
        index = self.calls[delta["index"]]
        more = delta["function"]["arguments"]
        self.arguments[index] += more
        if not more:
            return events
        return [*events, {"type": "content_block_delta", "index": index,
                          "delta": {"type": "input_json_delta", "partial_json": more}}]

    def _open(self, block: dict) -> list[dict]:
        events = self._close()
        self.response["content"].append(block)
        self.open = len(self.response["content"]) - 1
        return [*events, {"type": "content_block_start", "index": self.open, "content_block": copy.deepcopy(block)}]

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        index, self.open = self.open, None
        block = self.response["content"][index]
        if block["type"] == "tool_use":
            try:
                block["input"] = json.loads(self.arguments[index] or "{}")
            except ValueError:  # a call cut short by max_tokens (the stop_reason says so)
                block["input"] = {}
        return [{"type": "content_block_stop", "index": index}]
