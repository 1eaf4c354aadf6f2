"""Tool calling over gRPC: a Generate request's `tools`, `tool_choice` and
`parallel_tool_calls`, and its conversation's calls and results, go through the very code
the OpenAI API's do (router/tools.py: the checks, the chat template or the folded system
message, the structure "required" and a forced call hold the answer to, the model family's
call dialect). The answer's calls come back parsed (`CallAnswers`): each choice's `text`
streams its content, the markup of its calls held back, and its last message carries the
calls whole in `tool_calls`, with finish_reason "tool_calls" when it stopped by itself.
"""

from __future__ import annotations

import json

from pdserve.proto import pdserve_pb2

from .response_format import BadStructure
from .tools import MODES, CallStream, Tools, merge_calls, tools_from_body


def tools_of_request(request, dialect) -> Tools | None:
    """The request's checked tools, or None; ValueError names the field and the value."""
    if not request.tools and not request.tool_choice:
        return None
    if request.tools and not request.messages:
        raise ValueError("tools are offered in a conversation: send messages, not a prompt")
    functions = []
    for i, tool in enumerate(request.tools):
        try:
            parameters = json.loads(tool.parameters) if tool.parameters else None
        except ValueError as err:
            raise ValueError(f"tools[{i}].parameters must be a JSON Schema as JSON text, got "
                             f"{tool.parameters!r:.80} ({err})") from None
        functions.append({"type": "function", "function": {
            "name": tool.name, **({"description": tool.description} if tool.description else {}),
            **({"parameters": parameters} if parameters is not None else {})}})
    choice = request.tool_choice or None
    if choice is not None and choice not in MODES:
        choice = {"type": "function", "function": {"name": choice}}
    body = {"tools": functions, "tool_choice": choice,
            "parallel_tool_calls": request.parallel_tool_calls if request.HasField("parallel_tool_calls") else None}
    try:
        return tools_from_body(body, dialect)
    except BadStructure as err:
        raise ValueError(str(err).replace(".function.", ".")) from None


def held_to(sampling, tools: Tools | None):
    """`sampling` with the structure the tool choice holds the answer to, if any, and with
    special tokens kept where the calls' markers are such (unless the request says)."""
    forced = tools.structure() if tools is not None else None
    markers = tools is not None and tools.reads_special_tokens and not sampling.HasField("skip_special_tokens")
    if forced is None and not markers:
        return sampling
    if forced is not None and sampling.HasField("structured_output"):
        raise ValueError(f"tool_choice {tools.mode!r} holds the answer to the tools' arguments, so it cannot "
                         "also follow sampling.structured_output: send one")
    out = type(sampling)()
    out.CopyFrom(sampling)
    if forced is not None:
        out.structured_output.CopyFrom(forced)
    if markers:
        out.skip_special_tokens = False
    return out


class CallAnswers:
    """Rewrites a request's GenerateResponse messages: each choice's text as its content,
    and its calls on its last message."""

    def __init__(self, tools: Tools) -> None:
        self.tools = tools
        self._streams: dict[int, CallStream] = {}
        self._calls: dict[int, list[dict]] = {}

    def rewrite(self, msg: pdserve_pb2.GenerateResponse) -> pdserve_pb2.GenerateResponse:
        if msg.HasField("usage") and not msg.text and not msg.finish_reason:
            return msg  # the request's usage alone
        stream = self._streams.setdefault(msg.index, CallStream(self.tools))
        calls = self._calls.setdefault(msg.index, [])
        content, deltas = stream.feed(msg.text)
        merge_calls(calls, deltas)
        if msg.finish_reason:
            more, deltas, msg.finish_reason = stream.finish(msg.finish_reason)
            content += more
            merge_calls(calls, deltas)
            msg.tool_calls.extend(pdserve_pb2.ToolCall(id=c["id"], name=c["function"]["name"],
                                                       arguments=c["function"]["arguments"]) for c in calls)
        msg.text = content
        return msg
