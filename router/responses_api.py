"""OpenAI's Responses API, POST /v1/responses, as a view of chat completions: the request
becomes a chat request (`chat_body`), served as one (the same template, tools, structure,
checks and dispatch), and the chat answer's chunks become the response's output items and
stream events (`ResponseStream`).

- Input: `input` (a text, or a list of message, `function_call`, `function_call_output`
  and `reasoning` items) and `instructions` (a system message before it). `developer` is
  the system role. Only text parts are taken.
- Mapped: `stream_options.include_obfuscation` (padded delta events, as chat's chunks),
  `max_output_tokens`, `text.format` (json_object, json_schema), `reasoning.effort`
  (chat's `reasoning_effort`), function `tools` and `tool_choice`, `parallel_tool_calls`,
  `temperature`, `top_p`, `user`, `safety_identifier`, `metadata` (given back), `stream`,
  and `top_logprobs` or `include: ["message.output_text.logprobs"]` (the text's logprobs,
  as chat's); `prompt_cache_key` and vLLM's sampling extras (`top_k`, `min_p`, ...) pass
  as they do on chat.
- Stored: a response is kept (`store`, default true, as OpenAI's) by the router that
  answered it (router/response_store.py), for `previous_response_id` (its conversation
  goes before the input, router/response_history.py) and GET / DELETE. With `background:
  true` the answer is the response "queued", served on (router/responses_http.py) and
  read back with GET. A `conversation` (router/conversations.py) gives its items before
  the input, and gets the input and the output after. `prompt` is a 400 naming it. So are
  hosted tools (web search, files), images, and the chat completions' own names (`messages`, `max_tokens`,
  `response_format`, `n`, `logprobs`), each with the field to send instead.
- Output: the reasoning (a `reasoning` item, for thinking models), the text (a `message`
  item with one `output_text` part), then one `function_call` item per call. `status` is
  "completed", or "incomplete" with `incomplete_details.reason` "max_output_tokens" when
  the answer was cut short. Streamed, the events are OpenAI's (`response.created`,
  `response.output_item.added`, `response.output_text.delta`, ..., `response.completed`),
  each numbered; whole, the response is the last event's. Both come from one
  `ResponseStream`, so they agree.
"""

from __future__ import annotations

import copy
import uuid

from .openai_protocol import OpenAIError, now

LOGPROBS = "message.output_text.logprobs"  # the one `include` served
MAPPED = {"input", "instructions", "max_output_tokens", "text", "tools", "tool_choice", "metadata", "store",
          "previous_response_id",
          "top_logprobs",
          "safety_identifier", "stream_options", "include", "truncation", "reasoning",
          "max_tool_calls", "background", "conversation"}
STORED = ("prompt",)  # what pdserve's store (router/response_store.py) lacks
CHAT_NAMES = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
              "response_format": "text.format", "n": "one request per answer",
              "logprobs": f"top_logprobs or include: [{LOGPROBS!r}]",
              "prompt_logprobs": "/v1/chat/completions for prompt_logprobs",
              "reasoning_effort": "reasoning.effort",
              "return_token_ids": "/v1/chat/completions for return_token_ids",
              "return_tokens_as_token_ids": "/v1/chat/completions for return_tokens_as_token_ids"}
# A chat check's message names the chat field; the client sent the Responses one.
RENAMED = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
           "response_format": "text.format", "messages": "input", "reasoning_effort": "reasoning.effort"}


class Refused(OpenAIError):
    """A 400 in the Responses request's own names already."""


def refused(message: str, param: str) -> Refused:
    return Refused(400, message, param, "invalid_argument")
TEXT_PARTS = ("input_text", "output_text", "text")


