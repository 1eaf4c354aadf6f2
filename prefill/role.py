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

Overlap (`window_follows`): the router may send RemoteSend before the decode node has
reserved. Then only `end` is known up front; the prefill of prompt[:end] starts at once, and
the rest of the window (begin, append metadata, lease, peer) arrives by `deliver_window`
while it runs. Every check above then runs when the window arrives, before any write; a
window that does not arrive before the deadline, or an abort while waiting, ends the
RemoteSend without writing anything.

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
class Window:
    """What a RemoteSend needs from the decode node's PrepareReceive."""

    begin: int
    kv_append_metadata: list[int]
    lease_id: str
    peer: object  # prefill.peers.DecodePeer
    lease_expires_unix_s: float


@dataclass
class Sending:
    """A RemoteSend in progress: abort stops it unless its write already began."""

    aborted: bool = False
    writing: bool = False
    window: asyncio.Future | None = None  # set while waiting for `deliver_window`


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
        self._early_windows: dict[str, tuple[float, Window | BaseException]] = {}

    def _check_window(self, request_id: str, prompt_len: int, end: int, w: Window) -> list[int]:
        """Every precondition of a write that depends on the window; D's slots."""
        self._check_lease(request_id, w.lease_expires_unix_s)
        begin, end = resolve_kv_window(w.begin, end, prompt_len)
        validate_append_metadata(w.kv_append_metadata, end - begin, w.peer.layout.num_slots)
        return decode_append_metadata(w.kv_append_metadata)

    async def remote_send(self, request_id: str, prompt_token_ids: list[int], begin: int,
                          end: int, kv_append_metadata: list[int], lease_id: str,
                          peer, lease_expires_unix_s: float,
                          timeout_s: float | None = None,
                          window_follows: bool = False) -> SendResult:
        deadline = time.monotonic() + min(self.config.transfer_timeout_s,
                                          timeout_s if timeout_s is not None else float("inf"))
        window = None
        if window_follows:
            _, end = resolve_kv_window(0, end, len(prompt_token_ids))
        else:
            window = Window(begin, kv_append_metadata, lease_id, peer, lease_expires_unix_s)
            dst_slots = self._check_window(request_id, len(prompt_token_ids), end, window)
        if request_id in self.in_flight:
            raise ValueError(f"duplicate request_id {request_id!r}")
        if self.draining:
            raise NodeDraining("prefill node is draining: no new RemoteSend")
        if len(self.in_flight) >= self.config.max_in_flight:
            raise NodeOverloaded(f"prefill node is at its limit of {self.config.max_in_flight} "
                                 "RemoteSends")
        sending = self.in_flight[request_id] = Sending()
        if window_follows:
            sending.window = asyncio.get_running_loop().create_future()
            early = self._early_windows.pop(request_id, None)
            if early is not None:
                self._resolve(sending.window, early[1])
        try:
            t0 = time.perf_counter()
            last = await self._prefill(request_id, prompt_token_ids[:end], sending)
            if window is None:
                window = await self._wait_window(request_id, sending, deadline)
                dst_slots = self._check_window(request_id, len(prompt_token_ids), end, window)
            begin, peer, lease_id = window.begin, window.peer, window.lease_id
            lease_expires_unix_s = window.lease_expires_unix_s
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
            if window is None and sending.window is not None and sending.window.done() \
                    and sending.window.exception() is None:
                window = sending.window.result()  # came, but the prefill ended first
            if not sending.writing and window is not None:
                self._tell_no_write(window.peer.agent_name, no_write_tag(request_id, window.lease_id))
        self.remote_sends_total += 1
        self.last_kv_window_begin = begin
        self.kv_bytes_sent_total += plan.total_bytes
        return SendResult(end - begin, plan.total_bytes, plan.num_descriptors,
                          last.num_cached_tokens, t1 - t0, t2 - t1)

    async def _wait_window(self, request_id: str, sending: Sending, deadline: float) -> Window:
        try:
            return await asyncio.wait_for(asyncio.shield(sending.window),
                                          max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise DeadlinePassed(f"the KV window of RemoteSend {request_id!r} did not arrive "
                                 "before its deadline; nothing was written") from None

    def deliver_window(self, request_id: str, window: Window | BaseException) -> bool:
        """The rest of a `window_follows` RemoteSend (or why it cannot come). One that
        arrives before its RemoteSend is kept briefly for it."""
        sending = self.in_flight.get(request_id)
        if sending is None:
            now = time.monotonic()
            self._early_windows = {k: v for k, v in self._early_windows.items() if now - v[0] < 30}
            self._early_windows[request_id] = (now, window)
            return False
        if sending.window is None or sending.window.done():
            return False
        self._resolve(sending.window, window)
        return True

    @staticmethod
    def _resolve(future: asyncio.Future, window: Window | BaseException) -> None:
        if isinstance(window, BaseException):
            future.set_exception(window)
            future.exception()  # retrieved: the RemoteSend may have ended before waiting
        else:
            future.set_result(window)

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
        if sending.window is not None and not sending.window.done():
            self._resolve(sending.window, RequestAborted(
                f"RemoteSend of {request_id!r} aborted while waiting for its KV window"))
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
