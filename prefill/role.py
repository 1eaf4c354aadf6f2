"""The prefill role: compute a prompt's KV and push the window [begin, end) to a decode node.

Preconditions checked before any work: 0 <= begin < end < len(prompt), and the append
metadata names exactly end - begin slots inside the decode node's pool. The engine never
samples here (prefill_only); the request's pages stay pinned until the write has
completed or failed, then are released (full pages stay in the prefix cache). The
notification is posted by the agent only after every write completed.

No stale writes: a write starts only if the request was not aborted, the decode node's
lease (`lease_expires_unix_s`, on D's clock) has not ended and the RemoteSend's deadline
(its gRPC deadline, capped by `transfer_timeout_s`) has not passed, and it is bounded by
the earlier of the two. D keeps a freed reservation's pages until the lease's end plus a
grace period (decode/quarantine.py), so a late write can only land in pages nobody uses. A RemoteSend that ends before its write began tells the decode
node so (`no_write_tag`), which lets it reuse the reservation's pages at once. A write
that began is always awaited to its end, even when the call is cancelled: the source
pages are never released while NIXL still reads them.

Test-only delays (hidden flags `--debug-delay-prefill-ms` and `--debug-delay-kv-write-ms`,
for RemoteSends whose request id starts with `--debug-delay-prefix`) make the phases
"prefill in progress" and "transfer in flight" long enough for fault tests to hit. The
write delay comes after the deadline check, so it models a write that lands late.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from engine import SamplingParams
from kvtransfer.metadata import decode_append_metadata, validate_append_metadata
from kvtransfer.plan import plan_transfer
from kvtransfer.window import resolve_kv_window
from pdserve.errors import NodeDraining, NodeOverloaded, RequestAborted
from prefill.config import PrefillConfig
from proto.tags import no_write_tag, notification_tag

log = logging.getLogger("pdserve.prefill")


class DeadlinePassed(Exception):
    """The RemoteSend's deadline passed before its write could start."""


class LeaseEnded(Exception):
    """The decode node's reservation lease ended: writing now could hit reused pages."""


@dataclass
class SendResult:
    num_tokens_sent: int
    num_bytes: int
    num_descriptors: int
    prefill_cached_tokens: int
    prefill_s: float
    transfer_s: float


@dataclass
class Sending:
    """A RemoteSend in progress: abort stops it unless its write already began."""

    aborted: bool = False
    writing: bool = False


