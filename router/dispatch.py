"""Disaggregated dispatch of one request: PrepareReceive -> RemoteSend -> StartGeneration.

Invariants kept here:
- Every node that may hold state for a request (D from PrepareReceive on, P while its
  RemoteSend is in flight) is recorded in `RequestState` before the call is made, so an
  abort, an error or a client disconnect reaches all of them (`release`).
- Every inter-node call has a deadline: its configured bound, cut to the client's own
  deadline; a RemoteSend's deadline never outlives D's lease, so a prefill node never
  writes into a reservation after D may have stopped guarding it (decode/quarantine.py).
- An Abort tells D whether a RemoteSend may still write the reservation
  (`kv_write_settled`): D reuses the pages at once only when none can.
- Failures are absorbed where the client cannot tell: PrepareReceive moves on to another
  decode node (node gone or full); a failed RemoteSend gets a fresh reservation and another
  prefill node, or finally lets D prefill the whole prompt itself (`kv_window_end` 0).
  Once tokens flow, a decode failure is the client's: UNAVAILABLE naming the node. Nodes
  that fail as if gone are reported to the registry, which stops routing to them until
  their health check passes.
- Bounded: at most `max_concurrent_requests` dispatch at once and `max_queued_requests`
  wait for a turn; past that RESOURCE_EXHAUSTED, never unbounded growth.
- RemoteSend runs only when D's prefix hit leaves something to send (`matched < end`),
  and only when selective disaggregation (router/selective.py) does not decide that D
  prefills the prompt itself (`local_prefill`: no window, nothing reserved up front). Such
  a request costs one call: the PrepareReceive rides inside StartGeneration; if that node
  is gone or full before any token, the ordinary path tries the others.
- Overlap (`overlap_prefill`): the RemoteSend is sent before PrepareReceive, with only the
  prompt and the absolute window end (`window_follows`), so P computes while D reserves;
  D's half of the window follows in DeliverWindow. Until then P cannot write anything
  (`kv_write_pending` stays False), and P bounds every write by D's lease itself. Retries
  after a failed RemoteSend go the sequential way.
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

from pdserve import metrics
from proto import pdserve_pb2
from router import selective
from router.config import RouterConfig
from router.registry import Endpoint, NoEndpointError, WorkerRegistry

log = logging.getLogger("pdserve.router")

# Statuses a prefill node answers itself without having begun a write: after them no
# write for that reservation can come.
_NO_WRITE_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.OUT_OF_RANGE,
}
# Statuses that may mean the node itself is gone: ask the registry to check its health.
_NODE_GONE_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


class DispatchError(Exception):
    """A failure with the gRPC status the client should see. `settled`: (RemoteSend only)
    the prefill node answered without writing anything."""

    def __init__(self, code: grpc.StatusCode, message: str, settled: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.settled = settled


@dataclass
class RequestState:
    request_id: str
    arrived: float = field(default_factory=time.perf_counter)
    deadline: float | None = None  # the client's, on the monotonic clock
    holders: set[Endpoint] = field(default_factory=set)  # nodes that may hold its state
    kv_write_pending: bool = False  # a RemoteSend may still write D's reservation
    route: pdserve_pb2.RouteInfo = field(default_factory=pdserve_pb2.RouteInfo)
    ttft: float = 0.0
    aborted: bool = False
    local: bool = False  # D prefills the whole prompt itself (selective disaggregation)

    def timeout(self, bound_s: float) -> float:
        """`bound_s` cut to what is left of the client's deadline."""
        if self.deadline is None:
            return bound_s
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise DispatchError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"request {self.request_id} ran out of its deadline")
        return min(bound_s, left)


@dataclass
class Reserved:
    """D's reservation, with when its lease ends (monotonic)."""

    prep: pdserve_pb2.PrepareReceiveResponse
    lease_ends: float


@dataclass
class EarlySend:
    """A RemoteSend sent before D reserved (`window_follows`), waiting for its window."""

    prefill: Endpoint
    call: asyncio.Future


