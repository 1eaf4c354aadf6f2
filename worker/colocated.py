"""Role `both`: the Generation service straight over this node's decode role, no router.

The baseline disaggregation is measured against. A request is the decode role's local
kind (`DecodeRole.generate_local`): this node prefills the whole prompt from its own prefix
cache and generates. Prompts and conversations (`messages`) are tokenized by the router's
own code (`router.validation`, `router.tokenizer`), so a request gives the same ids, and a
conversation the same end-of-turn stop, whichever way it is served.
"""

from __future__ import annotations

import time
import uuid

from pdserve.decode.convert import sampling_from_pb, stream_responses
from pdserve.decode.role import DecodeRole, LocalPrefill
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from pdserve.router.tokenizer import PromptTokenizer
from pdserve.router.validation import prompt_ids, sampling_of
from pdserve.runtime import metrics
from pdserve.runtime.checks import check_request_id
from pdserve.runtime.errors import abort_with
from pdserve.runtime.observe import StreamObserver, outcome_of


class ColocatedService(pdserve_pb2_grpc.GenerationServicer):
    def __init__(self, role: DecodeRole, model_dir: str) -> None:
        self.role = role
        self.tokenizer = PromptTokenizer(model_dir)

    async def Generate(self, request, context):
        arrived = time.perf_counter()
        request_id = request.request_id or uuid.uuid4().hex
        observer = StreamObserver("both", request_id)
        try:
            check_request_id(request_id)
            local = LocalPrefill(request_id, prompt_ids(request, self.tokenizer),
                                 sampling_from_pb(sampling_of(request, self.tokenizer)))
            outputs = self.role.generate_local(local, context.time_remaining())
            async for msg in observer.watch(stream_responses(request_id, outputs, arrived)):
                yield msg
        except Exception as err:
            observer.finish(outcome_of(err), error=str(err))  # no-op once watch recorded it
            await abort_with(context, err)
        if observer.usage is not None:
            u = observer.usage
            metrics.record_prefix_lookup("both", u.prompt_tokens, u.cached_prompt_tokens)

    async def Abort(self, request, context):
        found = await self.role.abort(request.request_id, settled=True)
        return pdserve_pb2.AbortResponse(found=found)

    async def GetModelInfo(self, request, context):
        card = self.tokenizer.card
        return pdserve_pb2.ModelInfo(
            model=card.model, vocab_size=card.vocab_size, max_model_len=card.max_model_len,
            eos_token_ids=card.eos_token_ids, role="both")
