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
  - "auto" (the default with tools): text, in which the calls the model writes in its
    family's way (router/tool_dialects.py: Hermes' `<tool_call>` blocks, Llama 3's JSON,
    Mistral's `[TOOL_CALLS]`) become calls, the first alone when `parallel_tool_calls` is
    false. A call that does not parse leaves the whole answer as text, never half of it.
  - "required": the answer is held by structured output (engine/structured.py) to a JSON
    array of one or more `{"name", "arguments"}`, each naming a tool and fitting its
    `parameters`; one call when `parallel_tool_calls` is false.
  - a named function: the answer is held to its `parameters` and is the call's arguments.
- Streaming: a named call's arguments stream as they come. The text of "auto" streams
  until a call begins (a possible start is held back); calls come whole when the choice
  ends, as "required"'s do.
- Finish reason: "tool_calls" when an answer that stopped by itself made calls; a named
  call ends "stop", as OpenAI's does when a function is forced.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from pdserve.proto import pdserve_pb2

from .response_format import BadStructure
from .tool_dialects import HERMES, HERMES_CLOSE, HERMES_OPEN, Dialect, call_of

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MODES = ("none", "auto", "required")
NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Tools:
    """A request's checked tools. `functions`: name to {"name", "description"?,
    "parameters"}; `mode`: "none", "auto", "required" or "function" (then `function` is the
    one forced); `parallel`: whether one answer may make several calls; `dialect`: how the
    model writes calls (router/tool_dialects.py)."""
    functions: dict[str, dict]
    mode: str
    function: str | None = None
    parallel: bool = True
    dialect: Dialect = HERMES

    def for_template(self) -> list[dict]:
        return [{"type": "function", "function": f} for f in self.functions.values()]

    @property
    def reads_special_tokens(self) -> bool:
        """Whether the answer's text must keep special tokens for its calls to be read."""
        return self.mode == "auto" and self.dialect.special_tokens

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


def tools_from_body(body: dict, dialect: Dialect = HERMES) -> Tools | None:
    """The request's `tools`, `tool_choice` and `parallel_tool_calls`, checked, for a model
    that writes calls in `dialect`; None without tools. BadStructure (a 400) names the field
    and the value that broke the rule."""
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
        return Tools(functions, "function", named["name"], parallel is not False, dialect)
    if choice is None or choice in MODES:
        return Tools(functions, choice or "auto", None, parallel is not False, dialect)
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
            blocks = [f"{HERMES_OPEN}\n{json.dumps(_as_object(c)['function'], ensure_ascii=False)}\n{HERMES_CLOSE}"
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
            f"{HERMES_OPEN}{HERMES_CLOSE} tags, one block per call:\n"
            f'{HERMES_OPEN}\n{{"name": <function name>, "arguments": <arguments object>}}\n{HERMES_CLOSE}')


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
        self.calling = False    # "auto": a call began, the rest waits for the end
        self.texting = False    # "auto", a dialect whose calls begin the answer: this one did not
        self.opened = False     # "function": the call's first delta went out

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """(content, tool-call deltas) to send for the next `text`."""
        mode = self.tools.mode
        if mode == "none":
            return text, []
        if mode == "function":
            if not self.opened:
                self.opened = True
                return "", [self._call(0, self.tools.function, text)]
            return "", [{"index": 0, "function": {"arguments": text}}] if text else []
        self.held += text
        if mode == "required" or self.calling:
            return "", []
        dialect = self.tools.dialect
        if not dialect.anywhere:
            head = self.held.lstrip()
            if not self.texting and head.startswith(dialect.starts):
                self.calling = True
            elif not self.texting and any(s.startswith(head) for s in dialect.starts):
                pass  # may yet begin a call
            else:
                self.texting = True
                content, self.held = self.held, ""
                return content, []
            return "", []
        at = self.held.find(dialect.starts[0])
        if at >= 0:
            self.calling = True
            content, self.held = self.held[:at], self.held[at:]
            return content, []
        opener = dialect.starts[0]
        keep = next(k for k in range(min(len(opener) - 1, len(self.held)), -1, -1)
                    if self.held.endswith(opener[:k]))  # what may yet become the opener
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
            self.tools.dialect.parse(held, self.tools.functions) if self.calling else None
        if not parsed:
            return held, [], reason
        content, calls = parsed
        calls = calls if self.tools.parallel else calls[:1]
        deltas = [self._call(i, name, arguments) for i, (name, arguments) in enumerate(calls)]
        return content, deltas, "tool_calls" if reason == "stop" else reason

    def _call(self, index: int, name: str, arguments: str) -> dict:
        return {"index": index, "id": self.tools.dialect.call_id(), "type": "function",
                "function": {"name": name, "arguments": arguments}}


def merge_calls(calls: list[dict], deltas: list[dict]) -> None:
    """Add streamed `deltas` into the whole message's `calls`."""
    for delta in deltas:
        if "id" in delta:
            calls.append({"id": delta["id"], "type": "function", "function": dict(delta["function"])})
        else:
            calls[delta["index"]]["function"]["arguments"] += delta["function"]["arguments"]


def _array(text: str, tools: Tools):
    try:
        value = json.loads(text)
    except ValueError:
        return None  # cut short (length): the text is the answer
    calls = [call_of(v, tools.functions) for v in value] if isinstance(value, list) else [None]
    return ("", calls) if calls and None not in calls else None