def chat_body(body: dict) -> dict:
    """The chat completions request that serves the Responses request `body`; a 400 naming
    the field for anything it cannot be."""
    for name in STORED:
        if body.get(name):
            raise refused(f"{name} is not served (pdserve stores responses and conversations, not prompts): "
                          "send the conversation in input, continue a response with previous_response_id, or "
                          "name a conversation", name)
    if body.get("conversation") is not None and body.get("previous_response_id") is not None:
        raise refused("conversation and previous_response_id both say what came before: send one", "conversation")
    for name in ("store", "background"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise refused(f"{name} must be a boolean, got {body[name]!r:.80}", name)
    if body.get("background") and body.get("store") is False:
        raise refused("a background response is stored and read back (GET /v1/responses/{id}): send it with "
                      "store true (the default)", "background")
    for name, instead in CHAT_NAMES.items():
        if body.get(name) is not None:
            raise refused(f"{name} is a chat completions field; on /v1/responses use {instead}", name)
    for name, value, allowed in (("include", body.get("include"), (None, [], [LOGPROBS])),
                                 ("truncation", body.get("truncation"), (None, "disabled", "auto")),
                                 ("max_tool_calls", body.get("max_tool_calls"), (None,))):
        if value not in allowed:
            raise refused(f"{name} {body[name]!r:.80} is not served: leave it out", name)
    options = body.get("stream_options")
    if options is not None and (body.get("stream") is not True or not isinstance(options, dict) or set(options) - {
            "include_obfuscation"} or not all(isinstance(v, bool) for v in options.values())):
        raise refused(f'stream_options must be {{"include_obfuscation": true | false}}, with stream: true; got '
                      f'{options!r:.80}', "stream_options")
    chat = {k: v for k, v in body.items() if k not in MAPPED and k not in STORED and k not in CHAT_NAMES}
    if _effort(body.get("reasoning")) is not None:
        chat["reasoning_effort"] = body["reasoning"]["effort"]
    if body.get("safety_identifier") is not None:
        chat["user"] = body["safety_identifier"]
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    if body.get("include") or body.get("top_logprobs") is not None:  # the text's logprobs
        chat.update(logprobs=True, top_logprobs=body.get("top_logprobs") or 0)
    text = body.get("text")
    if isinstance(text, dict) and (set(text) - {"format", "verbosity"} or text.get("verbosity") not in (None, "medium")):
        raise refused(f"text {text!r:.80} asks for what is not served: text.format alone (text.verbosity only "
                      "at its default, medium)", "text")
    fmt = text.get("format") if isinstance(text, dict) else text
    if fmt is not None:
        chat["response_format"] = _format(fmt)
    if body.get("tools"):
        chat["tools"] = [_tool(i, t) for i, t in enumerate(body["tools"])] \
            if isinstance(body["tools"], list) else body["tools"]
    choice = body.get("tool_choice")
    if choice is not None:
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}} \
            if isinstance(choice, dict) and choice.get("type") == "function" else choice
    chat["messages"] = _messages(body.get("input"), body.get("instructions"))
    return chat


def _effort(reasoning):
    """`reasoning.effort`, chat's `reasoning_effort`. A summary of the reasoning is not
    written: a thinking model's reasoning item carries the reasoning itself."""
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict) or set(reasoning) - {"effort", "summary", "generate_summary"}:
        raise refused(f'reasoning must be {{"effort": ...}}, got {reasoning!r:.80}', "reasoning")
    for name in ("summary", "generate_summary"):
        if reasoning.get(name) is not None:
            raise refused(f"reasoning.{name} {reasoning[name]!r:.80} is not served: pdserve writes no summary "
                          "(a thinking model's reasoning item holds its reasoning); leave it out", "reasoning")
    return reasoning.get("effort")


def renamed(err: OpenAIError) -> OpenAIError:
    """A chat check's error in the Responses request's own names."""
    if isinstance(err, Refused):
        return err
    for chat, responses in RENAMED.items():
        err.message = err.message.replace(chat, responses)
        err.param = responses if err.param == chat else err.param
    return err


def _format(fmt) -> dict:
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise refused('text.format must be {"type": "text" | "json_object" | "json_schema"}, '
                      f"got {fmt!r:.80}", "text")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description")
                                                   if k in fmt}}


