"""Role `both`: the Generation service straight over the local engine, no router.

The baseline disaggregation is measured against. Prompts are tokenized exactly as the
router does (`tokenizer.encode`), so both paths see the same ids.
"""

from __future__ import annotations

import time
import uuid

import grpc

from decode.convert import sampling_from_pb, stream_responses
from proto import pdserve_pb2, pdserve_pb2_grpc
from proto.checks import check_request_id, check_sampling
from router.servicer import prompt_ids


class ColocatedGenerationServicer(pdserve_pb2_grpc.GenerationServicer):
    def __init__(self, engine, tokenizer, model: str, vocab_size: int, max_model_len: int):
        self.engine = engine  # AsyncEngine
        self.tokenizer = tokenizer
        self.model = model
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.active: set[str] = set()

    async def Generate(self, request, context):
        arrived = time.perf_counter()
        request_id = request.request_id or uuid.uuid4().hex
        params = sampling_from_pb(request.sampling)
        try:
            ids = prompt_ids(request, self.tokenizer)
            check_request_id(request_id)
            check_sampling(request.sampling, self.vocab_size, self.max_model_len)
            params.validate(vocab_size=self.vocab_size, max_model_len=self.max_model_len)
            if request_id in self.active:
                raise ValueError(f"duplicate request_id {request_id!r}")
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        self.active.add(request_id)
        outputs = self.engine.generate(request_id, ids, params)
        try:
            async for msg in stream_responses(request_id, outputs, arrived):
                yield msg
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        finally:
            self.active.discard(request_id)
            await self.engine.abort(request_id)

    async def Abort(self, request, context):
        found = request.request_id in self.active
        if found:
            await self.engine.abort(request.request_id)
        return pdserve_pb2.AbortResponse(found=found)

    async def GetModelInfo(self, request, context):
        eos = self.tokenizer.eos_token_id
        return pdserve_pb2.ModelInfo(
            model=self.model, vocab_size=self.vocab_size, max_model_len=self.max_model_len,
            eos_token_ids=[eos] if eos is not None else [], role="both")