class Dispatcher:
    def __init__(self, config: RouterConfig, registry: WorkerRegistry) -> None:
        self.config = config
        self.registry = registry
        self.active: dict[str, RequestState] = {}
        self.draining = False
        self._running = 0  # requests holding a dispatch slot
        self._slots = asyncio.Semaphore(config.max_concurrent_requests)
        self._cleanups: set[asyncio.Task] = set()
        self.load_monitor = None  # router/load.py; told when requests arrive

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: pdserve_pb2.SamplingParams,
        kv_window_end: int | None,
        timeout_s: float | None = None,
    ) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
        if self.draining:
            raise DispatchError(grpc.StatusCode.UNAVAILABLE,
                                "router is draining (shutting down): no new requests")
        if request_id in self.active:
            raise DispatchError(grpc.StatusCode.INVALID_ARGUMENT,
                                f"duplicate request_id {request_id!r}")
        queued = len(self.active) - self._running
        if self._running >= self.config.max_concurrent_requests and \
                queued >= self.config.max_queued_requests:
            raise DispatchError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"router is full: {self._running} requests running and "
                                f"{queued} waiting (limits {self.config.max_concurrent_requests}"
                                f" and {self.config.max_queued_requests})")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        state = self.active[request_id] = RequestState(request_id, deadline=deadline)
        try:
            await self._wait_turn(state)
            try:
                self._check_aborted(state)
                async for msg in self._run(state, prompt_token_ids, sampling, kv_window_end):
                    yield msg
                state.holders.clear()  # finished normally: D freed or cached everything
            finally:
                self._running -= 1
                self._slots.release()
        finally:
            del self.active[request_id]
            self._release(state)

    async def _wait_turn(self, state: RequestState) -> None:
        timeout = None if state.deadline is None else max(0.0, state.deadline - time.monotonic())
        try:
            await asyncio.wait_for(self._slots.acquire(), timeout)
        except asyncio.TimeoutError:
            raise DispatchError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"request {state.request_id} ran out of its deadline while "
                                "queued at the router") from None
        self._running += 1

    def _plan(self, prompt_token_ids, kv_window_end, decode) -> selective.Plan:
        c = self.config
        return selective.plan(prompt_token_ids, kv_window_end, decode,
                              self.registry.usable("prefill"), self.registry.usable("decode"),
                              c.min_remote_prefill_tokens, c.prefill_saturated_queue,
                              c.auto_max_tail)

    async def _run(self, state, prompt_token_ids, sampling, kv_window_end):
        if kv_window_end is None:
            kv_window_end = self.config.kv_window_end
        if self.load_monitor is not None:
            self.load_monitor.mark_busy()
        first = self.registry.pick("decode", prompt_token_ids)
        plan = self._plan(prompt_token_ids, kv_window_end, first)
        if plan.local:  # one call; on a node gone or full, the ordinary path tries others
            started = False
            try:
                async for msg in self._run_local(state, first, prompt_token_ids, sampling, plan):
                    started = True
                    yield msg
                return
            except DispatchError as err:
                if started or state.aborted or err.code not in (
                        grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED):
                    raise
                log.info("%s; trying another decode node", err.message)
                first = None
        early = None
        if not plan.local and plan.end > 0 and self.config.overlap_prefill:
            prefill = self._next_prefill(prompt_token_ids, [])
            if prefill is not None:
                early = self._send_early(state, prefill, prompt_token_ids, plan.end)
        try:
            decode, reserved = await self._reserve(state, prompt_token_ids, sampling, plan,
                                                   first=first)
        except BaseException:
            if early is not None:
                await self._cancel_early(state, early)
            raise
        state.route.decode_endpoint = decode.address
        decode.in_flight += 1
        try:
            sent = False
            prep = reserved.prep
            if prep.prefix_matched_length < prep.kv_window_end:
                reserved, sent = await self._send_kv(state, decode, reserved, prompt_token_ids,
                                                     sampling, early)
                prep = reserved.prep
            elif early is not None:
                await self._cancel_early(state, early)
            state.route.prefix_matched_length = prep.prefix_matched_length
            state.route.kv_window_begin = prep.prefix_matched_length
            state.route.kv_window_end = prep.kv_window_end
            state.route.remote_send_skipped = not sent
            if not sent:
                state.route.prefill_endpoint = ""
                state.route.prefill_cached_tokens = 0
                state.route.skip_reason = state.route.skip_reason or plan.reason or "requested"
            decode.prefixes.insert(prompt_token_ids)  # what D will have cached
            self._check_aborted(state)
            request = pdserve_pb2.StartGenerationRequest(
                request_id=state.request_id, kv_window_begin=prep.kv_window_end,
                lease_id=prep.lease_id, expect_kv_notification=sent)
            async for msg in self._start(decode, state, request):
                yield msg
        finally:
            decode.in_flight -= 1

    # ---- step 1: a reservation on some decode node ----------------------------------
    async def _reserve(self, state, prompt_token_ids, sampling, plan, first=None):
        """(D, reservation) from the first decode node that can hold it, `first` tried
        first. Nodes that are gone or full are skipped; while some node is only full, retry
        with backoff for up to `full_retry_s`."""
        give_up = time.monotonic() + self.config.full_retry_s
        backoff = 0.02
        attempts = 0
        while True:
            tried: list[Endpoint] = []
            errors: list[DispatchError] = []
            while True:
                try:
                    if first is not None and first.usable:
                        decode, first = first, None
                    else:
                        decode = self.registry.pick("decode", prompt_token_ids, exclude=tried)
                except NoEndpointError:
                    if not errors:
                        raise
                    break
                tried.append(decode)
                attempts += 1
                if attempts > 1:
                    metrics.record_retry("PrepareReceive")
                try:
                    return decode, await self._prepare(decode, state, prompt_token_ids,
                                                       sampling, plan.kv_window_end, plan.local)
                except DispatchError as err:
                    if state.aborted or err.code not in (grpc.StatusCode.UNAVAILABLE,
                                                         grpc.StatusCode.RESOURCE_EXHAUSTED):
                        raise
                    errors.append(err)
                    log.info("%s; trying another decode node", err.message)
            full = [e for e in errors if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED]
            if not full or time.monotonic() + backoff > give_up:
                raise (full or errors)[-1]
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 0.5)
            self._check_aborted(state)

    async def _prepare(self, decode, state, prompt_token_ids, sampling, kv_window_end,
                       local: bool = False) -> Reserved:
        request = pdserve_pb2.PrepareReceiveRequest(
            request_id=state.request_id, prompt_token_ids=prompt_token_ids, sampling=sampling,
            kv_window_end=kv_window_end, lease_ms=self.config.lease_ms, local_prefill=local)
        state.local = local
        state.holders.add(decode)
        try:
            prep = await decode.stub.PrepareReceive(
                request, timeout=state.timeout(self.config.prepare_timeout_s))
        except grpc.aio.AioRpcError as err:
            # No lease reached us, so no RemoteSend can write whatever D may have reserved.
            self._abort_later(decode, state.request_id, settled=True)
            state.holders.discard(decode)
            raise self._error(state, decode, "PrepareReceive", err) from None
        return Reserved(prep, time.monotonic() + prep.lease_ms / 1000)

    # ---- step 2: the KV window from a prefill node ------------------------------------
    async def _send_kv(self, state, decode, reserved, prompt_token_ids, sampling, early=None):
        """(reservation, sent). Retries another prefill node on a fresh reservation, and
        finally lets D prefill the whole prompt: the client never sees a prefill failure."""
        tried: list[Endpoint] = []
        prefill = early.prefill if early is not None else \
            self._next_prefill(prompt_token_ids, tried)
        while prefill is not None:
            tried.append(prefill)
            try:
                if early is not None:
                    await self._finish_early(state, decode, early, reserved)
                else:
                    await self._remote_send(state, decode, prefill, reserved, prompt_token_ids)
                prefill.prefixes.insert(prompt_token_ids[:reserved.prep.kv_window_end])
                return reserved, True
            except DispatchError as err:
                early = None
                if state.aborted:
                    raise
                # The failed attempt may still write its reservation: D quarantines it
                # unless P answered without writing.
                await self._abort_one(decode, state.request_id, settled=err.settled)
                prefill = self._next_prefill(prompt_token_ids, tried)
                log.warning("%s; %s", err.message,
                            f"retrying on prefill node {prefill.address}" if prefill else
                            f"decode node {decode.address} prefills the prompt itself")
                if prefill is not None:
                    metrics.record_retry("RemoteSend")
                    reserved = await self._prepare(decode, state, prompt_token_ids, sampling,
                                                   reserved.prep.kv_window_end)
                else:
                    metrics.record_fallback("decode_prefill")
                    state.route.skip_reason = "fallback"
                    reserved = await self._prepare(decode, state, prompt_token_ids, sampling, 0,
                                                   local=True)
                if reserved.prep.prefix_matched_length >= reserved.prep.kv_window_end:
                    return reserved, False
        # No prefill node was routable: D prefills the whole prompt on a fresh reservation.
        metrics.record_fallback("no_prefill")
        state.route.skip_reason = "no_prefill"
        await self._abort_one(decode, state.request_id, settled=True)
        return await self._prepare(decode, state, prompt_token_ids, sampling, 0,
                                   local=True), False

    def _next_prefill(self, prompt_token_ids, tried) -> Endpoint | None:
        if len(tried) >= self.config.max_prefill_attempts:
            return None
        try:
            return self.registry.pick("prefill", prompt_token_ids, exclude=tried)
        except NoEndpointError:
            return None

    async def _remote_send(self, state, decode, prefill, reserved, prompt_token_ids):
        prep = reserved.prep
        state.route.prefill_endpoint = prefill.address
        state.holders.add(prefill)
        prefill.in_flight += 1
        request = pdserve_pb2.RemoteSendRequest(
            request_id=state.request_id, prompt_token_ids=prompt_token_ids,
            kv_window_begin=prep.prefix_matched_length, kv_window_end=prep.kv_window_end,
            kv_append_metadata=prep.kv_append_metadata, lease_id=prep.lease_id,
            decode_agent_name=prep.decode_agent_name, decode_address=decode.address,
            lease_expires_unix_ms=prep.lease_expires_unix_ms)
        # Never past the lease: D stops guarding the pages some time after it ends.
        timeout = min(state.timeout(self.config.remote_send_timeout_s),
                      reserved.lease_ends - time.monotonic())
        state.kv_write_pending = True
        try:
            if timeout <= 0:
                raise DispatchError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"lease of request {state.request_id} ended before RemoteSend",
                                    settled=True)
            reply = await prefill.stub.RemoteSend(request, timeout=timeout)
            state.kv_write_pending = False  # P answered: its writes landed, notification sent
            state.route.prefill_cached_tokens = reply.prefill_cached_tokens
        except grpc.aio.AioRpcError as err:
            error = self._error(state, prefill, "RemoteSend", err)
            error.settled = err.code() in _NO_WRITE_CODES
            state.kv_write_pending = not error.settled
            raise error from None
        finally:
            prefill.in_flight -= 1
        state.holders.discard(prefill)  # P released its pages when it replied

    async def _run_local(self, state, decode, prompt_token_ids, sampling, plan):
        """D prefills the whole prompt: PrepareReceive (local_prefill) rides inside
        StartGeneration, so the request costs the router one call."""
        state.local = True
        route = state.route
        route.decode_endpoint = decode.address
        route.remote_send_skipped, route.skip_reason = True, plan.reason
        state.holders.add(decode)  # from the call on, D may hold the request
        decode.in_flight += 1
        try:
            decode.prefixes.insert(prompt_token_ids)
            prepare = pdserve_pb2.PrepareReceiveRequest(
                request_id=state.request_id, prompt_token_ids=prompt_token_ids,
                sampling=sampling, kv_window_end=0, lease_ms=self.config.lease_ms,
                local_prefill=True)
            request = pdserve_pb2.StartGenerationRequest(request_id=state.request_id,
                                                         prepare=prepare)
            async for msg in self._start(decode, state, request):
                yield msg
        finally:
            decode.in_flight -= 1

    def _send_early(self, state, prefill, prompt_token_ids, end) -> EarlySend:
        """RemoteSend before D reserved: P prefills prompt[:end] while D reserves."""
        state.route.prefill_endpoint = prefill.address
        state.holders.add(prefill)
        prefill.in_flight += 1
        request = pdserve_pb2.RemoteSendRequest(
            request_id=state.request_id, prompt_token_ids=prompt_token_ids, kv_window_end=end,
            window_follows=True)
        call = prefill.stub.RemoteSend(
            request, timeout=state.timeout(self.config.remote_send_timeout_s))
        return EarlySend(prefill, asyncio.ensure_future(call))

    async def _cancel_early(self, state, early: EarlySend) -> None:
        """No reservation came (or none is needed): P got no window, so it wrote nothing."""
        await self._abort_one(early.prefill, state.request_id, settled=True)
        try:
            await early.call
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass
        finally:
            early.prefill.in_flight -= 1
            state.holders.discard(early.prefill)
        state.route.prefill_endpoint = ""

    async def _finish_early(self, state, decode, early: EarlySend, reserved) -> None:
        """Give P D's half of the window, then wait for its writes."""
        prep, prefill = reserved.prep, early.prefill
        window = pdserve_pb2.RemoteSendWindow(
            request_id=state.request_id, kv_window_begin=prep.prefix_matched_length,
            kv_append_metadata=prep.kv_append_metadata, lease_id=prep.lease_id,
            decode_agent_name=prep.decode_agent_name, decode_address=decode.address,
            lease_expires_unix_ms=prep.lease_expires_unix_ms)
        state.kv_write_pending = True  # from here P may write D's reservation
        try:
            try:
                await prefill.stub.DeliverWindow(window, timeout=state.timeout(
                    self.config.prepare_timeout_s))
            except grpc.aio.AioRpcError:
                pass  # the RemoteSend itself ends with what went wrong
            # Never wait past the lease, as a sequential RemoteSend's deadline would not.
            left = reserved.lease_ends - time.monotonic()
            try:
                reply = await asyncio.wait_for(asyncio.shield(early.call), max(0.0, left))
            except asyncio.TimeoutError:
                early.call.cancel()  # P stops unless its write began (then it lands late)
                raise DispatchError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"RemoteSend on prefill node {prefill.address}: the lease "
                                    f"of request {state.request_id} ended first") from None
            state.kv_write_pending = False
            state.route.prefill_cached_tokens = reply.prefill_cached_tokens
        except grpc.aio.AioRpcError as err:
            error = self._error(state, prefill, "RemoteSend", err)
            error.settled = err.code() in _NO_WRITE_CODES
            state.kv_write_pending = not error.settled
            raise error from None
        except asyncio.CancelledError:
            early.call.cancel()
            raise
        finally:
            prefill.in_flight -= 1
        state.holders.discard(prefill)

    # ---- step 3: generation on the decode node ----------------------------------------
    async def _start(self, decode, state, request):
        call = decode.stub.StartGeneration(
            request, timeout=state.timeout(self.config.generation_timeout_s))
        first = True
        try:
            async for msg in call:
                if msg.HasField("usage"):
                    if state.local:  # D's own prefix hit, known once it scheduled the prompt
                        state.route.prefix_matched_length = msg.usage.cached_prompt_tokens
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

    def _check_aborted(self, state: RequestState) -> None:
        if state.aborted:
            raise DispatchError(grpc.StatusCode.CANCELLED, f"request {state.request_id} aborted")

    def _error(self, state, endpoint, call, err: grpc.aio.AioRpcError) -> DispatchError:
        if state.aborted:
            return DispatchError(grpc.StatusCode.CANCELLED, f"request {state.request_id} aborted")
        code = err.code()
        client_deadline = state.deadline is not None and time.monotonic() >= state.deadline
        if code in _NODE_GONE_CODES and not client_deadline:
            self.registry.report_failure(endpoint, f"{call}: {code.name}")
            code = grpc.StatusCode.UNAVAILABLE
        return DispatchError(code, f"{call} on {endpoint.role} node {endpoint.address}: "
                                   f"{code.name}: {err.details()}")

    # ---- aborts -----------------------------------------------------------------------
    async def abort(self, request_id: str) -> bool:
        """Abort on every node holding the request. The stream then ends with
        finish_reason "abort" (or CANCELLED if it had not started generating)."""
        state = self.active.get(request_id)
        if state is None:
            return False
        state.aborted = True
        # Holders stay recorded: a call still in flight may create state after this Abort
        # lands, and the stream's end aborts them again (Abort is idempotent).
        settled = not state.kv_write_pending
        await asyncio.gather(*(self._abort_one(e, request_id, settled)
                               for e in list(state.holders)))
        return True

    async def drain(self) -> None:
        """SIGTERM: refuse new requests, let the running ones finish (bounded)."""
        from pdserve.server import wait_idle

        self.draining = True
        await wait_idle(lambda: not self.active, self.config.drain_timeout_s)

    def _release(self, state: RequestState) -> None:
        """Abort the request on every node still holding it, without blocking the caller."""
        if not state.holders:
            return
        holders, state.holders = list(state.holders), set()
        settled = not state.kv_write_pending
        for endpoint in holders:
            self._abort_later(endpoint, state.request_id, settled)

    def _abort_later(self, endpoint: Endpoint, request_id: str, settled: bool) -> None:
        task = asyncio.ensure_future(self._abort_one(endpoint, request_id, settled))
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

    async def _abort_one(self, endpoint: Endpoint, request_id: str, settled: bool) -> None:
        try:
            await endpoint.stub.Abort(
                pdserve_pb2.AbortRequest(request_id=request_id, kv_write_settled=settled),
                timeout=self.config.abort_timeout_s)
        except grpc.aio.AioRpcError as err:
            log.warning("Abort %s on %s failed: %s", request_id, endpoint.address, err.details())
