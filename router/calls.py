"""How the router calls a worker: the messages, each call's deadline, and the one mapping
from a node's failure to what the client sees.

Invariants kept here:
- Every call has a deadline: its configured bound, cut to the client's own deadline; a
  RemoteSend's deadline never outlives D's lease, so a prefill node never writes into a
  reservation after D may have stopped guarding it (decode/quarantine.py).
- A node is recorded in the request's `holders` before a call that may create state on it.
- A failure that may mean the node is gone (UNAVAILABLE, DEADLINE_EXCEEDED before the
  client's own deadline) is reported to the registry, which stops routing to the node until
  its health check passes, and reaches the client as UNAVAILABLE saying to retry. The
  client never sees a node's address or an RPC's name: those go to the log.
- A failed RemoteSend is `settled` when the prefill node answered it without having begun
  a write (`NO_WRITE_CODES`): D may then reuse the reservation's pages at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc

from pdserve.proto import pdserve_pb2
from pdserve.router.config import RouterConfig
from pdserve.router.generation_limit import GenerationLimit, LimitPassed, StreamTally
from pdserve.router.registry import Endpoint, WorkerRegistry
from pdserve.router.state import DispatchError, EarlySend, RequestState, Reserved

log = logging.getLogger("pdserve.router")

# Statuses a prefill node answers itself without having begun a write: after them no
# write for that reservation can come.
NO_WRITE_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.OUT_OF_RANGE,
}
# Statuses a decode node answers a PrepareReceive with itself, having reserved nothing.
NOTHING_RESERVED_CODES = NO_WRITE_CODES | {
    grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED}
# Statuses that may mean the node itself is gone: ask the registry to check its health.
NODE_GONE_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


class NodeCalls:
    def __init__(self, config: RouterConfig, registry: WorkerRegistry) -> None:
        self.config = config
        self.registry = registry
        self._cleanups: set[asyncio.Task] = set()

    def error(self, state: RequestState, endpoint: Endpoint, call: str,
              err: grpc.aio.AioRpcError) -> DispatchError:
        """What the client sees of a failed call (see the module docstring): the node's own
        words for a refusal, what happened and what to do for a node gone. The call and the
        node's address go to the log with the request id (`detail`), not to the client."""
        if state.aborted:
            return DispatchError(grpc.StatusCode.CANCELLED, f"request {state.client_id} aborted")
        code = err.code()
        client_deadline = state.deadline is not None and time.monotonic() >= state.deadline
        if code in NODE_GONE_CODES and not client_deadline:
            self.registry.report_failure(endpoint, f"{call}: {code.name}")
            code = grpc.StatusCode.UNAVAILABLE
        detail = f"{call} on {endpoint.role} node {endpoint.address}: {err.code().name}: " \
                 f"{err.details()}"
        log.info("request %s: %s", state.request_id, detail)
        return DispatchError(code, _client_message(code, err.details(), state.client_id),
                             detail=detail)

    # ---- step 1: PrepareReceive --------------------------------------------------------
    async def prepare(self, decode: Endpoint, state: RequestState, prompt_token_ids, sampling,
                      kv_window_end: int, local: bool = False,
                      writer: Endpoint | None = None) -> Reserved:
        """`writer`: the prefill node that will write the reservation; D asks it for proof
        before reusing the pages of a reservation freed before its KV arrived."""
        request = pdserve_pb2.PrepareReceiveRequest(
            request_id=state.request_id, prompt_token_ids=prompt_token_ids, sampling=sampling,
            kv_window_end=kv_window_end, lease_ms=self.config.lease_ms, local_prefill=local,
            writer_address=writer.address if writer is not None else "",
            cache_salt=state.cache_salt, priority=state.priority, lora=state.lora)
        state.local = local
        state.holders.add(decode)
        # On the node from its reservation on: the picks of requests arriving meanwhile, and a
        # load report that already counts the lease, count it as this router's.
        decode.in_flight += 1
        try:
            # D may wait in line for pages (decode/page_line.py) up to what this deadline leaves.
            prep = await decode.stub.PrepareReceive(request, timeout=state.timeout(
                self.config.prepare_timeout_s + self.config.max_queue_wait_s))
        except grpc.aio.AioRpcError as err:
            state.holders.discard(decode)
            if err.code() not in NOTHING_RESERVED_CODES:
                # D may have reserved: no lease reached us, so no RemoteSend can write it,
                # and it is freed now. Its Abort names no lease and may land late, so this
                # request reserves on that node no more (a late Abort would free a newer
                # reservation that a prefill node is writing).
                state.maybe_reserved.add(decode)
                self.abort_later(decode, state.request_id, settled=True)
            raise self.error(state, decode, "PrepareReceive", err) from None
        finally:
            decode.in_flight -= 1  # the dispatcher counts it from here (dispatch.py)
        state.queue_s += prep.queued_ms / 1000
        return Reserved(prep, time.monotonic() + prep.lease_ms / 1000)

    # ---- step 2: RemoteSend, after D reserved ------------------------------------------
    async def remote_send(self, state: RequestState, decode: Endpoint, prefill: Endpoint,
                          reserved: Reserved, prompt_token_ids) -> pdserve_pb2.RemoteSendResponse:
        prep = reserved.prep
        state.holders.add(prefill)
        prefill.in_flight += 1
        request = pdserve_pb2.RemoteSendRequest(
            request_id=state.request_id, prompt_token_ids=prompt_token_ids,
            kv_window_begin=prep.prefix_matched_length, kv_window_end=prep.kv_window_end,
            kv_append_metadata=prep.kv_append_metadata, lease_id=prep.lease_id,
            decode_agent_name=prep.decode_agent_name, decode_address=decode.address,
            cache_salt=state.cache_salt, priority=state.priority, lora=state.lora, **_lease_fields(reserved))
        # Never past the lease: D no longer waits for the KV after it ends.
        timeout = min(state.timeout(self.config.remote_send_timeout_s),
                      reserved.lease_ends - time.monotonic())
        state.kv_write_pending = True
        try:
            if timeout <= 0:
                raise DispatchError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"lease of request {state.request_id} ended before RemoteSend",
                                    settled=True)
            token = prefill.send_started()
            try:
                reply = await prefill.stub.RemoteSend(request, timeout=timeout)
            except grpc.aio.AioRpcError as err:  # timed only if it outlived the lease
                prefill.send_ended(token, err.code() == grpc.StatusCode.DEADLINE_EXCEEDED)
                raise
            except asyncio.CancelledError:  # else its start ages on: the node looks saturated
                prefill.send_ended(token, timed=False)
                raise
            prefill.send_ended(token)
            state.kv_write_pending = False  # P answered: its writes landed, notification sent
        except grpc.aio.AioRpcError as err:
            raise self._send_failed(state, prefill, err) from None
        finally:
            prefill.in_flight -= 1
        state.holders.discard(prefill)  # P queued their release before replying: no Abort needed
        return reply

    def _send_failed(self, state: RequestState, prefill: Endpoint,
                     err: grpc.aio.AioRpcError) -> DispatchError:
        error = self.error(state, prefill, "RemoteSend", err)
        error.settled = err.code() in NO_WRITE_CODES
        state.kv_write_pending = not error.settled
        return error

    # ---- step 2, overlapped: RemoteSend before D reserved ------------------------------
    def send_early(self, state: RequestState, prefill: Endpoint, prompt_token_ids,
                   end: int) -> EarlySend:
        """P prefills prompt[:end] while D reserves; D's half of the window follows."""
        state.holders.add(prefill)
        prefill.in_flight += 1
        request = pdserve_pb2.RemoteSendRequest(
            request_id=state.request_id, prompt_token_ids=prompt_token_ids, kv_window_end=end,
            window_follows=True, cache_salt=state.cache_salt, priority=state.priority, lora=state.lora)
        call = prefill.stub.RemoteSend(
            request, timeout=state.timeout(self.config.remote_send_timeout_s))
        return EarlySend(prefill, asyncio.ensure_future(call), prefill.send_started())

    async def cancel_early(self, state: RequestState, early: EarlySend) -> None:
        """No reservation came (or none is needed): P got no window, so it wrote nothing."""
        await self.abort(early.prefill, state.request_id, settled=True)
        # The abort and the RemoteSend are two calls and may reach P in either order: one the
        # abort overtook would wait for its window until its deadline. Cancelling it ends it
        # on P as a caller gone away, and nothing is waited for.
        early.call.cancel()
        try:
            await early.call
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass
        finally:
            early.prefill.in_flight -= 1
            early.prefill.send_ended(early.token, timed=False)
            state.holders.discard(early.prefill)

    async def finish_early(self, state: RequestState, decode: Endpoint, early: EarlySend,
                           reserved: Reserved) -> pdserve_pb2.RemoteSendResponse:
        """Give P D's half of the window, then wait for its writes."""
        prep, prefill = reserved.prep, early.prefill
        window = pdserve_pb2.RemoteSendWindow(
            request_id=state.request_id, kv_window_begin=prep.prefix_matched_length,
            kv_append_metadata=prep.kv_append_metadata, lease_id=prep.lease_id,
            decode_agent_name=prep.decode_agent_name, decode_address=decode.address,
            **_lease_fields(reserved))
        state.kv_write_pending = True  # from here P may write D's reservation
        try:
            try:  # not past the lease either: a stopped P would hold it to its whole bound
                await prefill.stub.DeliverWindow(window, timeout=max(0.0, min(
                    state.timeout(self.config.prepare_timeout_s),
                    reserved.lease_ends - time.monotonic())))
            except grpc.aio.AioRpcError:
                pass  # the RemoteSend itself ends with what went wrong
            # Never wait past the lease, as a sequential RemoteSend's deadline would not.
            left = reserved.lease_ends - time.monotonic()
            try:
                reply = await asyncio.wait_for(asyncio.shield(early.call), max(0.0, left))
            except asyncio.TimeoutError:
                prefill.send_ended(early.token)
                early.call.cancel()  # P stops unless its write began (then it lands late)
                # A node that lets a whole lease pass may be stopped: no more work for it
                # until its health check passes again.
                self.registry.report_failure(prefill, "RemoteSend outlived its lease")
                raise DispatchError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"RemoteSend on prefill node {prefill.address}: the lease "
                                    f"of request {state.request_id} ended first") from None
            prefill.send_ended(early.token)
            state.kv_write_pending = False
        except grpc.aio.AioRpcError as err:
            raise self._send_failed(state, prefill, err) from None
        except asyncio.CancelledError:
            early.call.cancel()
            raise
        finally:
            prefill.in_flight -= 1
            prefill.send_ended(early.token, timed=False)  # (if not already timed above)
        state.holders.discard(prefill)
        return reply

    # ---- step 3: StartGeneration -------------------------------------------------------
    def start_request(self, state: RequestState, reserved: Reserved, sent: bool):
        prep = reserved.prep
        return pdserve_pb2.StartGenerationRequest(
            request_id=state.request_id, kv_window_begin=prep.kv_window_end,
            lease_id=prep.lease_id, expect_kv_notification=sent)

    def start_local_request(self, state: RequestState, prompt_token_ids, sampling):
        """D prefills the whole prompt: its PrepareReceive (local_prefill) rides inside
        StartGeneration, so the request costs one call."""
        prepare = pdserve_pb2.PrepareReceiveRequest(
            request_id=state.request_id, prompt_token_ids=prompt_token_ids, sampling=sampling,
            kv_window_end=0, lease_ms=self.config.lease_ms, local_prefill=True,
            cache_salt=state.cache_salt, priority=state.priority, lora=state.lora)
        return pdserve_pb2.StartGenerationRequest(request_id=state.request_id, prepare=prepare)

    async def start(self, decode: Endpoint, state: RequestState,
                    request) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
        """D's stream, ending with one usage message that carries the router's own time to
        first token and the route taken. Its only deadline is the client's;
        `--generation-timeout-s` ends it as max_tokens would (router/generation_limit.py)."""
        call = decode.stub.StartGeneration(request, timeout=state.timeout(None))
        limit, tally = GenerationLimit(self.config.generation_timeout_s), StreamTally()
        first = True
        try:
            while (msg := await limit.read(call)) is not grpc.aio.EOF:
                if msg.HasField("usage"):
                    self._finish_usage(state, msg.usage, first)
                elif first and msg.token_ids:
                    state.ttft = time.perf_counter() - state.arrived
                    first = False
                tally.add(msg)
                yield msg
        except grpc.aio.AioRpcError as err:
            raise self.error(state, decode, "StartGeneration", err) from None
        except LimitPassed:
            log.info("request %s: --generation-timeout-s %g s passed; ending it on decode node "
                     "%s", state.request_id, limit.limit_s, decode.address)
            self.abort_later(decode, state.request_id, settled=not state.kv_write_pending)
            if first:
                raise limit.no_token(state.client_id) from None
            usage = pdserve_pb2.Usage(prompt_tokens=state.prompt_tokens,
                                      cached_prompt_tokens=state.route.prefix_matched_length)
            self._finish_usage(state, usage, first)
            for msg in tally.ending(state.client_id, usage):
                yield msg
        finally:
            call.cancel()

    @staticmethod
    def _finish_usage(state: RequestState, usage: pdserve_pb2.Usage, first: bool) -> None:
        """The router's part of a stream's usage: its own time to first token, the route."""
        if state.local:  # D's own prefix hit, known once it scheduled the prompt
            state.route.prefix_matched_length = usage.cached_prompt_tokens
        if first:  # no token at all (e.g. max_tokens reached at once)
            usage.time_to_first_token_s = time.perf_counter() - state.arrived
        else:
            usage.time_to_first_token_s = state.ttft
        usage.route.CopyFrom(state.route)
        # D's engine queue counts only when D prefilled: otherwise its request sat reserved
        # while the KV came, which is prefill and transfer time.
        usage.queue_time_s = state.queue_s + (usage.queue_time_s if state.local else 0.0)
        usage.prefill_time_s += state.prefill_s
        usage.kv_transfer_time_s = state.transfer_s

    # ---- aborts ------------------------------------------------------------------------
    async def abort(self, endpoint: Endpoint, request_id: str, settled: bool,
                    lease_id: str = "") -> None:
        """Abort on one node; with `lease_id`, only that reservation (a newer one of the
        same request, made after this Abort was sent, stays)."""
        try:
            await endpoint.stub.Abort(
                pdserve_pb2.AbortRequest(request_id=request_id, kv_write_settled=settled,
                                         lease_id=lease_id),
                timeout=self.config.abort_timeout_s)
        except grpc.aio.AioRpcError as err:
            log.warning("Abort %s on %s failed: %s", request_id, endpoint.address, err.details())

    def abort_later(self, endpoint: Endpoint, request_id: str, settled: bool) -> None:
        task = asyncio.ensure_future(self.abort(endpoint, request_id, settled))
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

    def release(self, state: RequestState) -> None:
        """Abort the request on every node still holding it, without blocking the caller."""
        holders, state.holders = list(state.holders), set()
        settled = not state.kv_write_pending
        for endpoint in holders:
            self.abort_later(endpoint, state.request_id, settled)


def _client_message(code: grpc.StatusCode, details: str, request_id: str) -> str:
    """A node's failure in the client's terms: a refusal in the node's own words (they name
    the value); a node gone or a deadline as what happened and what to do."""
    if code == grpc.StatusCode.UNAVAILABLE:
        return (f"a node serving request {request_id} stopped answering before it finished; "
                f"retry the request (the router's log names the node)")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return (f"request {request_id} ran out of its deadline before it finished; retry "
                f"with a longer deadline")
    return details


def _lease_fields(reserved: Reserved) -> dict:
    """The window's lease as P needs it: the time left now (P counts it down on its own
    clock) and what D's capability covers."""
    prep = reserved.prep
    left_ms = max(0, round((reserved.lease_ends - time.monotonic()) * 1000))
    return dict(lease_remaining_ms=left_ms, lease_ms=prep.lease_ms,
                capability=prep.capability, issued_unix_ms=prep.issued_unix_ms)
