"""The decode role: reserve KV slots for a prompt, wait for them to be filled, generate.

Request kinds, one per method:
- `prepare_receive(PrepareReceive)` resolves the window end, reserves slots for
  [matched, end) in the engine (which parks the request) and grants a lease; short of
  pages, it waits in line for them (decode/page_line.py) instead of refusing; the append
  metadata it returns names exactly those slots. The engine knows each reservation by
  `<request_id>@<lease>`, so a retry of a request id never collides with a quarantined
  earlier reservation.
- `start_generation(StartGeneration)` takes the lease (so expiry can no longer free it),
  waits (bounded) for the prefill node's notification when KV was sent (pages are never
  read before their writes completed), then un-parks and streams engine outputs.
- `prepare_local(LocalPrefill)` (selective disaggregation) reserves nothing: the lease only
  remembers the prompt, and its StartGeneration submits it as an ordinary request, so the
  engine matches this node's prefix cache when it schedules it and prefills the rest here.
  No KV is received for such a lease (kv_window_end 0, no notification).
  `generate_local(LocalPrefill)` is both in one call.
- `abort` and lease expiry free the request. A reservation whose KV may still be on its
  way is not freed but quarantined (decode/quarantine.py) unless the caller says no write
  can come (`settled`): no page is reused while a prefill node may still write into it.
Every path frees the reservation exactly once; `busy()` is False once nothing is held
for a caller (used to drain on SIGTERM). Sampling values are checked by the engine's own
rules (`SamplingParams.validate`) before anything is reserved.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pdserve.arith import ceil_div
from pdserve.decode.config import DecodeConfig
from pdserve.decode.fence import ask_writer
from pdserve.decode.inbox import Interrupted, NotificationInbox
from pdserve.decode.leases import Lease, LeaseTable, engine_key_for
from pdserve.decode.page_line import PageLine
from pdserve.decode.quota import CallerQuota
from pdserve.decode.quarantine import Quarantine, tags
from pdserve.decode.requests import (DecodeLoad, LocalPrefill, Prepared, PrepareReceive,  # noqa: F401
                             StartGeneration)  # (StartGeneration, LocalPrefill: re-exported)
from pdserve.engine import SamplingParams
from pdserve.kvtransfer.metadata import encode_append_metadata
from pdserve.kvtransfer.window import resolve_kv_window_end
from pdserve.proto.tags import notification_tag
from pdserve.runtime import cluster_key, metrics
from pdserve.runtime.errors import NodeDraining, NodeOverloaded, Refused, RequestAborted, TimedOut

log = logging.getLogger("pdserve.decode")


class KVNotArrived(TimedOut):
    """The prefill node's notification did not come within the bound."""


class KVNotWritten(Refused):
    """The prefill node reported that it did not write the reservation's KV."""


@dataclass
class _Started:
    """A request between StartGeneration and the end of its stream."""

    lease: Lease
    waiting_for_kv: bool = False
    aborted: bool = False
    settled: bool = False


