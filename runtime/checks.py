"""Checks of wire values that every node's edge makes before a role sees a request.

Each raises `ValueError` naming the field and the value (the edge answers
INVALID_ARGUMENT). What a value means to a role (a KV window) is checked by the role's own
rules (`kvtransfer.window`); sampling values by the rules every layer shares
(`pdserve.sampling`), once `sampling_from_pb` has made them a `SamplingParams`.
"""

from __future__ import annotations

from pdserve.proto import pdserve_pb2
from pdserve.sampling import SamplingParams, StructuredOutput

MAX_REQUEST_ID_CHARS = 256


def check_request_id(request_id: str, *, required: bool = True) -> None:
    """A printable id of at most `MAX_REQUEST_ID_CHARS` characters (empty when not
    `required`: the node then assigns one)."""
    if required and not request_id:
        raise ValueError(f"request_id must be non-empty, got {request_id!r}")
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise ValueError(f"request_id must be at most {MAX_REQUEST_ID_CHARS} characters, got "
                         f"{request_id[:40] + '...'!r}")
    if any(not c.isprintable() for c in request_id):
        raise ValueError(f"request_id must be printable, got {request_id!r}")


def sampling_from_pb(pb: pdserve_pb2.SamplingParams) -> SamplingParams:
    """SamplingParams; unset optional fields keep the defaults. Not checked here: the caller
    checks them (`SamplingParams.validate`), knowing the model's vocabulary and context."""
    d = SamplingParams()

    def given(name: str, default):
        return getattr(pb, name) if pb.HasField(name) else default

    return SamplingParams(
        max_tokens=given("max_tokens", d.max_tokens), temperature=given("temperature", d.temperature),
        top_p=given("top_p", d.top_p), top_k=given("top_k", d.top_k), min_p=pb.min_p,
        seed=given("seed", d.seed), n=given("n", d.n), stop=list(pb.stop),
        stop_token_ids=list(pb.stop_token_ids), ignore_eos=pb.ignore_eos,
        logprobs=given("logprobs", d.logprobs),
        prompt_logprobs=given("prompt_logprobs", d.prompt_logprobs),
        presence_penalty=pb.presence_penalty, frequency_penalty=pb.frequency_penalty,
        repetition_penalty=given("repetition_penalty", d.repetition_penalty), logit_bias=dict(pb.logit_bias),
        structured_output=structured_from_pb(pb.structured_output) if pb.HasField("structured_output") else None,
        min_tokens=pb.min_tokens, bad_words=list(pb.bad_words),
        include_stop_str_in_output=pb.include_stop_str_in_output,
        skip_special_tokens=given("skip_special_tokens", d.skip_special_tokens),
        allowed_token_ids=list(pb.allowed_token_ids) or None)


def structured_from_pb(pb: pdserve_pb2.StructuredOutput) -> StructuredOutput:
    """The message's one kind and its spec ("" as the kind when none is set: refused by
    `StructuredOutput.validate`)."""
    kind = pb.WhichOneof("kind") or ""
    if kind == "choice":
        return StructuredOutput(kind, tuple(pb.choice.choices))
    return StructuredOutput(kind, None if kind in ("", "json_object") else getattr(pb, kind))
