"""The router's `pdserve.v1.Generation` service: converts at the edge, dispatches.

Client disconnects cancel the handler; the dispatcher's cleanup then aborts the request
on every node holding it. Each call belongs to the tenant of its API key (`auth.tenant_of`):
Generate runs as the tenant's, Abort reaches only the tenant's own requests.
"""

from __future__ import annotations

import uuid

import grpc

from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from pdserve.router import validation
from pdserve.router.dispatch import Dispatcher
from pdserve.router.tokenizer import PromptTokenizer
from pdserve.runtime import auth
from pdserve.runtime.errors import NodeError, abort_with
from pdserve.runtime.observe import StreamObserver


class GenerationService(pdserve_pb2_grpc.GenerationServicer):
    def __init__(self, dispatcher: Dispatcher, tokenizer: PromptTokenizer) -> None:
        self.dispatcher = dispatcher
        self.tokenizer = tokenizer

    async def Generate(self, request, context):
        request_id = request.request_id or uuid.uuid4().hex
        observer = StreamObserver("router", request_id, api="grpc")
        if request.prompt_cache_key:  # on the request's log line: why it went where it went
            observer.fields["prompt_cache_key"] = request.prompt_cache_key
        try:
            ids, sampling, calls = validation.checked(request, self.tokenizer)
            lora = self.tokenizer.card.lora_of(request.model)
        except (ValueError, NodeError) as err:
            observer.finish("invalid_argument", error=str(err))
            await abort_with(context, err)
        window_end = request.kv_window_end if request.HasField("kv_window_end") else None
        stream = self.dispatcher.generate(request_id, ids, sampling, window_end,
                                          timeout_s=context.time_remaining(),
                                          cache_salt=request.cache_salt, priority=request.priority,
                                          cache_key=request.prompt_cache_key, lora=lora,
                                          tenant=auth.tenant_of(context.invocation_metadata()))
        try:
            async for msg in observer.watch(stream):
                msg = name_logprob_tokens(msg, self.tokenizer)
                yield msg if calls is None else calls.rewrite(msg)
        except Exception as err:
            await abort_with(context, err)

    async def Abort(self, request, context):
        """NOT_FOUND unless the caller's tenant has the request in flight: an id of another
        tenant's, finished or never sent all get the same answer, so none shows it exists."""
        tenant = auth.tenant_of(context.invocation_metadata())
        if not await self.dispatcher.abort(request.request_id, tenant):
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"no request {request.request_id!r} of yours is in flight "
                                "(finished, never sent, or sent with another API key)")
        return pdserve_pb2.AbortResponse(found=True)

    async def GetModelInfo(self, request, context):
        card = self.tokenizer.card
        return pdserve_pb2.ModelInfo(
            model=card.model, vocab_size=card.vocab_size, max_model_len=card.max_model_len,
            eos_token_ids=card.eos_token_ids, role="router", lora_names=card.loras)


def name_logprob_tokens(msg: pdserve_pb2.GenerateResponse,
                        tokenizer: PromptTokenizer) -> pdserve_pb2.GenerateResponse:
    """`msg` with the text of every logprob entry's token filled in: the nodes send ids
    only, and a client need not hold the tokenizer to read them."""
    for entry in (*msg.logprobs, *msg.prompt_logprobs):
        entry.token = tokenizer.token_text(entry.token_id)
        for top in entry.top:
            top.token = tokenizer.token_text(top.token_id)
    return msg
