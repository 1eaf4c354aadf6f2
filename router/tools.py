"""Tool calling on /v1/chat/completions: OpenAI's `tools` and `tool_choice`, the calls and
results a conversation carries, and the calls an answer makes.

- The tools reach the model through its chat template's `tools` variable when the template
  has one (Llama 3.1's, Qwen2.5's, Mistral's, Hermes'). A template without one (SmolLM2's)
  gets them in a system message that lists the functions and asks for each call as a
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` block (Hermes' shape, which
  Qwen and SmolLM3 were trained on); earlier calls are written back in that shape and tool
  results come as user turns in `<tool_response>` tags, which every template takes.
- `tool_choice` decides what the answer may be:
  - "none": text. The tools are left out of the prompt, so the model is not invited to
    write a call it may not make (vLLM's `--exclude-tools-when-tool-choice-none`).
  - "auto" (the default with tools): text, in which each `<tool_call>` block naming a tool
    with an arguments object becomes a call (the first alone when `parallel_tool_calls` is
    false). A block that does not parse leaves the whole answer as text, never half of it.
  - "required": the answer is held by structured output (engine/structured.py) to a JSON
    array of one or more `{"name", "arguments"}`, each naming a tool and fitting its
    `parameters`; one call when `parallel_tool_calls` is false.
  - a named function: the answer is held to its `parameters` and is the call's arguments.
- Streaming: a named call's arguments stream as they come. The text of "auto" streams
  until a `<tool_call>` begins (a possible start is held back); calls come whole when the
  choice ends, as "required"'s do.
- Finish reason: "tool_calls" when an answer that stopped by itself made calls; a named
  call ends "stop", as OpenAI's does when a function is forced.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from pdserve.proto import pdserve_pb2

from .response_format import BadStructure

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
OPEN, CLOSE = "<tool_call>", "</tool_call>"
BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.S)
MODES = ("none", "auto", "required")
NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Tools:
    """A request's checked tools. `functions`: name to {"name", "description"?,
    "parameters"}; `mode`: "none", "auto", "required" or "function" (then `function` is the
    one forced); `parallel`: whether one answer may make several calls."""
    functions: dict[str, dict]
    mode: str
    function: str | None = None
    parallel: bool = True

    def for_template(self) -> list[dict]:
        return [{"type": "function", "function": f} for f in self.functions.values()]

    def structure(self) -> pdserve_pb2.StructuredOutput | None:
        """What the answer is held to, or None for free text."""
        if self.mode == "function":
            schema = self.functions[self.function]["parameters"]
        elif self.mode == "required":
            calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                      "properties": {"name": {"const": name}, "arguments": f["parameters"]}}
                     for name, f in self.functions.items()]
            schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls},
                      **({} if self.parallel else {"maxItems": 1})}
        else:
            return None
        return pdserve_pb2.StructuredOutput(json_schema=json.dumps(schema))


def tools_from_body(body: dict) -> Tools | None:
    """The request's `tools`, `tool_choice` and `parallel_tool_calls`, checked; None without
    tools. BadStructure (a 400) names the field and the value that broke the rule."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise BadStructure(f"parallel_tool_calls must be a boolean, got {parallel!r:.80}", "parallel_tool_calls")
    if not tools:
        if choice not in (None, "none"):
            raise BadStructure(f"tool_choice {choice!r:.80} needs tools: list the functions the model "
                               "may call in tools", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise BadStructure(f"tools must be a list of functions, got {tools!r:.80}", "tools")
    functions: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        function = _function(i, tool)
        if function["name"] in functions:
            raise BadStructure(f"tools[{i}].function.name {function['name']!r} is given twice: "
                               "each tool needs its own name", "tools")
        functions[function["name"]] = function
    named = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if isinstance(named, dict) and named.get("name") in functions:
        return Tools(functions, "function", named["name"], parallel is not False)
    if choice is None or choice in MODES:
        return Tools(functions, choice or "auto", None, parallel is not False)
    if isinstance(named, dict):
        raise BadStructure(f"tool_choice names function {named.get('name')!r:.80}, which is not in tools "
                           f"({', '.join(functions)})", "tool_choice")
    raise BadStructure('tool_choice must be "none", "auto", "required" or {"type": "function", '
                       f'"function": {{"name": ...}}}}, got {choice!r:.80}', "tool_choice")


def _function(i: int, tool) -> dict:
    where = f"tools[{i}]"
    function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
    if not isinstance(function, dict):
        raise BadStructure(f'{where} must be {{"type": "function", "function": {{"name": ..., "parameters": '
                           f'...}}}}, got {tool!r:.80}', "tools")
    name, description = function.get("name"), function.get("description")
    parameters = function.get("parameters")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise BadStructure(f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-', "
                           f"got {name!r:.80}", "tools")
    if description is not None and not isinstance(description, str):
        raise BadStructure(f"{where}.function.description must be a string, got {description!r:.80}", "tools")
    if parameters is not None and not isinstance(parameters, dict):
        raise BadStructure(f"{where}.function.parameters must be a JSON Schema object, "
                           f"got {parameters!r:.80}", "tools")
    return {"name": name, **({"description": description} if description else {}),
            "parameters": parameters or NO_PARAMETERS}


# ---- the prompt ---------------------------------------------------------------------------
def template_inputs(messages: list[dict], tools: Tools | None, template: str | None):
    """(messages, tools) to hand the chat template: as they are where the template knows
    tools, else the tools described in a system message and the calls and results folded
    into text (the module's note)."""
    offered = tools if tools is not None and tools.mode != "none" else None
    if template is not None and "tools" in template:
        return ([{**m, "tool_calls": [_as_object(c) for c in m["tool_calls"]]} if "tool_calls" in m else m
                 for m in messages], offered.for_template() if offered else None)
    folded: list[dict] = []
    for m in messages:
        if m["role"] == "tool":
            text = f"<tool_response>\n{m['content']}\n</tool_response>"
            if folded and folded[-1].get("tool_results"):  # one turn for a call's results
                folded[-1] = {**folded[-1], "content": folded[-1]["content"] + "\n" + text}
            else:
                folded.append({"role": "user", "content": text, "tool_results": True})
        elif "tool_calls" in m:
            blocks = [f"{OPEN}\n{json.dumps(_as_object(c)['function'], ensure_ascii=False)}\n{CLOSE}"
                      for c in m["tool_calls"]]
            folded.append({"role": m["role"], "content": "\n".join(filter(None, [m["content"], *blocks]))})
        else:
            folded.append({"role": m["role"], "content": m["content"]})
    folded = [{"role": m["role"], "content": m["content"]} for m in folded]
    if offered:
        described = _described(offered)
        if folded and folded[0]["role"] == "system":
            folded[0] = {"role": "system", "content": folded[0]["content"] + "\n\n" + described}
        else:
            folded.insert(0, {"role": "system", "content": described})
    return folded, None


def _described(tools: Tools) -> str:
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools.for_template())
    return ("You may call functions to answer. They are listed here, one JSON object per line:\n"
            f"<tools>\n{listed}\n</tools>\n"
            "To call one, write a JSON object with the function's name and its arguments inside "
            f"{OPEN}{CLOSE} tags, one block per call:\n"
            f'{OPEN}\n{{"name": <function name>, "arguments": <arguments object>}}\n{CLOSE}')


