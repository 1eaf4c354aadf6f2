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
from pdserve.router.admission import Admission, admission_tokens
from pdserve.router.cache_salt import effective_salt
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
    def active(self) -> dict[tuple[str, str], RequestState]:  # by (tenant, client's id)
        return self.admission.active

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       sampling: pdserve_pb2.SamplingParams, kv_window_end: int | None,
                       timeout_s: float | None = None, *, cache_salt: str = "",
                       tenant: str = "default", priority: int = 0, cache_key: str = "", lora: str = ""
                       ) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
        """`tenant`'s request (runtime/tenants.py): its id is scoped to the tenant, and it
        waits for the tenant's turn (router/admission.py), ahead of the tenant's requests
        of a higher `priority`; `cache_key` (prompt_cache_key) picks its nodes; `lora`: the
        LoRA adapter it runs with (checked by the caller: router/validation.py `lora_of`)."""
        state = self.admission.admit(request_id, timeout_s, tenant,
                                     admission_tokens(prompt_token_ids, sampling))
        state.priority, state.cache_key, state.lora = priority, cache_key, lora
        try:
            # An adapter's prompts have KV of their own: the prefix index keeps them apart too.
            state.cache_salt = effective_salt(state.tenant, cache_salt, self.config.shared_prefix_cache,
                                              lora)
            async with self.admission.turn(state):
                state.check_aborted()
                async for msg in self._run(state, prompt_token_ids, sampling, kv_window_end):
                    msg.request_id = state.client_id  # the nodes know its node-side id
                    yield msg
                state.holders.clear()  # finished normally: D freed or cached everything
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():  # the client went away: nobody to tell
                raise
            # A node call was cancelled under the request: gRPC would end the client's call
            # with no status at all, and the client would wait for its deadline.
            log.warning("request %s: a call to a node was cancelled under it", state.request_id)
            raise DispatchError(grpc.StatusCode.UNAVAILABLE, f"a node serving request "
                                f"{state.client_id} stopped answering before it finished; "
                                "retry the request") from None
        finally:
            self.admission.leave(state)
            self.calls.release(state)

    async def _run(self, state: RequestState, prompt_token_ids, sampling, kv_window_end):
        state.prompt_tokens = len(prompt_token_ids)
        if self.load_monitor is not None:
            self.load_monitor.mark_busy()
        salt = state.cache_salt  # every prefix match and record of it is under its salt
        first = self.registry.pick("decode", prompt_token_ids, **state.placement)
        plan = self._plan(prompt_token_ids, kv_window_end, first, salt, sampling)
        waited = time.monotonic()
        while plan.wait:  # steady: every side saturated; the reports tell when one frees
            if time.monotonic() - waited >= self.config.max_queue_wait_s:
                plan = selective.Plan(0, 0, True, "prefill_saturated")  # D, chunked, at last
                break
            await asyncio.sleep(state.timeout(self.config.load_interval_s))
            state.check_aborted()
            first = self.registry.pick("decode", prompt_token_ids, **state.placement)
            plan = self._plan(prompt_token_ids, kv_window_end, first, salt, sampling)
        state.queue_s += time.monotonic() - waited
        if plan.local and first is not None and first.steps is not None:
            first.steps.prompt_backlog_tokens += len(prompt_token_ids)  # until D's next report
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
            prefill = self._next_prefill(prompt_token_ids, [], state.placement)
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
            state.record_route(reserved.prep, sent, plan.reason)
            decode.prefixes.insert(prompt_token_ids, salt)  # what D will have cached
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

    def _plan(self, prompt_token_ids, kv_window_end, decode, salt: str, sampling) -> selective.Plan:
        c = self.config
        return selective.plan(prompt_token_ids, c.kv_window_end if kv_window_end is None
                              else kv_window_end, decode, self.registry.usable("prefill"),
                              self.registry.usable("decode"), c.min_remote_prefill_tokens,
                              c.prefill_saturated_queue, c.auto_max_tail,
                              c.prefill_saturated_wait_fraction * c.lease_ms / 1000, salt,
                              steady=c.disagg_policy == "steady",
                              scores_prompt=sampling.HasField("prompt_logprobs"))

    async def _run_local(self, state, decode, prompt_token_ids, sampling, plan):
        """D prefills the whole prompt, in one call."""
        state.local = True
        route = state.route
        route.decode_endpoint = decode.address
        route.remote_send_skipped, route.skip_reason = True, plan.reason
        state.holders.add(decode)  # from the call on, D may hold the request
        decode.in_flight += 1
        try:
            decode.prefixes.insert(prompt_token_ids, state.cache_salt)
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
                                                    exclude=tried + list(state.maybe_reserved),
                                                    **state.placement)
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
                                    f"request {state.client_id} ran out of its deadline while "
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
                prefill.prefixes.insert(prompt_token_ids[:reserved.prep.kv_window_end],
                                        state.cache_salt)
                return reserved, True
            except DispatchError as err:
                early = None
                if state.aborted:
                    raise
                # The failed attempt may still write its reservation: D quarantines it
                # unless P answered without writing.
                await self.calls.abort(decode, state.request_id, err.settled,
                                       reserved.prep.lease_id)
                prefill = self._next_prefill(prompt_token_ids, tried, state.placement)
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

    def _next_prefill(self, prompt_token_ids, tried, placement: dict) -> Endpoint | None:
        if len(tried) >= self.config.max_prefill_attempts:
            return None
        try:
            return self.registry.pick("prefill", prompt_token_ids, exclude=tried, **placement)
        except NoEndpointError:
            return None

    async def _cancel_early(self, state: RequestState, early: EarlySend) -> None:
        await self.calls.cancel_early(state, early)
        state.route.prefill_endpoint = ""

    # ---- aborts and shutdown ------------------------------------------------------------
    async def abort(self, request_id: str, tenant: str = "default") -> bool:
        """Abort `tenant`'s request on every node holding it; False when the tenant has no
        such request (another tenant's is none of its own). The stream then ends with
        finish_reason "abort" (or CANCELLED if it had not started generating)."""
        state = self.admission.find(tenant, request_id)
        if state is None:
            return False
        state.aborted = True
        # Holders stay recorded: a call still in flight may create state after this Abort
        # lands, and the stream's end aborts them again (Abort is idempotent).
        settled = not state.kv_write_pending
        await asyncio.gather(*(self.calls.abort(e, state.request_id, settled)
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