def _tool(i: int, tool) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else tool
        raise refused(f"tools[{i}] of type {kind!r:.80} is not served: pdserve calls function tools "
                      "only, which the client runs", "tools")
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


def _messages(given, instructions) -> list[dict]:
    messages = [] if instructions is None else [{"role": "system", "content": instructions}]
    if isinstance(given, str):
        return [*messages, {"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise refused(f"input must be a text or a non-empty list of items, got {given!r:.80}", "input")
    for i, item in enumerate(given):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and "role" in item:
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append({"role": role, "content": _text(i, item.get("content"))})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if messages and messages[-1]["role"] == "assistant":  # the calls of one answer: one turn
                messages[-1] = {**messages[-1], "tool_calls": [*messages[-1].get("tool_calls", []), call]}
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else _text(i, output)})
        elif kind != "reasoning":  # a model's earlier reasoning: templates leave it out
            raise refused(f"input[{i}] must be a message, function_call, function_call_output or reasoning "
                          f"item, got {item!r:.80}", "input")
    return messages


def _text(i: int, content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in TEXT_PARTS
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise refused(f"input[{i}].content must be a text or a list of input_text parts (pdserve serves "
                  f"text only), got {content!r:.80}", "input")


class ResponseStream:
    """One response, built from its chat answer's chunks: `start`, `feed` each chunk (with
    usage), `end`; each gives the stream events to send. `response` is the whole."""

    def __init__(self, request_id: str, model: str, body: dict, store: bool = False) -> None:
        self.response = {
            "id": f"resp_{request_id}", "object": "response", "created_at": now(), "status": "in_progress",
            "model": model, "output": [], "error": None, "incomplete_details": None,
            "instructions": body.get("instructions"), "metadata": body.get("metadata") or {},
            "max_output_tokens": body.get("max_output_tokens"), "temperature": body.get("temperature"),
            "top_p": body.get("top_p"), "tools": body.get("tools") or [],
            "tool_choice": body.get("tool_choice", "auto"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "text": body.get("text") or {"format": {"type": "text"}}, "store": store, "usage": None,
            "reasoning": {"effort": _effort(body.get("reasoning")), "summary": None},
            "previous_response_id": body.get("previous_response_id"), "background": bool(body.get("background")),
            "conversation": None if body.get("conversation") is None else {
                "id": body["conversation"].get("id") if isinstance(body["conversation"], dict) else body["conversation"]}}
        self.sequence = 0
        self.obfuscate = bool((body.get("stream_options") or {}).get("include_obfuscation"))  # padded deltas
        self.open: list[int] = []  # output indexes of the items not done yet, oldest first
        self.calls: dict[int, int] = {}  # a chat tool call's index -> its item's output index
        self.finish: str | None = None

    def start(self) -> list[dict]:
        return [*self.created(), *self.running()]

    def created(self) -> list[dict]:
        return [self._event("response.created", response=self.response)]

    def running(self) -> list[dict]:
        self.response["status"] = "in_progress"
        return [self._event("response.in_progress", response=self.response)]

    def feed(self, chunk: dict) -> list[dict]:
        if chunk.get("usage"):
            usage = chunk["usage"]
            self.response["usage"] = {
                "input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                "total_tokens": usage["total_tokens"],
                "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
                "output_tokens_details": {"reasoning_tokens": 0}}
        events = []
        for choice in chunk["choices"]:
            delta = choice["delta"]
            if delta.get("reasoning_content"):
                events += self._text("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                events += self._text("message", delta["content"], (choice.get("logprobs") or {}).get("content"))
            for call in delta.get("tool_calls") or ():
                events += self._call(call)
            self.finish = choice["finish_reason"] or self.finish
        return events

    def end(self) -> list[dict]:
        """The last events: every item done, then the response completed or incomplete."""
        cut = self.finish == "length"
        events = self._close("incomplete" if cut else "completed")
        self.response["status"] = "incomplete" if cut else "completed"
        if cut:
            self.response["incomplete_details"] = {"reason": "max_output_tokens"}
        return [*events, self._event(f"response.{self.response['status']}", response=self.response)]

    def failed(self, err: OpenAIError) -> list[dict]:
        """The last events of a response whose serving failed after it began: OpenAI's
        `error` event, then the response failed with that error."""
        error = err.body()["error"]
        self.response.update(status="failed", error={"code": error["code"], "message": error["message"]})
        fields = {k: error[k] for k in ("code", "message", "param")}  # its `type` is the event's
        return [self._event("error", **fields), self._event("response.failed", response=self.response)]

    def _text(self, kind: str, text: str, logprobs: list | None = None) -> list[dict]:
        """Events for more of the reasoning or the message (`logprobs`: its tokens', when
        asked), in the item of that kind open last or a new one."""
        events, output = [], self.response["output"]
        if not (self.open and output[self.open[-1]]["type"] == kind):
            events = self._close("completed")
            item = {"type": kind, "id": f"{'msg' if kind == 'message' else 'rs'}_{uuid.uuid4().hex}",
                    "status": "in_progress", "content": []}
            item.update({"role": "assistant"} if kind == "message" else {"summary": []})
            events += self._add(item)
            part = {"type": "output_text", "text": "", "annotations": [],
                    **({"logprobs": []} if logprobs is not None else {})} if kind == "message" else \
                {"type": "reasoning_text", "text": ""}
            item["content"].append(part)
            events.append(self._event("response.content_part.added", **self._at(item, self.open[-1]), part=part))
        index = self.open[-1]
        part = output[index]["content"][0]
        part["text"] += text
        if logprobs is not None:
            part.setdefault("logprobs", []).extend(logprobs)
        name = "output_text" if kind == "message" else "reasoning_text"
        return [*events, self._event(f"response.{name}.delta", **self._at(output[index], index), delta=text,
                                     **({} if logprobs is None else {"logprobs": logprobs}))]

    def _call(self, delta: dict) -> list[dict]:
        if "id" in delta:
            item = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": delta["id"],
                    "name": delta["function"]["name"], "arguments": "", "status": "in_progress"}
            events = [*self._close("completed"), *self._add(item)]
            self.calls[delta["index"]] = self.open[-1]
        else:
            events = []
        index = self.calls[delta["index"]]
        item = self.response["output"][index]
        arguments = delta["function"]["arguments"]
        item["arguments"] += arguments
        return [*events, self._event("response.function_call_arguments.delta", item_id=item["id"],
                                     output_index=index, delta=arguments)]

    def _add(self, item: dict) -> list[dict]:
        self.response["output"].append(item)
        self.open.append(len(self.response["output"]) - 1)
        return [self._event("response.output_item.added", output_index=self.open[-1], item=item)]

    def _close(self, status: str) -> list[dict]:
        """Events that end the open items: all of them, as the model writes one at a time."""
        events = []
        for index in self.open:
            item = self.response["output"][index]
            item["status"] = status
            if item["type"] == "function_call":
                events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                          output_index=index, arguments=item["arguments"]))
            else:
                part = item["content"][0]
                name = "output_text" if item["type"] == "message" else "reasoning_text"
                events += [self._event(f"response.{name}.done", **self._at(item, index), text=part["text"]),
                           self._event("response.content_part.done", **self._at(item, index), part=part)]
            events.append(self._event("response.output_item.done", output_index=index, item=item))
        self.open = []
        return events

    @staticmethod
    def _at(item: dict, index: int) -> dict:
        """Where an event's text goes: the item, its place in the output, its one part."""
        return {"item_id": item["id"], "output_index": index, "content_index": 0}

    def _event(self, kind: str, **fields) -> dict:
        """An event as things are now: the items and the response in it are copies."""
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **copy.deepcopy(fields)}