def _as_object(call: dict) -> dict:
    """A call whose arguments, a JSON text in OpenAI's messages, are an object, as templates
    (and the folded text) write them."""
    arguments = call["function"]["arguments"]
    try:
        arguments = json.loads(arguments) if arguments else {}
    except ValueError:
        pass  # not JSON: the template gets the text as it came
    return {**call, "function": {"name": call["function"]["name"], "arguments": arguments}}


# ---- the answer ---------------------------------------------------------------------------
class CallStream:
    """One choice's text as OpenAI's content and tool-call deltas, as it arrives."""

    def __init__(self, tools: Tools) -> None:
        self.tools = tools
        self.held = ""          # text not given out yet
        self.calling = False    # "auto": a <tool_call> began, the rest waits for the end
        self.opened = False     # "function": the call's first delta went out

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """(content, tool-call deltas) to send for the next `text`."""
        mode = self.tools.mode
        if mode == "none":
            return text, []
        if mode == "function":
            if not self.opened:
                self.opened = True
                return "", [_call(0, self.tools.function, text)]
            return "", [{"index": 0, "function": {"arguments": text}}] if text else []
        self.held += text
        if mode == "required" or self.calling:
            return "", []
        at = self.held.find(OPEN)
        if at >= 0:
            self.calling = True
            content, self.held = self.held[:at], self.held[at:]
            return content, []
        keep = next(k for k in range(min(len(OPEN) - 1, len(self.held)), -1, -1)
                    if self.held.endswith(OPEN[:k]))  # what may yet become `<tool_call>`
        cut = len(self.held) - keep
        content, self.held = self.held[:cut], self.held[cut:]
        return content, []

    def finish(self, reason: str) -> tuple[str, list[dict], str]:
        """(content, tool-call deltas, finish reason) when the choice ends."""
        if self.tools.mode == "function":
            return "", [] if self.opened else self.feed("")[1], reason
        held, self.held = self.held, ""
        if self.tools.mode == "none":
            return held, [], reason
        parsed = _array(held, self.tools) if self.tools.mode == "required" else \
            _blocks(held, self.tools) if self.calling else None
        if not parsed:
            return held, [], reason
        content, calls = parsed
        deltas = [_call(i, name, arguments) for i, (name, arguments) in enumerate(calls)]
        return content, deltas, "tool_calls" if reason == "stop" else reason


def merge_calls(calls: list[dict], deltas: list[dict]) -> None:
    """Add streamed `deltas` into the whole message's `calls`."""
    for delta in deltas:
        if "id" in delta:
            calls.append({"id": delta["id"], "type": "function", "function": dict(delta["function"])})
        else:
            calls[delta["index"]]["function"]["arguments"] += delta["function"]["arguments"]


def _call(index: int, name: str, arguments: str) -> dict:
    return {"index": index, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _one(value, tools: Tools) -> tuple[str, str] | None:
    """(name, arguments text) of a call object naming a tool, else None."""
    if not isinstance(value, dict) or value.get("name") not in tools.functions:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return (value["name"], json.dumps(arguments, ensure_ascii=False)) if isinstance(arguments, dict) else None


def _array(text: str, tools: Tools):
    try:
        value = json.loads(text)
    except ValueError:
        return None  # cut short (length): the text is the answer
    calls = [_one(v, tools) for v in value] if isinstance(value, list) else [None]
    return ("", calls) if calls and None not in calls else None


def _blocks(text: str, tools: Tools):
    calls, rest, at = [], [], 0
    for block in BLOCK.finditer(text):
        rest.append(text[at:block.start()])
        at = block.end()
        try:
            call = _one(json.loads(block.group(1)), tools)
        except ValueError:
            return None
        if call is None:
            return None
        calls.append(call)
    rest.append(text[at:])
    return "".join(rest).strip(), calls if tools.parallel else calls[:1]