class PrefillRole:
    def __init__(self, engine, agent, layout, config: PrefillConfig) -> None:
        self.engine = engine  # AsyncEngine
        self.agent = agent    # TransferAgent
        self.layout = layout  # this node's KVLayout
        self.config = config
        self.in_flight: dict[str, Sending] = {}
        self.draining = False
        self._writers = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kv-write")
        self.remote_sends_total = 0
        self.last_kv_window_begin = 0
        self.kv_bytes_sent_total = 0

    async def remote_send(self, request_id: str, prompt_token_ids: list[int], begin: int,
                          end: int, kv_append_metadata: list[int], lease_id: str,
                          peer, lease_expires_unix_s: float,
                          timeout_s: float | None = None) -> SendResult:
        deadline = time.monotonic() + min(self.config.transfer_timeout_s,
                                          timeout_s if timeout_s is not None else float("inf"))
        self._check_lease(request_id, lease_expires_unix_s)
        begin, end = resolve_kv_window(begin, end, len(prompt_token_ids))
        validate_append_metadata(kv_append_metadata, end - begin, peer.layout.num_slots)
        dst_slots = decode_append_metadata(kv_append_metadata)
        if request_id in self.in_flight:
            raise ValueError(f"duplicate request_id {request_id!r}")
        if self.draining:
            raise NodeDraining("prefill node is draining: no new RemoteSend")
        if len(self.in_flight) >= self.config.max_in_flight:
            raise NodeOverloaded(f"prefill node is at its limit of {self.config.max_in_flight} "
                                 "RemoteSends")
        sending = self.in_flight[request_id] = Sending()
        try:
            t0 = time.perf_counter()
            last = await self._prefill(request_id, prompt_token_ids[:end], sending)
            t1 = time.perf_counter()
            try:
                src_slots = await self.engine.run(lambda e: e.slots_of(request_id))
            except ValueError:  # an Abort freed it between prefill and here
                raise RequestAborted(f"RemoteSend of {request_id!r} aborted") from None
            plan = plan_transfer(self.layout, src_slots[begin:end], peer.layout, dst_slots)
            if sending.aborted:
                raise RequestAborted(f"RemoteSend of {request_id!r} aborted before writing")
            self._check_lease(request_id, lease_expires_unix_s)
            remaining = min(deadline - time.monotonic(), lease_expires_unix_s - time.time())
            if remaining <= 0:
                raise DeadlinePassed(f"RemoteSend of {request_id!r} reached its deadline "
                                     "before writing")
            sending.writing = True
            await self._write(peer.agent_name, plan, notification_tag(request_id, lease_id),
                              remaining, self._debug_delay_s(request_id, "kv_write"))
            t2 = time.perf_counter()
        finally:
            del self.in_flight[request_id]
            await asyncio.shield(self.engine.run(lambda e: e.release(request_id)))
            if not sending.writing:
                self._tell_no_write(peer.agent_name, no_write_tag(request_id, lease_id))
        self.remote_sends_total += 1
        self.last_kv_window_begin = begin
        self.kv_bytes_sent_total += plan.total_bytes
        return SendResult(end - begin, plan.total_bytes, plan.num_descriptors,
                          last.num_cached_tokens, t1 - t0, t2 - t1)

    @staticmethod
    def _check_lease(request_id: str, lease_expires_unix_s: float) -> None:
        late_s = time.time() - lease_expires_unix_s
        if late_s >= 0:
            raise LeaseEnded(f"the decode node's lease of request {request_id!r} ended "
                             f"{late_s * 1000:.0f} ms ago; nothing was written")

    async def _prefill(self, request_id: str, prompt: list[int], sending: Sending):
        await asyncio.sleep(self._debug_delay_s(request_id, "prefill"))
        if sending.aborted:
            raise RequestAborted(f"RemoteSend of {request_id!r} aborted before prefill")
        last = None
        params = SamplingParams(max_tokens=1, temperature=0.0)
        async for out in self.engine.generate(request_id, prompt, params, prefill_only=True):
            last = out
        if last is None or last.finish_reason != "prefilled":
            if sending.aborted:
                raise RequestAborted(f"RemoteSend of {request_id!r} aborted during prefill")
            raise RuntimeError(f"prefill of {request_id!r} ended with "
                               f"{getattr(last, 'finish_reason', None)!r}")
        return last

    async def _write(self, agent_name: str, plan, tag: bytes, timeout_s: float,
                     delay_s: float = 0.0) -> None:
        """The NIXL write, awaited to its end even if this call is cancelled."""
        def write_kv():
            time.sleep(delay_s)  # test-only: a write that is slow to land
            self.agent.write(agent_name, plan, tag, timeout_s)

        write = asyncio.get_running_loop().run_in_executor(self._writers, write_kv)
        try:
            await asyncio.shield(write)
        except asyncio.CancelledError:
            try:
                await write
            except Exception:
                pass
            raise

    def _tell_no_write(self, agent_name: str, tag: bytes) -> None:
        def send():
            try:
                self.agent.send_notification(agent_name, tag)
            except Exception as err:  # the decode node falls back on its quarantine timeout
                log.warning("no-write notice to %s failed: %s", agent_name, err)
        self._writers.submit(send)

    def _debug_delay_s(self, request_id: str, phase: str) -> float:
        delay_ms = getattr(self.config, f"debug_delay_{phase}_ms")
        if delay_ms and request_id.startswith(self.config.debug_delay_prefix):
            return delay_ms / 1000
        return 0.0

    async def abort(self, request_id: str, settled: bool = False) -> bool:
        sending = self.in_flight.get(request_id)
        if sending is None:
            return False
        sending.aborted = True
        if not sending.writing:
            await self.engine.abort(request_id)
        return True

    def busy(self) -> bool:
        return bool(self.in_flight)

    def stats(self) -> dict:
        return {"num_running": len(self.in_flight), "remote_sends_total": self.remote_sends_total,
                "last_kv_window_begin": self.last_kv_window_begin,
                "kv_bytes_sent_total": self.kv_bytes_sent_total}

    def close(self) -> None:
        self._writers.shutdown(wait=False, cancel_futures=True)
