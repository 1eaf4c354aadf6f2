"""The decode role: reserve KV slots for a prompt, wait for them to be filled, generate.

- `prepare_receive` resolves the window end, reserves slots for [matched, end) in the
  engine (which parks the request) and grants a lease; the append metadata it returns
  names exactly those slots. The engine knows each reservation by `<request_id>@<lease>`,
  so a retry of a request id never collides with a quarantined earlier reservation.
- `start_generation` takes the lease (so expiry can no longer free it), waits (bounded)
  for the prefill node's notification when KV was sent (pages are never read before their
  writes completed), then un-parks and streams engine outputs.
- `prepare_receive(local_prefill=True)` (selective disaggregation) reserves nothing: the
  lease only remembers the prompt, and `start_generation` submits it as an ordinary request,
  so the engine matches this node's prefix cache when it schedules it and prefills the rest
  here. No KV is received for such a lease (kv_window_end 0, no notification).
- `abort` and lease expiry free the request. A reservation whose KV may still be on its
  way is not freed but quarantined (decode/quarantine.py) unless the caller says no write
  can come (`settled`): no page is reused while a prefill node may still write into it.
Every path frees the reservation exactly once; `busy()` is False once nothing is held
for a caller (used to drain on SIGTERM).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from decode.config import DecodeConfig
from decode.inbox import NotificationInbox
from decode.leases import Lease, LeaseTable
from decode.quarantine import SETTLED, Quarantine, tags
from engine import SamplingParams
from kvtransfer.metadata import encode_append_metadata
from kvtransfer.window import resolve_kv_window_end
from pdserve.errors import NodeDraining, NodeOverloaded, RequestAborted
from proto.tags import notification_tag

log = logging.getLogger("pdserve.decode")


class KVNotArrived(Exception):
    """The prefill node's notification did not come within the bound."""


class KVNotWritten(Exception):
    """The prefill node reported that it did not write the reservation's KV."""


@dataclass
class Prepared:
    lease: Lease
    kv_append_metadata: list[int]


@dataclass
class Started:
    """A request between StartGeneration and the end of its stream."""

    lease: Lease
    waiting_for_kv: bool = False
    aborted: bool = False
    settled: bool = False


