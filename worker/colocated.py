"""Role `both`: the Generation service straight over this node's decode role, no router.

The baseline disaggregation is measured against. A request is the decode role's local
kind (`DecodeRole.generate_local`): this node prefills the whole prompt from its own prefix
cache and generates, under the caller's prefix-cache salt (router/cache_salt.py: per tenant,
and the request's cache_salt; this node has no shared cache). Prompts and conversations
(`messages`) are tokenized and checked by the router's own code (`router.validation`,
`router.tokenizer`), so a request gives the same ids, a conversation the same end-of-turn
stop, and a bad request the same refusal (prompt plus max_tokens over the context
included), whichever way it is served.

With `--http-port` the node also serves the router's OpenAI API (`router.openai_http`) in the
same process: the HTTP front calls `generate`, this service in the role of the router's
Dispatcher, so both APIs reach the same decode role.
"""

from __future__ import annotations

import time
import uuid

import grpc

from pdserve.decode.convert import stream_responses
from pdserve.decode.role import DecodeRole, LocalPrefill
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from pdserve.router.cache_salt import effective_salt
from pdserve.router.state import node_request_id
from pdserve.router.service import name_logprob_tokens
from pdserve.router.tokenizer import PromptTokenizer
from pdserve.router.validation import checked
from pdserve.runtime import auth, metrics
from pdserve.runtime.checks import check_request_id, sampling_from_pb
from pdserve.runtime.errors import NodeError, abort_with
from pdserve.runtime.observe import StreamObserver, outcome_of


class ColocatedService(pdserve_pb2_grpc.GenerationServicer):
    def __init__(self, role: DecodeRole, model_dir: str,
                 served_model_name: list[str] | None = None, chat_template: str | None = None,
                 tool_call_parser: str = "auto", lora_modules=()) -> None:
        self.role = role
        self.tokenizer = PromptTokenizer(model_dir, served_model_name, chat_template, tool_call_parser,
                                         lora_modules)
        self.active: set[str] = set()  # ids `generate` streams (the HTTP /metrics in_flight)

    async def Generate(self, request, context):
        arrived = time.perf_counter()
        request_id = request.request_id or uuid.uuid4().hex
        observer = StreamObserver("both", request_id)
        try:
            check_request_id(request_id)
            ids, sampling, calls = checked(request, self.tokenizer)  # the router's front-door checks
            tenant = auth.tenant_of(context.invocation_metadata())
            lora = self.tokenizer.card.lora_of(request.model)
            salt = effective_salt(tenant, request.cache_salt)
            local = LocalPrefill(node_request_id(tenant, request_id), ids, sampling_from_pb(sampling),
                                 cache_salt=salt, priority=request.priority, lora=lora)
            outputs = self.role.generate_local(local, context.time_remaining())
            async for msg in observer.watch(stream_responses(request_id, outputs, arrived)):
                msg = name_logprob_tokens(msg, self.tokenizer)
                yield msg if calls is None else calls.rewrite(msg)
        except Exception as err:
            observer.finish(outcome_of(err), error=str(err))  # no-op once watch recorded it
            await abort_with(context, err)
        if observer.usage is not None:
            u = observer.usage
            metrics.record_prefix_lookup("both", u.prompt_tokens, u.cached_prompt_tokens)

    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling,
                       kv_window_end: int | None = None, timeout_s: float | None = None,
                       tenant: str = "default", cache_salt: str = "", priority: int = 0, cache_key: str = "",
                       lora: str = ""):
        """The router Dispatcher's `generate` (router/dispatch.py), for the OpenAI front:
        ids and sampling (pdserve_pb2.SamplingParams) come checked; this node serves the
        request whole (`kv_window_end` means nothing here). A ValueError the role finds is
        INVALID_ARGUMENT, as a router reports it. `tenant` scopes the request id as a
        router does (`node_request_id`), and with `cache_salt` salts the prefix cache, as
        the module docstring says; `cache_key` chooses among nodes, and here is one."""
        arrived = time.perf_counter()
        self.active.add(request_id)
        try:
            check_request_id(request_id)
            local = LocalPrefill(node_request_id(tenant, request_id), prompt_token_ids,
                                 sampling_from_pb(sampling),
                                 cache_salt=effective_salt(tenant, cache_salt), priority=priority, lora=lora)
            outputs = self.role.generate_local(local, timeout_s)
            async for msg in stream_responses(request_id, outputs, arrived):
                if msg.HasField("usage"):
                    u = msg.usage
                    metrics.record_prefix_lookup("both", u.prompt_tokens, u.cached_prompt_tokens)
                yield msg
        except ValueError as err:
            raise NodeError(str(err), grpc.StatusCode.INVALID_ARGUMENT) from None
        finally:
            self.active.discard(request_id)

    async def Abort(self, request, context):
        """As a router's: NOT_FOUND unless the caller's tenant has the request in flight."""
        tenant = auth.tenant_of(context.invocation_metadata())
        try:
            node_id = node_request_id(tenant, request.request_id)
        except ValueError:  # too long to be any request of this tenant's
            node_id = None
        if node_id is None or not await self.role.abort(node_id, settled=True):
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"no request {request.request_id!r} of yours is in flight "
                                "(finished, never sent, or sent with another API key)")
        return pdserve_pb2.AbortResponse(found=True)

    async def GetModelInfo(self, request, context):
        card = self.tokenizer.card
        return pdserve_pb2.ModelInfo(
            model=card.model, vocab_size=card.vocab_size, max_model_len=card.max_model_len,
            eos_token_ids=card.eos_token_ids, role="both", lora_names=card.loras)


async def start_openai_http(service: ColocatedService, host: str, port: int, refresh):
    """The router's OpenAI API and /metrics (router/openai_http.py) over `service`, on
    HOST:PORT (0: a free one); `refresh` samples the node's gauges before /metrics answers."""
    from pdserve.router.openai_http import OpenAIFrontend
    from pdserve.runtime import auth
    from pdserve.runtime.http import start_http

    card = service.tokenizer.card
    metrics.NODE.info({"role": "both", "model": card.model})
    frontend = OpenAIFrontend(service, service.tokenizer, card.model,
                              api_keys=auth.current().api_keys,
                              role="both", refresh=refresh)
    return await start_http(frontend.app(), host, port, "both OpenAI API and /metrics")
