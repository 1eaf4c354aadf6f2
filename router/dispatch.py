"""Disaggregated dispatch of one request, as the protocol reads: plan, reserve on a decode
node, send the KV window from a prefill node (or let the decode node prefill it), start
generation; and abort.

1. Plan (router/selective.py): D is picked; the plan says whether D prefills the whole
   prompt itself (`local`: one StartGeneration carrying its PrepareReceive) and where the
   KV window ends.
2. Reserve: PrepareReceive on D. If D is gone or full, the next decode node; while some
   node is only full, retry with backoff for up to `full_retry_s`. With overlap on, the
   RemoteSend goes out before this (`window_follows`), so P computes while D reserves.
3. Send KV (only when D's prefix hit leaves something to send, `matched < end`): a failed
   RemoteSend gets a fresh reservation and another prefill node, or finally D prefills the
   whole prompt itself. The client never sees a prefill failure.
4. Start: StartGeneration on D streams the tokens back. Once tokens flow, a decode failure
   is the client's: UNAVAILABLE, the node named in the router's log.
Admission (router/admission.py), per-request state (router/state.py) and how each call is
made (router/calls.py) live apart; this file is the order of the calls.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc

from pdserve.arith import ceil_div
from pdserve.proto import pdserve_pb2
from pdserve.router import selective
from pdserve.router.admission import Admission
from pdserve.router.calls import NodeCalls
from pdserve.router.config import RouterConfig
from pdserve.router.registry import Endpoint, NoEndpointError, WorkerRegistry
from pdserve.router.state import DispatchError, EarlySend, RequestState, Reserved
from pdserve.runtime import metrics
from pdserve.runtime.server import wait_idle

log = logging.getLogger("pdserve.router")
# Failures after which another decode node may do: the node is gone, or it is full.
_TRY_ANOTHER_DECODE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


class Dispatcher:
    def __init__(self, config: RouterConfig, registry: WorkerRegistry) -> None:
        self.config = config
        self.registry = registry
        self.admission = Admission(config)
        self.calls = NodeCalls(config, registry)
        self.load_monitor = None  # router/load.py; told when requests arrive

    @property
    def active(self) -> dict[str, RequestState]:
        return self.admission.active

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       sampling: pdserve_pb2.SamplingParams, kv_window_end: int | None,
                       timeout_s: float | None = None
                       ) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
        state = self.admission.admit(request_id, timeout_s)
        try:
            async with self.admission.turn(state):
                state.check_aborted()
                async for msg in self._run(state, prompt_token_ids, sampling, kv_window_end):
                    yield msg
                state.holders.clear()  # finished normally: D freed or cached everything
        finally:
            self.admission.leave(state)
            self.calls.release(state)

    async def _run(self, state: RequestState, prompt_token_ids, sampling, kv_window_end):
        state.prompt_tokens = len(prompt_token_ids)
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
                if started or state.aborted or err.code not in _TRY_ANOTHER_DECODE:
                    raise
                log.info("%s; trying another decode node", err.detail)
                if err.code == grpc.StatusCode.UNAVAILABLE:  # it may hold the request
                    state.maybe_reserved.add(first)
                first = None
        early = prefill = None
        if not plan.local and plan.end > 0:  # picked first: D's reservation names its writer
            prefill = self._next_prefill(prompt_token_ids, [])
            # Overlap only where D has room now: a request that will wait in D's line for
            # pages would have P prefill it for nothing (its window would come too late).
            if prefill is not None and self.config.overlap_prefill and \
                    _room_for(first, len(prompt_token_ids)):
                state.route.prefill_endpoint = prefill.address
                early = self.calls.send_early(state, prefill, prompt_token_ids, plan.end)
        try:
            decode, reserved = await self._reserve(state, prompt_token_ids, sampling, plan, first,
                                                   prefill)
        except BaseException:
            if early is not None:
                await self._cancel_early(state, early)
            raise
        state.route.decode_endpoint = decode.address
        decode.in_flight += 1
        try:
            sent = False
            if reserved.prep.prefix_matched_length < reserved.prep.kv_window_end:
                reserved, sent = await self._send_kv(state, decode, reserved, prompt_token_ids,
                                                     sampling, prefill, early)
            elif early is not None:
                await self._cancel_early(state, early)
            self._record_route(state, reserved, sent, plan)
            decode.prefixes.insert(prompt_token_ids)  # what D will have cached
            state.check_aborted()
            request = self.calls.start_request(state, reserved, sent)
            async for msg in self._start(decode, state, request, prompt_token_ids, sampling):
                yield msg
        finally:
            decode.in_flight -= 1

    async def _start(self, decode, state, request, prompt_token_ids, sampling):
        """D's stream. A lease that ended just before StartGeneration reached D (NOT_FOUND,
        nothing streamed yet: the KV came too late, or the call did) is no failure of the
        client's: D prefills the prompt itself, in one call."""
        started = False
        try:
            async for msg in self.calls.start(decode, state, request):
                started = True
                yield msg
            return
        except DispatchError as err:
            if started or state.aborted or err.code != grpc.StatusCode.NOT_FOUND:
                raise
            log.warning("%s; decode node %s prefills the prompt itself", err.detail,
                        decode.address)
        metrics.record_fallback("lease_ended")
        state.local = True
        state.prefill_s = state.transfer_s = 0.0  # that KV went unused: D prefills it all
        state.route.remote_send_skipped, state.route.skip_reason = True, "lease_ended"
        request = self.calls.start_local_request(state, prompt_token_ids, sampling)
        async for msg in self.calls.start(decode, state, request):
            yield msg

    def _plan(self, prompt_token_ids, kv_window_end, decode) -> selective.Plan:
        c = self.config
        return selective.plan(prompt_token_ids, c.kv_window_end if kv_window_end is None
                              else kv_window_end, decode, self.registry.usable("prefill"),
                              self.registry.usable("decode"), c.min_remote_prefill_tokens,
                              c.prefill_saturated_queue, c.auto_max_tail,
                              c.prefill_saturated_wait_fraction * c.lease_ms / 1000)

    async def _run_local(self, state, decode, prompt_token_ids, sampling, plan):
        """D prefills the whole prompt, in one call."""
        state.local = True
        route = state.route
        route.decode_endpoint = decode.address
        route.remote_send_skipped, route.skip_reason = True, plan.reason
        state.holders.add(decode)  # from the call on, D may hold the request
        decode.in_flight += 1
        try:
            decode.prefixes.insert(prompt_token_ids)
            request = self.calls.start_local_request(state, prompt_token_ids, sampling)
            async for msg in self.calls.start(decode, state, request):
                yield msg
        finally:
            decode.in_flight -= 1

    # ---- step 2: a reservation on some decode node ----------------------------------
    async def _reserve(self, state, prompt_token_ids, sampling, plan, first=None, writer=None
                       ) -> tuple[Endpoint, Reserved]:
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
                    if first is not None and first.usable and first not in state.maybe_reserved:
                        decode, first = first, None
                    else:
                        decode = self.registry.pick("decode", prompt_token_ids,
                                                    exclude=tried + list(state.maybe_reserved))
                except NoEndpointError:
                    if not errors:
                        raise
                    break
                tried.append(decode)
                attempts += 1
                if attempts > 1:
                    metrics.record_retry("PrepareReceive")
                try:
                    return decode, await self.calls.prepare(
                        decode, state, prompt_token_ids, sampling, plan.kv_window_end, plan.local,
                        writer)
                except DispatchError as err:
                    if state.aborted or err.code not in _TRY_ANOTHER_DECODE:
                        raise
                    errors.append(err)
                    log.info("%s; trying another decode node", err.detail)
            full = [e for e in errors if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED]
            if full and state.deadline is not None and time.monotonic() + backoff >= state.deadline:
                raise DispatchError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"request {state.request_id} ran out of its deadline while "
                                    f"waiting for KV pages ({full[-1].message})")
            if not full or time.monotonic() + backoff > give_up:
                raise (full or errors)[-1]
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 0.5)
            state.check_aborted()

    # ---- step 3: the KV window from a prefill node ------------------------------------
    async def _send_kv(self, state, decode, reserved, prompt_token_ids, sampling,
                       prefill: Endpoint | None, early: EarlySend | None = None
                       ) -> tuple[Reserved, bool]:
        """(reservation, sent) with `prefill`, the writer D's reservation names. Retries
        another prefill node on a fresh reservation, and finally lets D prefill the whole
        prompt: the client never sees a prefill failure."""
        tried: list[Endpoint] = []
        while prefill is not None:
            tried.append(prefill)
            state.route.prefill_endpoint = prefill.address
            try:
                if early is not None:
                    reply = await self.calls.finish_early(state, decode, early, reserved)
                else:
                    reply = await self.calls.remote_send(state, decode, prefill, reserved,
                                                         prompt_token_ids)
                state.route.prefill_cached_tokens = reply.prefill_cached_tokens
                state.prefill_s, state.transfer_s = reply.prefill_s, reply.transfer_s
                prefill.prefixes.insert(prompt_token_ids[:reserved.prep.kv_window_end])
                return reserved, True
            except DispatchError as err:
                early = None
                if state.aborted:
                    raise
                # The failed attempt may still write its reservation: D quarantines it
                # unless P answered without writing.
                await self.calls.abort(decode, state.request_id, err.settled,
                                       reserved.prep.lease_id)
                prefill = self._next_prefill(prompt_token_ids, tried)
                log.warning("%s; %s", err.detail,
                            f"retrying on prefill node {prefill.address}" if prefill else
                            f"decode node {decode.address} prefills the prompt itself")
                if prefill is not None:
                    metrics.record_retry("RemoteSend")
                    reserved = await self.calls.prepare(decode, state, prompt_token_ids, sampling,
                                                        reserved.prep.kv_window_end, writer=prefill)
                else:
                    metrics.record_fallback("decode_prefill")
                    state.route.skip_reason = "fallback"
                    reserved = await self.calls.prepare(decode, state, prompt_token_ids,
                                                        sampling, 0, local=True)
                if reserved.prep.prefix_matched_length >= reserved.prep.kv_window_end:
                    return reserved, False
        # No prefill node was routable: D prefills the whole prompt on a fresh reservation.
        metrics.record_fallback("no_prefill")
        state.route.skip_reason = "no_prefill"
        await self.calls.abort(decode, state.request_id, True, reserved.prep.lease_id)
        return await self.calls.prepare(decode, state, prompt_token_ids, sampling, 0,
                                        local=True), False

    def _next_prefill(self, prompt_token_ids, tried) -> Endpoint | None:
        if len(tried) >= self.config.max_prefill_attempts:
            return None
        try:
            return self.registry.pick("prefill", prompt_token_ids, exclude=tried)
        except NoEndpointError:
            return None

    async def _cancel_early(self, state: RequestState, early: EarlySend) -> None:
        await self.calls.cancel_early(state, early)
        state.route.prefill_endpoint = ""

    @staticmethod
    def _record_route(state: RequestState, reserved: Reserved, sent: bool, plan) -> None:
        route, prep = state.route, reserved.prep
        route.prefix_matched_length = prep.prefix_matched_length
        route.kv_window_begin = prep.prefix_matched_length
        route.kv_window_end = prep.kv_window_end
        route.remote_send_skipped = not sent
        if not sent:
            route.prefill_endpoint = ""
            route.prefill_cached_tokens = 0
            route.skip_reason = route.skip_reason or plan.reason or "requested"

    # ---- aborts and shutdown ------------------------------------------------------------
    async def abort(self, request_id: str) -> bool:
        """Abort on every node holding the request. The stream then ends with
        finish_reason "abort" (or CANCELLED if it had not started generating)."""
        state = self.admission.active.get(request_id)
        if state is None:
            return False
        state.aborted = True
        # Holders stay recorded: a call still in flight may create state after this Abort
        # lands, and the stream's end aborts them again (Abort is idempotent).
        settled = not state.kv_write_pending
        await asyncio.gather(*(self.calls.abort(e, request_id, settled)
                               for e in list(state.holders)))
        return True

    async def drain(self) -> None:
        """SIGTERM: refuse new requests, let the running ones finish (bounded)."""
        self.admission.draining = True
        await wait_idle(lambda: not self.admission.active, self.config.server.drain_timeout_s)


def _room_for(decode: Endpoint | None, prompt_len: int) -> bool:
    """Whether `decode` had free pages for the prompt at its last load report (unknown:
    yes). Its prefix cache may need fewer; never more."""
    if decode is None or decode.identity is None or not decode.total_pages:
        return True
    return ceil_div(prompt_len, decode.identity.page_size) <= decode.free_pages