class DecodeRole:
    def __init__(self, engine, agent, config: DecodeConfig) -> None:
        self.engine = engine  # AsyncEngine
        self.agent = agent    # TransferAgent
        self.config = config
        self.leases = LeaseTable(self._on_expire)
        self.inbox = NotificationInbox(agent)
        self.quarantine = Quarantine(self.inbox, self._free, config.quarantine_grace_ms / 1000)
        self.preparing: dict[str, bool] = {}  # request id -> aborted while preparing
        self.generating: dict[str, Started] = {}
        self.draining = False
        self.requests_total = 0
        self.prefix_hit_tokens_total = 0

    async def prepare_receive(self, request_id: str, prompt_token_ids: list[int],
                              params: SamplingParams, kv_window_end: int,
                              lease_ms: int, local_prefill: bool = False) -> Prepared:
        if self.draining:
            raise NodeDraining("decode node is draining: no new reservations")
        if request_id in self.preparing or request_id in self.leases or request_id in self.generating:
            raise ValueError(f"duplicate request_id {request_id!r}")
        lease_ms = lease_ms or self.config.lease_ms
        if not 0 < lease_ms <= self.config.max_lease_ms:
            raise ValueError(f"lease_ms must be in [0, {self.config.max_lease_ms}] (0: default), "
                             f"got {lease_ms}")
        if len(self.leases) + len(self.preparing) >= self.config.max_parked:
            raise NodeOverloaded(f"decode node holds its limit of {self.config.max_parked} "
                                 "parked reservations")
        if local_prefill:
            return self._prepare_local(request_id, prompt_token_ids, params, kv_window_end,
                                       lease_ms)
        end = resolve_kv_window_end(kv_window_end, len(prompt_token_ids))
        lease_id = uuid.uuid4().hex
        key = f"{request_id}@{lease_id[:12]}"
        self.preparing[request_id] = False
        reserve = asyncio.ensure_future(self.engine.run(
            lambda e: e.prepare_receive(key, prompt_token_ids, params, end)))
        try:
            reservation = await asyncio.shield(reserve)
        except asyncio.CancelledError:
            # The caller never saw the lease, so nobody can write into it: free at once.
            reserve.add_done_callback(lambda f: f.cancelled() or f.exception() or
                                      asyncio.ensure_future(self._free(key)))
            raise
        finally:
            aborted = self.preparing.pop(request_id)
        if aborted:
            await self._free(key)
            raise RequestAborted(f"request {request_id!r} was aborted while reserving")
        lease = self.leases.grant(
            request_id, lease_ms / 1000, lease_id=lease_id, engine_key=key,
            prompt_len=len(prompt_token_ids),
            prefix_matched_length=reservation.prefix_matched_length,
            kv_window_end=reservation.kv_window_end)
        self.requests_total += 1
        self.prefix_hit_tokens_total += reservation.prefix_matched_length
        return Prepared(lease, encode_append_metadata(reservation.slots))

    def _prepare_local(self, request_id, prompt_token_ids, params, kv_window_end, lease_ms):
        if kv_window_end != 0:
            raise ValueError(f"local_prefill needs kv_window_end 0, got {kv_window_end}")
        if not prompt_token_ids:
            raise ValueError("prompt is empty")
        lease_id = uuid.uuid4().hex
        lease = self.leases.grant(
            request_id, lease_ms / 1000, lease_id=lease_id,
            engine_key=f"{request_id}@{lease_id[:12]}", prompt_len=len(prompt_token_ids),
            prefix_matched_length=0, kv_window_end=0, local_prompt=list(prompt_token_ids),
            local_params=params)
        self.requests_total += 1
        return Prepared(lease, encode_append_metadata([]))

    async def start_generation(self, request_id: str, lease_id: str, kv_window_begin: int,
                               expect_kv: bool, timeout_s: float | None = None) -> AsyncIterator:
        """Engine RequestOutput deltas. Raises LeaseError, ValueError, KVNotArrived,
        KVNotWritten or RequestAborted."""
        lease = self.leases.peek(request_id, lease_id)
        if kv_window_begin != lease.kv_window_end:
            raise ValueError(f"kv_window_begin {kv_window_begin} must equal the reserved "
                             f"kv_window_end {lease.kv_window_end}")
        self.leases.take(request_id, lease_id)
        started = self.generating[request_id] = Started(lease, waiting_for_kv=expect_kv)
        streaming = False
        try:
            if expect_kv:
                await self._wait_for_kv(started, timeout_s)
            if started.aborted:
                raise RequestAborted(f"request {request_id!r} was aborted")
            streaming = True
            # From here the engine's stream owns the request: it aborts it if we stop early.
            if lease.local_prompt is not None:
                stream = self.engine.generate(lease.engine_key, lease.local_prompt,
                                              lease.local_params)
            else:
                stream = self.engine.start_generation(lease.engine_key)
            async for out in stream:
                yield out
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
            self.generating.pop(request_id, None)

    async def _wait_for_kv(self, started: Started, timeout_s: float | None) -> None:
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
        elif got not in (SETTLED, b"abort"):
            raise KVNotWritten(f"the prefill node did not write the KV of request "
                               f"{lease.request_id!r}")

    async def abort(self, request_id: str, settled: bool = False) -> bool:
        """Free everything of `request_id`. `settled`: no RemoteSend can still write it."""
        if request_id in self.preparing:
            self.preparing[request_id] = True
            return True
        lease = self.leases.drop(request_id)
        if lease is not None:
            if settled:
                await self._free(lease.engine_key)
            else:
                self.quarantine.hold(lease)
            return True
        started = self.generating.get(request_id)
        if started is not None:
            started.aborted = True
            if started.waiting_for_kv:
                started.settled = settled
                self.inbox.interrupt(tags(started.lease), SETTLED if settled else b"abort")
            else:
                await self._free(started.lease.engine_key)
            return True
        return settled and self.quarantine.settle(request_id)

    async def _on_expire(self, lease: Lease) -> None:
        log.warning("lease of request %s expired; quarantining its reservation", lease.request_id)
        self.quarantine.hold(lease)

    async def _free(self, engine_key: str) -> None:
        await self.engine.abort(engine_key)

    def busy(self) -> bool:
        return bool(self.leases or self.preparing or self.generating)

    def stats(self) -> dict:
        return {"num_parked": len(self.leases), "num_running": len(self.generating),
                "requests_total": self.requests_total,
                "prefix_hit_tokens_total": self.prefix_hit_tokens_total,
                "leases_expired_total": self.leases.expired_total,
                "num_quarantined": len(self.quarantine),
                "late_writes_total": self.quarantine.late_writes_total}

    def close(self) -> None:
        self.inbox.close()