class DecodeRole:
    def __init__(self, engine, agent, config: DecodeConfig, vocab_size: int,
                 max_model_len: int, gates=None, page_size: int = 1) -> None:
        self.engine = engine  # AsyncEngine
        self.gates = gates    # runtime.gates.Gates in fault tests, else None
        self.agent = agent    # TransferAgent (or one with the same notification calls)
        self.config = config
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self.leases = LeaseTable(self._on_expire)
        self.inbox = NotificationInbox(agent)
        self.page_size = page_size
        self.line = PageLine(config.max_queued_reservations, config.max_queue_wait_s)
        self.quota = CallerQuota(config.max_parked_fraction_per_caller, engine.capacity.num_pages)
        self.quarantine = Quarantine(self.inbox, self._free, config.quarantine_grace_ms / 1000,
                                     ask_writer)
        self.preparing: dict[str, bool] = {}  # request id -> aborted while preparing
        self.generating: dict[str, _Started] = {}
        self.draining = False
        self.requests_total = 0
        self.prefix_hit_tokens_total = 0

    # ---- request kinds -------------------------------------------------------------------
    async def prepare_receive(self, req: PrepareReceive) -> Prepared:
        started = time.perf_counter()
        lease_ms = self._admit(req.request_id, req.params, req.lease_ms)
        end = resolve_kv_window_end(req.kv_window_end, len(req.prompt_token_ids))
        self.engine.capacity.check_fits(len(req.prompt_token_ids), req.params)  # before the line
        lease_id = uuid.uuid4().hex
        key = engine_key_for(req.request_id, lease_id)
        self.preparing[req.request_id] = False

        async def attempt():
            if self.preparing.get(req.request_id):
                raise RequestAborted(f"request {req.request_id!r} was aborted while waiting "
                                     "for KV pages")
            return await self._reserve(
                key, lambda e: e.prepare_receive(key, req.prompt_token_ids, req.params, end,
                                                 req.cache_salt, req.priority, req.lora))
        pages, passed = ceil_div(end, self.page_size), False
        try:
            await self._within_quota(req, pages)
            self.quota.passing(req.caller, pages)  # counted until its lease is
            passed = True
            reservation, waited_s = await self.line.wait(attempt, _line_bound(req.timeout_s), req.priority)
            metrics.QUEUE_TIME.labels(role="decode").observe(waited_s)
        finally:
            aborted = self.preparing.pop(req.request_id)
            if passed:  # no await from here to the lease's grant
                self.quota.passed(req.caller, pages)
        if aborted:
            await self._free(key)
            raise RequestAborted(f"request {req.request_id!r} was aborted while reserving")
        lease = self.leases.grant(
            req.request_id, lease_ms / 1000, lease_id=lease_id, engine_key=key,
            prompt_len=len(req.prompt_token_ids),
            prefix_matched_length=reservation.prefix_matched_length,
            kv_window_end=reservation.kv_window_end, reserve_s=time.perf_counter() - started,
            queued_s=waited_s,
            writer_address=req.writer_address, caller=req.caller,
            num_pages=len({slot // self.page_size for slot in reservation.slots}))
        self.agent.stay_active(lease_ms / 1000)  # the writes land meanwhile: no idle polling
        self.requests_total += 1
        self.prefix_hit_tokens_total += reservation.prefix_matched_length
        return self._signed(lease, encode_append_metadata(reservation.slots))

    def _signed(self, lease: Lease, metadata: list[int]) -> Prepared:
        """The reservation with D's capability for its window (runtime/cluster_key.py)."""
        lease_ms = max(1, round((lease.expires_at - time.monotonic()) * 1000))
        issued = round(time.time() * 1000)
        key = cluster_key.current()
        if not key.enabled:  # an open cluster signs nothing
            return Prepared(lease, metadata, lease_ms, b"", issued)
        fields = cluster_key.window_fields(
            lease.request_id, lease.lease_id, lease.prefix_matched_length, lease.kv_window_end,
            metadata, self.agent.name, lease_ms, issued)
        return Prepared(lease, metadata, lease_ms, key.sign(*fields), issued)

    async def prepare_local(self, req: LocalPrefill) -> Prepared:
        lease_ms = self._admit(req.request_id, req.params, req.lease_ms)
        self.engine.capacity.check_fits(len(req.prompt_token_ids), req.params)
        if not req.prompt_token_ids:
            raise ValueError("prompt is empty")
        lease_id = uuid.uuid4().hex
        lease = self.leases.grant(
            req.request_id, lease_ms / 1000, lease_id=lease_id,
            engine_key=engine_key_for(req.request_id, lease_id), prompt_len=len(req.prompt_token_ids),
            prefix_matched_length=0, kv_window_end=0, local_prompt=list(req.prompt_token_ids),
            local_params=req.params, local_cache_salt=req.cache_salt, local_priority=req.priority,
            local_lora=req.lora)
        self.requests_total += 1
        return Prepared(lease, encode_append_metadata([]))

    async def start_generation(self, req: StartGeneration) -> AsyncIterator:
        """Engine RequestOutput deltas. Raises LeaseError, ValueError, KVNotArrived,
        KVNotWritten or RequestAborted."""
        lease = self.leases.peek(req.request_id, req.lease_id)
        if req.kv_window_begin != lease.kv_window_end:
            raise ValueError(f"kv_window_begin {req.kv_window_begin} must equal the reserved "
                             f"kv_window_end {lease.kv_window_end}")
        if not req.expect_kv and lease.prefix_matched_length < lease.kv_window_end:
            raise ValueError(  # unwritten pages would be computed KV, and enter the prefix cache
                f"expect_kv_notification is false, but positions [{lease.prefix_matched_length}, "
                f"{lease.kv_window_end}) of request {req.request_id!r} are reserved to be received")
        self.leases.take(req.request_id, req.lease_id)
        started = self.generating[req.request_id] = _Started(lease, waiting_for_kv=req.expect_kv)
        streaming = False
        try:
            if req.expect_kv:
                await self._wait_for_kv(started, req.timeout_s)
            if started.aborted:
                raise RequestAborted(f"request {req.request_id!r} was aborted")
            streaming = True
            # From here the engine's stream owns the request: it aborts it if we stop early.
            if lease.local_prompt is not None:
                stream = self.engine.generate(lease.engine_key, lease.local_prompt, lease.local_params,
                                              cache_salt=lease.local_cache_salt, priority=lease.local_priority,
                                              lora=lease.local_lora)
            else:
                stream = self.engine.start_generation(lease.engine_key)
            first = True
            async for out in stream:
                if out.finished:  # out of the load reports before its caller hears it ended, so a
                    self.generating.pop(req.request_id, None)  # report read after that never counts it
                yield out
                if first and self.gates is not None:  # fault tests hold a stream here
                    first = False
                    await self.gates.passage("stream", req.request_id)
        except BaseException as err:
            if not streaming:  # still parked in the engine, with the lease already taken
                kv_may_come = started.waiting_for_kv and not started.settled \
                    and not isinstance(err, KVNotWritten)
                if kv_may_come:
                    self.quarantine.hold(lease)
                else:
                    await asyncio.shield(self._free(lease.engine_key))
            raise
        finally:
            self.generating.pop(req.request_id, None)
            self.line.freed()  # its pages (the engine freed or cached them) may serve the line

    async def generate_local(self, req: LocalPrefill, timeout_s: float | None = None
                             ) -> AsyncIterator:
        """`prepare_local` and its StartGeneration in one call."""
        prepared = await self.prepare_local(req)
        start = StartGeneration(req.request_id, prepared.lease.lease_id, 0, False, timeout_s)
        async for out in self.start_generation(start):
            yield out

    async def abort(self, request_id: str, settled: bool = False, lease_id: str = "") -> bool:
        """Free everything of `request_id` (with `lease_id`: only that reservation).
        `settled`: no RemoteSend can still write it."""
        if request_id in self.preparing:
            if lease_id:  # the caller cannot know the lease being made: it named an older one
                return False
            self.preparing[request_id] = True
            self.line.freed()  # one waiting in line leaves at once
            return True
        lease = self.leases.drop(request_id, lease_id)
        if lease is not None:
            if settled:
                await self._free(lease.engine_key)
            else:
                self.quarantine.hold(lease)
            return True
        started = self.generating.get(request_id)
        if started is not None and lease_id in ("", started.lease.lease_id):
            started.aborted = True
            if started.waiting_for_kv:
                started.settled = settled
                self.inbox.interrupt(tags(started.lease),
                                     Interrupted.SETTLED if settled else Interrupted.ABORTED)
            else:
                await self._free(started.lease.engine_key)
            return True
        # Only an Abort naming the lease releases a quarantined reservation: a request may
        # hold several (one per failed attempt), and the caller's word that no write can
        # come covers only the attempt it knows of.
        return settled and bool(lease_id) and self.quarantine.settle(request_id, lease_id)

    # ---- internals -------------------------------------------------------------------------
    async def _reserve(self, key: str, run):
        reserve = asyncio.ensure_future(self.engine.run(run))
        try:
            return await asyncio.shield(reserve)
        except asyncio.CancelledError:
            # The caller never saw the lease, so nobody can write into it: free at once.
            reserve.add_done_callback(lambda f: f.cancelled() or f.exception() or
                                      asyncio.ensure_future(self._free(key)))
            raise

    async def _within_quota(self, req: PrepareReceive, pages: int) -> None:
        """Wait until the caller's parked pages leave room for `pages` more, in its order
        (decode/quota.py): outside the line, so nobody waits behind a caller over its bound;
        NodeOverloaded past the line's bounds. A router's burst waits for its own
        reservations to start."""
        bound = _line_bound(req.timeout_s)
        deadline = time.monotonic() + min(self.config.max_queue_wait_s,
                                          bound if bound is not None else float("inf"))
        turn = None
        try:
            while True:
                if self.preparing.get(req.request_id):
                    raise RequestAborted(f"request {req.request_id!r} was aborted while reserving")
                try:
                    if not self.quota.may_try(req.caller, req.priority, turn):
                        raise NodeOverloaded(f"earlier reservations of caller {req.caller or 'in-process'!r} "
                                             "still wait for its bound of KV pages in reservations not yet "
                                             f"started (max_parked_fraction_per_caller {self.quota.fraction})")
                    return self.quota.check(req.caller, self.leases.parked_pages(req.caller), pages)
                except NodeOverloaded:
                    if time.monotonic() >= deadline:
                        raise
                    turn = turn or self.quota.join(req.caller, req.priority)
                await asyncio.sleep(min(0.05, max(0.0, deadline - time.monotonic())))  # a poll
        finally:
            if turn is not None:
                self.quota.leave(req.caller, turn)

    def _admit(self, request_id: str, params: SamplingParams, lease_ms: int) -> int:
        """Checks every new reservation passes; the lease it gets."""
        if self.draining:
            raise NodeDraining("decode node is draining: no new reservations")
        params.validate(self.vocab_size, self.max_model_len)
        if request_id in self.preparing or request_id in self.leases or \
                request_id in self.generating:
            raise ValueError(f"duplicate request_id {request_id!r}")
        lease_ms = lease_ms or self.config.lease_ms
        if not 0 < lease_ms <= self.config.max_lease_ms:
            raise ValueError(f"lease_ms must be in [0, {self.config.max_lease_ms}] (0: default), "
                             f"got {lease_ms}")
        if len(self.leases) + len(self.preparing) >= self.config.max_parked:
            raise NodeOverloaded(f"decode node holds its limit of {self.config.max_parked} "
                                 "parked reservations")
        return lease_ms

    async def _wait_for_kv(self, started: _Started, timeout_s: float | None) -> None:
        lease = started.lease
        timeout = self.config.notification_timeout_s
        if timeout_s is not None:
            timeout = min(timeout, timeout_s)
        got = await self.inbox.wait(tags(lease), timeout)
        if got == notification_tag(lease.request_id, lease.lease_id):
            started.waiting_for_kv = False
        elif got is None:
            raise KVNotArrived(f"KV of request {lease.request_id!r} did not arrive within "
                               f"{timeout:g}s")
        elif not isinstance(got, Interrupted):  # the prefill node's no-write notice
            raise KVNotWritten(f"the prefill node did not write the KV of request "
                               f"{lease.request_id!r}")

    async def _on_expire(self, lease: Lease) -> None:
        log.warning("lease of request %s expired; quarantining its reservation", lease.request_id)
        self.quarantine.hold(lease)

    async def _free(self, engine_key: str) -> None:
        await self.engine.abort(engine_key)
        self.line.freed()

    # ---- node ------------------------------------------------------------------------------
    def busy(self) -> bool:
        return bool(self.leases or self.preparing or self.generating)

    def load(self) -> DecodeLoad:
        q = self.quarantine
        return DecodeLoad(len(self.leases), len(self.generating), self.requests_total,
                          self.prefix_hit_tokens_total, self.leases.expired_total,
                          len(q), q.late_writes_total, q.fenced_writers(), q.fenced_pages())

    def close(self) -> None:
        self.inbox.close()


def _line_bound(timeout_s: float | None) -> float | None:
    """How long a reservation may wait in line: its caller's deadline less a margin, so the
    caller hears RESOURCE_EXHAUSTED (and why) rather than its own deadline passing."""
    return None if timeout_s is None else timeout_s - max(0.25, 0.05 * timeout_s)
