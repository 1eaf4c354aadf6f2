"""Disaggregated dispatch of one request: PrepareReceive -> RemoteSend -> StartGeneration.

Invariants kept here:
- Every node that may hold state for a request (D from PrepareReceive on, P while its
  RemoteSend is in flight) is recorded in `RequestState` before the call is made, so an
  abort, an error or a client disconnect reaches all of them (`release`).
- RemoteSend runs only when D's prefix hit leaves something to send (`matched < end`).
- The stream handed back always ends with one message carrying `usage`, with the router's
  own time to first token and the route taken.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from proto import pdserve_pb2
from router.config import RouterConfig
from router.registry import Endpoint, WorkerRegistry

log = logging.getLogger("pdserve.router")


class DispatchError(Exception):
    """A failure with the gRPC status the client should see."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class RequestState:
    request_id: str
    arrived: float = field(default_factory=time.perf_counter)
    holders: set[Endpoint] = field(default_factory=set)  # nodes that may hold its state
    route: pdserve_pb2.RouteInfo = field(default_factory=pdserve_pb2.RouteInfo)
    ttft: float = 0.0
    aborted: bool = False


def _node_error(endpoint: Endpoint, call: str, err: grpc.aio.AioRpcError) -> DispatchError:
    code = err.code()
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        code = grpc.StatusCode.UNAVAILABLE
    return DispatchError(code, f"{call} on {endpoint.role} node {endpoint.address}: {err.details()}")


class Dispatcher:
    def __init__(self, config: RouterConfig, registry: WorkerRegistry) -> None:
        self.config = config
        self.registry = registry
        self.active: dict[str, RequestState] = {}
        self._cleanups: set[asyncio.Task] = set()

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: pdserve_pb2.SamplingParams,
        kv_window_end: int | None,
    ) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
        if request_id in self.active:
            raise DispatchError(grpc.StatusCode.INVALID_ARGUMENT,
                                f"duplicate request_id {request_id!r}")
        state = self.active[request_id] = RequestState(request_id)
        try:
            async for msg in self._run(state, prompt_token_ids, sampling, kv_window_end):
                yield msg
            state.holders.clear()  # finished normally: D freed or cached everything
        finally:
            del self.active[request_id]
            self._release(state)

    async def _run(self, state, prompt_token_ids, sampling, kv_window_end):
        cfg = self.config
        decode = self.registry.pick("decode", prompt_token_ids)
        state.route.decode_endpoint = decode.address
        state.holders.add(decode)
        decode.in_flight += 1
        try:
            if kv_window_end is None:
                kv_window_end = cfg.kv_window_end
            if not self.registry.has_prefill():
                kv_window_end = 0  # no prefill node: the decode node prefills the whole prompt
            prep = await self._prepare(decode, state, prompt_token_ids, sampling, kv_window_end)
            begin, end = prep.prefix_matched_length, prep.kv_window_end
            state.route.prefix_matched_length = begin
            state.route.kv_window_begin = begin
            state.route.kv_window_end = end
            self._check_aborted(state)
            sent = False
            if begin < end:
                await self._remote_send(state, decode, prep, prompt_token_ids)
                sent = True
                self._check_aborted(state)
            else:
                state.route.remote_send_skipped = True
            async for msg in self._start(decode, state, prep, sent):
                yield msg
        finally:
            decode.in_flight -= 1

    async def _prepare(self, decode, state, prompt_token_ids, sampling, kv_window_end):
        request = pdserve_pb2.PrepareReceiveRequest(
            request_id=state.request_id, prompt_token_ids=prompt_token_ids, sampling=sampling,
            kv_window_end=kv_window_end, lease_ms=self.config.lease_ms)
        try:
            return await decode.stub.PrepareReceive(request, timeout=self.config.prepare_timeout_s)
        except grpc.aio.AioRpcError as err:
            raise self._error(state, decode, "PrepareReceive", err) from None

    async def _remote_send(self, state, decode, prep, prompt_token_ids):
        prefill = self.registry.pick("prefill", prompt_token_ids)
        state.route.prefill_endpoint = prefill.address
        state.holders.add(prefill)
        prefill.in_flight += 1
        request = pdserve_pb2.RemoteSendRequest(
            request_id=state.request_id, prompt_token_ids=prompt_token_ids,
            kv_window_begin=prep.prefix_matched_length, kv_window_end=prep.kv_window_end,
            kv_append_metadata=prep.kv_append_metadata, lease_id=prep.lease_id,
            decode_agent_name=prep.decode_agent_name, decode_address=decode.address)
        try:
            await prefill.stub.RemoteSend(request, timeout=self.config.remote_send_timeout_s)
        except grpc.aio.AioRpcError as err:
            raise self._error(state, prefill, "RemoteSend", err) from None
        finally:
            prefill.in_flight -= 1
        state.holders.discard(prefill)  # P released its pages when it replied

    async def _start(self, decode, state, prep, sent):
        request = pdserve_pb2.StartGenerationRequest(
            request_id=state.request_id, kv_window_begin=prep.kv_window_end,
            lease_id=prep.lease_id, expect_kv_notification=sent)
        call = decode.stub.StartGeneration(request)
        first = True
        try:
            async for msg in call:
                if msg.HasField("usage"):
                    if first:  # no token at all (e.g. max_tokens reached at once)
                        msg.usage.time_to_first_token_s = time.perf_counter() - state.arrived
                    else:
                        msg.usage.time_to_first_token_s = state.ttft
                    msg.usage.route.CopyFrom(state.route)
                elif first and msg.token_ids:
                    state.ttft = time.perf_counter() - state.arrived
                    first = False
                yield msg
        except grpc.aio.AioRpcError as err:
            raise self._error(state, decode, "StartGeneration", err) from None
        finally:
            call.cancel()

    @staticmethod
    def _check_aborted(state: RequestState) -> None:
        if state.aborted:
            raise DispatchError(grpc.StatusCode.CANCELLED, f"request {state.request_id} aborted")

    @staticmethod
    def _error(state, endpoint, call, err) -> DispatchError:
        if state.aborted:
            return DispatchError(grpc.StatusCode.CANCELLED, f"request {state.request_id} aborted")
        return _node_error(endpoint, call, err)

    async def abort(self, request_id: str) -> bool:
        """Abort on every node holding the request. The stream then ends with
        finish_reason "abort" (or CANCELLED if it had not started generating)."""
        state = self.active.get(request_id)
        if state is None:
            return False
        state.aborted = True
        # Holders stay recorded: a call still in flight may create state after this Abort
        # lands, and the stream's end aborts them again (Abort is idempotent).
        await asyncio.gather(*(self._abort_one(e, request_id) for e in list(state.holders)))
        return True

    def _release(self, state: RequestState) -> None:
        """Abort the request on every node still holding it, without blocking the caller."""
        if not state.holders:
            return
        task = asyncio.ensure_future(self._abort_all(state))
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

    async def _abort_all(self, state: RequestState) -> None:
        holders, state.holders = list(state.holders), set()
        await asyncio.gather(*(self._abort_one(e, state.request_id) for e in holders))

    async def _abort_one(self, endpoint: Endpoint, request_id: str) -> None:
        try:
            await endpoint.stub.Abort(pdserve_pb2.AbortRequest(request_id=request_id),
                                      timeout=self.config.abort_timeout_s)
        except grpc.aio.AioRpcError as err:
            log.warning("Abort %s on %s failed: %s", request_id, endpoint.address, err.details())
