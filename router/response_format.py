"""What an OpenAI request asks its text to match: OpenAI's `response_format` and vLLM's
`structured_outputs`, as pdserve's `StructuredOutput` message."""

from __future__ import annotations

import json

from pdserve.proto import pdserve_pb2


class BadStructure(ValueError):
    """A 400 naming `param`, the field that asked for the structure."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def structured_output(body: dict) -> pdserve_pb2.StructuredOutput | None:
    """OpenAI's `response_format` (json_object, or json_schema with its `schema`) or vLLM's
    `structured_outputs` (exactly one of json, json_object, regex, choice, grammar) as
    pdserve's message; None for free text; BadStructure for what neither field can say.
    Whether it compiles is the decode node's check (engine/structured.py)."""
    fmt, extra = body.get("response_format"), body.get("structured_outputs")
    kind = fmt.get("type") if isinstance(fmt, dict) else fmt
    if fmt is not None and kind not in ("text", "json_object", "json_schema"):
        raise BadStructure('response_format must be {"type": "text" | "json_object" | "json_schema"}, '
                           f"got {fmt!r:.80}", "response_format")
    if kind in ("json_object", "json_schema") and extra is not None:
        raise BadStructure("response_format and structured_outputs ask for two structures: send one",
                           "structured_outputs")
    if kind == "json_object":
        return pdserve_pb2.StructuredOutput(json_object=True)
    if kind == "json_schema":
        described = fmt.get("json_schema")
        schema = described.get("schema") if isinstance(described, dict) else None
        if not isinstance(schema, dict):
            raise BadStructure(f"response_format.json_schema.schema must be a JSON Schema object, "
                               f"got {schema!r:.80}", "response_format")
        return pdserve_pb2.StructuredOutput(json_schema=json.dumps(schema))
    return None if extra is None else _vllm_structure(extra)


def _vllm_structure(extra) -> pdserve_pb2.StructuredOutput:
    given = {k: v for k, v in extra.items() if v not in (None, False)} if isinstance(extra, dict) else None
    if not given or len(given) > 1 or not set(given) <= {"json", "json_object", "regex", "choice", "grammar"}:
        raise BadStructure("structured_outputs must set exactly one of json, json_object, regex, choice, "
                           f"grammar, got {extra!r:.80}", "structured_outputs")
    (name, value), = given.items()
    try:
        if name == "json":
            return pdserve_pb2.StructuredOutput(json_schema=value if isinstance(value, str) else json.dumps(value))
        if name == "choice":
            if not isinstance(value, list):  # protobuf would take a string as its characters
                raise TypeError
            return pdserve_pb2.StructuredOutput(choice=pdserve_pb2.Choices(choices=value))
        return pdserve_pb2.StructuredOutput(**{name: value})
    except (TypeError, ValueError):
        raise BadStructure(f"structured_outputs.{name} has the wrong type, got {value!r:.80}",
                           "structured_outputs") from None
