"""What `pdserve.client` hands back: typed results built from `pdserve.v1` messages, and the
one exception every failed call raises.

- `Completion`: a whole answer: every choice (`Choice`: index, text, token ids, finish
  reason, logprobs, tool calls) and the request's `Usage` (token counts, timings, `Route`).
- `Delta`: one streamed piece of one choice; the stream's last `Delta` carries `usage`.
- `PdserveError`: the gRPC status (`code`) and the server's message (`message`). It is a
  `grpc.aio.AioRpcError`, so code written against plain gRPC (`err.code()`,
  `err.details()`) keeps working.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

import grpc

from pdserve.proto import pdserve_pb2


@dataclass
class TopLogprob:
    token_id: int
    logprob: float
    token: str = ""  # the token's text, its id decoded alone


@dataclass
class TokenLogprob:
    """The chosen token's log-probability, and the `logprobs` most likely alternatives;
    `token` is its text (its id decoded alone, as the server's tokenizer has it)."""

    token_id: int
    logprob: float
    top: list[TopLogprob] = field(default_factory=list)
    token: str = ""
    rank: int | None = None  # a prompt token's: 1 + the tokens likelier than it


@dataclass
class Route:
    """Where the request ran and how much KV moved (set by a router; see RouteInfo)."""

    prefill_endpoint: str = ""
    decode_endpoint: str = ""
    prefix_matched_length: int = 0
    kv_window_begin: int = 0
    kv_window_end: int = 0
    remote_send_skipped: bool = False
    prefill_cached_tokens: int = 0
    skip_reason: str = ""


@dataclass
class Usage:
    """Token counts and timings of a request (seconds; see `Usage` in proto/pdserve.proto)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    cached_prompt_tokens: int = 0
    time_to_first_token_s: float = 0.0
    time_per_output_token_s: float = 0.0
    time_per_output_token_p90_s: float = 0.0
    queue_time_s: float = 0.0
    prefill_time_s: float = 0.0
    kv_transfer_time_s: float = 0.0
    route: Route | None = None  # None: a colocated node answered, no router


@dataclass
class ToolCall:
    """A call an answer made of one of the request's tools (`arguments`: JSON text)."""

    id: str
    name: str
    arguments: str


@dataclass
class Choice:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""  # "stop" | "length" | "abort" | "tool_calls"
    logprobs: list[TokenLogprob] | None = None  # one per token, when asked for
    tool_calls: list[ToolCall] = field(default_factory=list)  # with tools: the calls it made
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it


@dataclass
class Completion:
    """A whole answer. `text`, `token_ids`, `finish_reason` and `logprobs` are choice 0's."""

    request_id: str = ""
    choices: list[Choice] = field(default_factory=list)
    usage: Usage = field(default_factory=Usage)
    # `prompt_logprobs=N`: prompt tokens 1.. (the first has nothing before it), each with
    # its N likeliest alternatives
    prompt_logprobs: list[TokenLogprob] | None = None

    @property
    def text(self) -> str:
        return self.choices[0].text if self.choices else ""

    @property
    def token_ids(self) -> list[int]:
        return self.choices[0].token_ids if self.choices else []

    @property
    def finish_reason(self) -> str:
        return self.choices[0].finish_reason if self.choices else ""

    @property
    def stop_reason(self) -> str | int | None:
        return self.choices[0].stop_reason if self.choices else None

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        return self.choices[0].logprobs if self.choices else None

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self.choices[0].tool_calls if self.choices else []

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Delta:
    """New text and tokens of one choice; the stream's last Delta has `usage` (and no text)."""

    request_id: str
    index: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    logprobs: list[TokenLogprob] | None = None
    usage: Usage | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # in a choice's first Delta, when asked
    tool_calls: list[ToolCall] = field(default_factory=list)  # with tools: in a choice's last Delta
    stop_reason: str | int | None = None  # in a choice's last Delta: the stop string or id that ended it


@dataclass
class Model:
    """The model a router or node serves (`GetModelInfo`)."""

    id: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]
    role: str  # "router" | "both" (colocated)


class PdserveError(grpc.aio.AioRpcError):
    """A failed call: `code` (grpc.StatusCode) and the server's `message`; a refusal for
    load (RESOURCE_EXHAUSTED) says in `retry_after_s` when to try again."""

    def __init__(self, code: grpc.StatusCode, message: str,
                 trailing: grpc.aio.Metadata | None = None) -> None:
        super().__init__(code, grpc.aio.Metadata(), trailing or grpc.aio.Metadata(),
                         details=message)
        self.status, self.message = code, message
        retry_after = dict(trailing or ()).get("retry-after")
        self.retry_after_s = float(retry_after) if retry_after else None

    @classmethod
    def of(cls, err: grpc.aio.AioRpcError) -> "PdserveError":
        if isinstance(err, cls):
            return err
        return cls(err.code(), err.details() or "", err.trailing_metadata())

    def __str__(self) -> str:
        return f"{self.status.name}: {self.message}"


def logprobs_of(entries) -> list[TokenLogprob]:
    return [TokenLogprob(e.token_id, e.logprob,
                         [TopLogprob(t.token_id, t.logprob, t.token) for t in e.top], e.token, e.rank or None)
            for e in entries]


def usage_of(pb: pdserve_pb2.Usage) -> Usage:
    values = {f.name: getattr(pb, f.name) for f in fields(Usage) if f.name != "route"}
    route = None
    if pb.HasField("route"):
        route = Route(**{f.name: getattr(pb.route, f.name) for f in fields(Route)})
    return Usage(**values, route=route)


def delta_of(msg: pdserve_pb2.GenerateResponse, with_logprobs: bool) -> Delta:
    if msg.HasField("usage"):
        return Delta(msg.request_id, usage=usage_of(msg.usage))
    return Delta(msg.request_id, msg.index, msg.text, list(msg.token_ids), msg.finish_reason,
                 logprobs_of(msg.logprobs) if with_logprobs else None,
                 prompt_logprobs=logprobs_of(msg.prompt_logprobs) if msg.prompt_logprobs else None,
                 tool_calls=[ToolCall(c.id, c.name, c.arguments) for c in msg.tool_calls],
                 stop_reason=getattr(msg, msg.WhichOneof("stop_reason") or "", None))


class Gather:
    """Deltas into a Completion, choices in index order."""

    def __init__(self, with_logprobs: bool, with_prompt_logprobs: bool = False) -> None:
        self.completion = Completion(prompt_logprobs=[] if with_prompt_logprobs else None)
        self._choices: dict[int, Choice] = {}
        self.with_logprobs = with_logprobs

    def add(self, delta: Delta) -> None:
        self.completion.request_id = delta.request_id or self.completion.request_id
        if delta.usage is not None:
            self.completion.usage = delta.usage
            return
        if delta.prompt_logprobs and not self.completion.prompt_logprobs:
            self.completion.prompt_logprobs = delta.prompt_logprobs
        choice = self._choices.setdefault(
            delta.index, Choice(delta.index, logprobs=[] if self.with_logprobs else None))
        choice.text += delta.text
        choice.token_ids += delta.token_ids
        choice.finish_reason = delta.finish_reason or choice.finish_reason
        choice.stop_reason = choice.stop_reason if delta.stop_reason is None else delta.stop_reason
        if choice.logprobs is not None and delta.logprobs:
            choice.logprobs += delta.logprobs
        choice.tool_calls += delta.tool_calls

    def result(self) -> Completion:
        self.completion.choices = [self._choices[i] for i in sorted(self._choices)]
        return self.completion
