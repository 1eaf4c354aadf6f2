"""The router's `pdserve.v1.Generation` servicer: converts at the edge, dispatches.

Client disconnects cancel the handler; the dispatcher's cleanup then aborts the request
on every node holding it.
"""

from __future__ import annotations

import uuid

import grpc

from pdserve.observe import StreamObserver
from proto import pdserve_pb2, pdserve_pb2_grpc
from router.dispatch import Dispatcher, DispatchError
from router import validation
from router.registry import NoEndpointError
from router.tokenizer import PromptTokenizer


def prompt_ids(request: pdserve_pb2.GenerateRequest, tokenizer) -> list[int]:
    """The prompt as token ids; raises ValueError naming what is wrong."""
    if request.prompt and request.prompt_token_ids:
        raise ValueError("give either prompt or prompt_token_ids, not both")
    ids = list(request.prompt_token_ids) if request.prompt_token_ids else tokenizer.encode(request.prompt)
    if not ids:
        raise ValueError("prompt is empty")
    return ids


def checked_prompt_ids(request: pdserve_pb2.GenerateRequest, tokenizer) -> list[int]:
    """The prompt's ids after every router-side check (router/validation.py)."""
    ids = validation.prompt_ids(request, tokenizer)
    validation.check_generate(request, ids, tokenizer.card)
    return ids


class GenerationServicer(pdserve_pb2_grpc.GenerationServicer):
    def __init__(self, dispatcher: Dispatcher, tokenizer: PromptTokenizer) -> None:
        self.dispatcher = dispatcher
        self.tokenizer = tokenizer

    async def Generate(self, request, context):
        request_id = request.request_id or uuid.uuid4().hex
        observer = StreamObserver("router", request_id, api="grpc")
        try:
            ids = checked_prompt_ids(request, self.tokenizer)
        except ValueError as err:
            observer.finish("invalid_argument", error=str(err))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        window_end = request.kv_window_end if request.HasField("kv_window_end") else None
        stream = self.dispatcher.generate(request_id, ids, request.sampling, window_end,
                                          timeout_s=context.time_remaining())
        try:
            async for msg in observer.watch(stream):
                yield msg
        except DispatchError as err:
            await context.abort(err.code, err.message)
        except NoEndpointError as err:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(err))

    async def Abort(self, request, context):
        return pdserve_pb2.AbortResponse(found=await self.dispatcher.abort(request.request_id))

    async def GetModelInfo(self, request, context):
        card = self.tokenizer.card
        return pdserve_pb2.ModelInfo(
            model=card.model, vocab_size=card.vocab_size, max_model_len=card.max_model_len,
            eos_token_ids=card.eos_token_ids, role="router")
