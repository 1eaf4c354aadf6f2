"""The decode role: reserve KV slots for a prompt, wait for them to be filled, generate.

- `prepare_receive` resolves the window end, reserves slots for [matched, end) in the
  engine (which parks the request) and grants a lease; the append metadata it returns
  names exactly those slots.
- `start_generation` takes the lease (so expiry can no longer free it), waits at most
  `notification_timeout_s` for the prefill node's notification when KV was sent (pages are
  never read before their writes completed), then un-parks and streams engine outputs.
- `abort` and lease expiry free the request in the engine; both are idempotent.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from decode.config import DecodeConfig
from decode.leases import Lease, LeaseTable
from engine import SamplingParams
from kvtransfer.metadata import encode_append_metadata
from kvtransfer.window import resolve_kv_window_end
from proto.tags import notification_tag

log = logging.getLogger("pdserve.decode")


class KVNotArrived(Exception):
    """The prefill node's notification did not come within the bound."""


@dataclass
class Prepared:
    lease: Lease
    kv_append_metadata: list[int]


class DecodeRole:
    def __init__(self, engine, agent, config: DecodeConfig) -> None:
        self.engine = engine  # AsyncEngine
        self.agent = agent    # TransferAgent
        self.config = config
        self.leases = LeaseTable(self._on_expire)
        self.generating: set[str] = set()
        # Notification waits block in NIXL; they get their own threads, never the loop's.
        self._waiters = ThreadPoolExecutor(max_workers=16, thread_name_prefix="kv-notify")
        self.requests_total = 0
        self.prefix_hit_tokens_total = 0

    async def prepare_receive(self, request_id: str, prompt_token_ids: list[int],
                              params: SamplingParams, kv_window_end: int,
                              lease_ms: int) -> Prepared:
        if request_id in self.leases or request_id in self.generating:
            raise ValueError(f"duplicate request_id {request_id!r}")
        end = resolve_kv_window_end(kv_window_end, len(prompt_token_ids))
        reservation = await self.engine.run(
            lambda e: e.prepare_receive(request_id, prompt_token_ids, params, end))
        lease = self.leases.grant(
            request_id, (lease_ms or self.config.lease_ms) / 1000,
            prompt_len=len(prompt_token_ids),
            prefix_matched_length=reservation.prefix_matched_length,
            kv_window_end=reservation.kv_window_end)
        self.requests_total += 1
        self.prefix_hit_tokens_total += reservation.prefix_matched_length
        return Prepared(lease, encode_append_metadata(reservation.slots))

    async def start_generation(self, request_id: str, lease_id: str, kv_window_begin: int,
                               expect_kv: bool) -> AsyncIterator:
        """Engine RequestOutput deltas. Raises LeaseError, ValueError or KVNotArrived."""
        lease = self.leases.take(request_id, lease_id)
        self.generating.add(request_id)
        started = False
        try:
            if kv_window_begin != lease.kv_window_end:
                raise ValueError(f"kv_window_begin {kv_window_begin} must equal the reserved "
                                 f"kv_window_end {lease.kv_window_end}")
            if expect_kv:
                await self._wait_for_kv(lease)
            started = True
            # From here the engine's stream owns the request: it aborts it if we stop early.
            async for out in self.engine.start_generation(request_id):
                yield out
        except BaseException:
            if not started:  # still parked in the engine, with the lease already taken
                await asyncio.shield(self.engine.abort(request_id))
            raise
        finally:
            self.generating.discard(request_id)

    async def _wait_for_kv(self, lease: Lease) -> None:
        tag = notification_tag(lease.request_id, lease.lease_id)
        timeout = self.config.notification_timeout_s
        loop = asyncio.get_running_loop()
        arrived = await loop.run_in_executor(self._waiters, self.agent.wait_notification, tag, timeout)
        if not arrived:
            raise KVNotArrived(f"KV of request {lease.request_id!r} did not arrive within {timeout}s")

    async def abort(self, request_id: str) -> bool:
        held = self.leases.drop(request_id) is not None or request_id in self.generating
        if held:
            await self.engine.abort(request_id)
        return held

    async def _on_expire(self, lease: Lease) -> None:
        log.warning("lease of request %s expired; freeing its reservation", lease.request_id)
        await self.engine.abort(lease.request_id)

    def stats(self) -> dict:
        return {"num_parked": len(self.leases), "num_running": len(self.generating),
                "requests_total": self.requests_total,
                "prefix_hit_tokens_total": self.prefix_hit_tokens_total,
                "leases_expired_total": self.leases.expired_total}

    def close(self) -> None:
        self._waiters.shutdown(wait=False, cancel_futures=True)
