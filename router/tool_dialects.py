"""How a model writes the tool calls of an "auto" answer, by its chat template's family
(what vLLM's `--tool-call-parser` names; here the template decides, `dialect_of`):

- "hermes": `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks anywhere in
  the text. Qwen2.5, Qwen3 and Hermes templates ask for these, and so does the system
  message pdserve writes for a template that knows no tools (router/tools.py).
- "llama3_json": the answer is one or more `{"name": ..., "parameters": {...}}` objects,
  `;` between them, after an optional `<|python_tag|>` (Llama 3.1 to 3.3's JSON calls).
- "mistral": the answer is `[TOOL_CALLS]` and a JSON array of `{"name", "arguments"}`
  (Mistral's v3 tokenizer). `[TOOL_CALLS]` is a special token, dropped from the text as the
  others are, so an answer that begins with the array is a call as well. Mistral's
  templates refuse call ids that are not 9 letters or digits, so its calls get such ids.
  From its v11 tokenizer on (Magistral, Devstral, Mistral Small 3.2: a template that writes
  `[ARGS]`), each call is `[TOOL_CALLS]name[ARGS]{...}`, after any text, one after another:
  both markers are special tokens, so such an "auto" request keeps special tokens in its
  text (`skip_special_tokens: false`, unless the request says otherwise) for them to be read.
- "glm45": `<tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value>...</tool_call>`
  blocks anywhere in the text (GLM-4.5, 4.6, 4.7: a template that writes `<arg_key>`), a
  value as written where the function's parameter is a string, else read as JSON (as the
  template writes one). Its markers may be special tokens, so such an "auto" request keeps
  special tokens in its text as Mistral v11's does.
- "pythonic": the answer is a Python list of calls with keyword arguments,
  `[get_weather(city="Paris"), get_time()]` (Llama 4's template, and Llama 3.2's pythonic
  one), each argument a literal; read with `ast`, never run.

In the last three a call can only begin the answer: an answer whose first non-space
characters are a call's start is held back until it ends, then given as calls, or whole as
text when it does not parse; any other answer streams as it comes.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
HERMES_BLOCK = re.compile(re.escape(HERMES_OPEN) + r"(.*?)(?:" + re.escape(HERMES_CLOSE) + r"|\Z)", re.S)
PYTHON_TAG, TOOL_CALLS, ARGS, CALL_ID = "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
GLM_ARG = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


@dataclass(frozen=True)
class Dialect:
    name: str
    starts: tuple[str, ...]  # what a call begins with ("hermes": anywhere, else the answer)
    anywhere: bool
    special_tokens: bool = False  # its calls' markers are special tokens the text must keep

    def call_id(self) -> str:
        return uuid.uuid4().hex[:9] if self.name == "mistral" else f"call_{uuid.uuid4().hex[:24]}"

    def parse(self, text: str, functions: dict) -> tuple[str, list[tuple[str, str]]] | None:
        """(content left, [(name, arguments text)]) of an answer that makes calls to
        `functions`, or None when any part of it does not parse as a call to one of them."""
        if self.name == "glm45":
            return _blocks(text, functions, _glm_call)
        if self.special_tokens:
            return _marked(text, functions)
        if self.anywhere:
            return _blocks(text, functions)
        if self.name == "pythonic":
            return _pythonic(text, functions)
        head, marker = text.strip(), self.starts[0]  # the special token, where it was kept
        head = head[len(marker):].lstrip() if head.startswith(marker) else head
        values, at = _values(head, ";" if self.name == "llama3_json" else "")
        if not values:
            return None
        if self.name == "mistral":
            values = values[0] if len(values) == 1 and isinstance(values[0], list) else [None]
        calls = [call_of(v, functions) for v in values]
        return (head[at:].strip(), calls) if calls and None not in calls else None


HERMES = Dialect("hermes", (HERMES_OPEN,), anywhere=True)
MISTRAL_V11 = Dialect("mistral", (TOOL_CALLS,), anywhere=True, special_tokens=True)
GLM45 = Dialect("glm45", (HERMES_OPEN,), anywhere=True, special_tokens=True)
DIALECTS = {d.name: d for d in (HERMES, GLM45, Dialect("llama3_json", (PYTHON_TAG, "{"), anywhere=False),
                                 Dialect("mistral", (TOOL_CALLS, "["), anywhere=False),
                                 Dialect("pythonic", ("[",), anywhere=False))}


def dialect_of(chat_template: str | None) -> Dialect:
    """The dialect a chat template asks its model to call tools in; Hermes' for a template
    that knows no tools (pdserve's system message asks for it) or is none of the others."""
    if not isinstance(chat_template, str) or "tools" not in chat_template:
        return HERMES
    if TOOL_CALLS in chat_template:
        return MISTRAL_V11 if ARGS in chat_template else DIALECTS["mistral"]
    if "<arg_key>" in chat_template:
        return GLM45
    if "[func_name1(" in chat_template:  # "put it in the format of [func_name1(params_name1=...), ...]"
        return DIALECTS["pythonic"]
    if HERMES_OPEN in chat_template:
        return HERMES
    if PYTHON_TAG in chat_template or '"parameters": dictionary' in chat_template:
        return DIALECTS["llama3_json"]
    return HERMES


def dialect_named(name: str, chat_template: str | None) -> Dialect:
    """`--tool-call-parser NAME`'s dialect; "mistral" in the form the template writes."""
    if name == "mistral" and isinstance(chat_template, str) and ARGS in chat_template:
        return MISTRAL_V11
    return DIALECTS[name]


def call_of(value, functions: dict) -> tuple[str, str] | None:
    """(name, arguments text) of a call object naming one of `functions`, else None."""
    if not isinstance(value, dict) or value.get("name") not in functions:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return (value["name"], json.dumps(arguments, ensure_ascii=False)) if isinstance(arguments, dict) else None


def _values(text: str, separator: str) -> tuple[list, int]:
    """The JSON values that begin `text`, `separator` (and white space) between them, and
    where the text after them begins; ([], 0) when one does not parse."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while True:
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return [], 0
        values.append(value)
        rest = text[at:].lstrip()
        if not separator or not rest.startswith(separator):
            return values, at
        rest = rest[len(separator):].lstrip()
        at = len(text) - len(rest)
        if not rest:  # a separator after the last one
            return values, at


def _blocks(text: str, functions: dict, read=lambda inside, _: json.loads(inside)):
    """`<tool_call>` blocks, each `read` into a call object (Hermes': a JSON one)."""
    calls, rest, at = [], [], 0
    for found in HERMES_BLOCK.finditer(text):
        rest.append(text[at:found.start()])
        at = found.end()
        try:
            call = call_of(read(found.group(1), functions), functions)
        except ValueError:
            return None
        if call is None:
            return None
        calls.append(call)
    rest.append(text[at:])
    return "".join(rest).strip(), calls


def _glm_call(inside: str, functions: dict) -> dict:
    """GLM-4.5's `name<arg_key>k</arg_key><arg_value>v</arg_value>...` as a call object;
    ValueError where anything else is in it."""
    name, _, args = inside.partition("<arg_key>")
    args = "<arg_key>" + args if _ else ""
    pairs, at = [], 0
    for found in GLM_ARG.finditer(args):
        if found.start() != at:
            raise ValueError("text between arguments")
        pairs.append(found.groups())
        at = found.end()
    if args[at:].strip():
        raise ValueError("text after the arguments")
    properties = (functions.get(name.strip(), {}).get("parameters") or {}).get("properties") or {}
    return {"name": name.strip(), "arguments": {k: _glm_value(v, properties.get(k)) for k, v in pairs}}


def _glm_value(text: str, schema):
    if isinstance(schema, dict) and schema.get("type") == "string":
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text  # a string the schema does not type


def _marked(text: str, functions: dict):
    """Mistral v11's `text[TOOL_CALLS]name[ARGS]{...}[TOOL_CALLS]...` (v13 adds
    `[CALL_ID]id` before `[ARGS]`, an id it chose and that is not kept)."""
    content, marker, rest = text.partition(TOOL_CALLS)
    if not marker:
        return None
    calls = []
    for part in rest.split(TOOL_CALLS):
        name, marker, arguments = part.partition(ARGS)
        values, at = _values(arguments.strip(), "")
        if not marker or len(values) != 1 or arguments.strip()[at:].strip():
            return None
        calls.append(call_of({"name": name.partition(CALL_ID)[0].strip(), "arguments": values[0]}, functions))
    return (content.strip(), calls) if None not in calls else None


def _pythonic(text: str, functions: dict):
    """The answer as `[f(a=1), g()]`: each element a call of a listed function by name with
    keyword arguments of literal values (strings, numbers, lists, dicts, True/False/None)."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
        if not isinstance(tree, ast.List):
            return None
        calls = []
        for call in tree.elts:
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and not call.args
                    and all(k.arg for k in call.keywords)):
                return None
            calls.append({"name": call.func.id, "arguments": {k.arg: ast.literal_eval(k.value)
                                                              for k in call.keywords}})
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        return None
    found = [call_of(c, functions) for c in calls]
    return ("", found) if found and None not in found else None
