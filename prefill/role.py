"""The prefill role: compute a prompt's KV and push the window [begin, end) to a decode node.

Two request kinds, one per method:
- `remote_send(RemoteSend)`: the decode node D has reserved; the request carries the whole
  window (begin, D's slots as append metadata, lease, D's identity).
- `remote_send_overlapped(OverlappedSend)`: the router sends it before D has reserved, so
  only `end` is known; the prefill of prompt[:end] starts at once and the rest of the window
  arrives by `deliver_window` while it runs. A window that does not arrive before the
  deadline, or an abort while waiting, ends the request without writing anything; a window that comes after its send ended is
never written, and its decode node is told so at once.

Preconditions of every write: 0 <= begin < end < len(prompt), and the append metadata names
exactly end - begin slots inside D's pool. The engine never samples here (prefill_only);
the request's pages stay pinned until the write completed or failed, then are released
(full pages stay in the prefix cache). The notification is posted by the agent only after
every write completed.

No stale writes: a write starts only if the request was not aborted or fenced, D's lease
has not ended and the deadline (the call's, capped by `transfer_timeout_s`) has not
passed, and it is bounded by the earlier of the two. The lease end is a duration counted
on this node's monotonic clock from the window's receipt: no other node's clock is read.
D keeps a freed reservation's pages until it has proof that no write can land
(decode/quarantine.py): our notification or no-write notice, our death, or our answer to
`fence` (FenceWrites), which returns only once no write of that lease is in flight here
and refuses any later window for it. A request that ends before its write began tells D
so (`no_write_tag`). A write that began is always awaited to its end, even when the call is
cancelled: the source pages are never released while NIXL still reads them.

Layer-wise sends (`--kv-send`, prefill/layerwise.py) write each layer once computed and the
window checked (`_send_layers_to_window`); every rule above holds per write, and an abort
or fence waits until no write of the stream is in flight before the engine frees the pages.

Capabilities: a window is written only if D's signature over it checks with the cluster
key, it is not older than `max_window_age_s` (D's clock against ours: a coarse bound on a
replay, far wider than any skew), and its lease was neither used before nor fenced here
(prefill/capability.py); otherwise PERMISSION_DENIED and nothing runs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict

from pdserve.engine import SamplingParams
from pdserve.kvtransfer.metadata import decode_append_metadata, validate_append_metadata
from pdserve.kvtransfer.plan import plan_transfer
from pdserve.kvtransfer.window import resolve_kv_window
from pdserve.prefill.capability import SpentLeases, check_capability
from pdserve.prefill.config import PrefillConfig
from pdserve.prefill.layerwise import LayerSends, StreamFailed, on_loop
from pdserve.prefill.peers import DecodePeer, DecodePeers
from pdserve.prefill.requests import OverlappedSend, PrefillLoad, RemoteSend, SendResult, Window
from pdserve.prefill.sending import (Sending, delivered_of, landed, resolve, tell_no_write, write_window,
                             writer_threads)
from pdserve.proto.tags import no_write_tag, notification_tag
from pdserve.runtime.errors import (NodeDraining, NodeOverloaded, PeerUnavailable, Refused,
                            RequestAborted, TimedOut)
from pdserve.runtime.identity import host_id

log = logging.getLogger("pdserve.prefill")
_MAX_ENDED = 4096  # sends remembered after their end (a window may still come for them)
_MAX_EARLY = 1024  # windows held for sends not begun yet (each for at most 30 s)


class LeaseEnded(Refused):
    """The decode node's reservation lease ended: D no longer waits for this write."""


class PrefillRole:
    def __init__(self, engine, agent, layout, config: PrefillConfig, gates=None) -> None:
        self.engine = engine  # AsyncEngine
        self.agent = agent    # TransferAgent
        self.layout = layout  # this node's KVLayout
        self.config = config
        self.peers = DecodePeers(agent, layout)
        self.gates = gates    # runtime.gates.Gates in fault tests, else None
        self.in_flight: dict[str, Sending] = {}
        self.draining = False
        self._writers = writer_threads(layout.device)
        self._early_windows: dict[str, tuple[float, object]] = {}
        # Sends that ended, most recent last: a window that comes for one of them is never
        # written, and its decode node hears so at once instead of after lease + grace.
        self._ended: OrderedDict[str, str | None] = OrderedDict()  # -> lease its write landed in
        self.spent = SpentLeases()
        self.layers = None if config.kv_send == "whole" else LayerSends(  # prefill/layerwise.py
            agent, layout, engine, gates, min_write_bytes=int(config.layer_write_mb * 2**20))
        self.host_id = host_id()
        self.remote_sends_total = 0
        self.last_kv_window_begin = 0
        self.kv_bytes_sent_total = 0

    # ---- the two request kinds -------------------------------------------------------
    async def remote_send(self, req: RemoteSend) -> SendResult:
        n = len(req.prompt_token_ids)
        _, end = resolve_kv_window(req.window.begin, req.kv_window_end, n)
        peer = await self.peers.get(req.window.decode)
        dst_slots = self._check_window(req.request_id, n, end, req.window, peer)
        sending = self._admit(req)
        sending.delivered = (req.window, peer)
        return await self._send(req.request_id, req.prompt_token_ids, end, sending,
                                self._deadline(req.timeout_s), dst_slots)

    async def remote_send_overlapped(self, req: OverlappedSend) -> SendResult:
        _, end = resolve_kv_window(0, req.kv_window_end, len(req.prompt_token_ids))
        sending = self._admit(req)
        sending.window = asyncio.get_running_loop().create_future()
        early = self._early_windows.pop(req.request_id, None)
        if early is not None:
            resolve(sending.window, early[1])
        return await self._send(req.request_id, req.prompt_token_ids, end, sending,
                                self._deadline(req.timeout_s), None)

    async def deliver_window(self, request_id: str, window: Window | ValueError) -> bool:
        """The rest of an overlapped send, or why it is malformed. A window that is bad or
        whose decode node cannot be used fails the waiting send with the same reason (and
        raises it); one that arrives before its send is kept briefly for it. Whether a send
        was waiting for it."""
        delivery: object = window
        if not isinstance(window, ValueError):
            try:
                delivery = (window, await self.peers.get(window.decode))
            except PeerUnavailable as err:  # D unreachable: the send cannot go there
                delivery = Refused(str(err))
            except Refused as err:
                delivery = err
        found = self._deliver(request_id, delivery)
        if isinstance(delivery, Exception):
            raise delivery
        return found

    async def abort(self, request_id: str, settled: bool = False, lease_id: str = "") -> bool:
        """Stop the send of `request_id` (with `lease_id`: unless it has another lease's
        window)."""
        sending = self.in_flight.get(request_id)
        window = sending and (sending.delivered or delivered_of(sending.window))
        if sending is None or lease_id and window and window[0].lease_id != lease_id:
            return False
        sending.aborted = True
        if sending.window is not None and not sending.window.done():
            resolve(sending.window, RequestAborted(
                f"RemoteSend of {request_id!r} aborted while waiting for its KV window"))
        if sending.stream is not None:  # its source pages go only once no WRITE reads them
            await self.layers.stopped(sending.stream, "aborted")
        if not sending.writing or sending.stream is not None:
            await self.engine.abort(request_id)
        return True

    # ---- one send ----------------------------------------------------------------------
    def _admit(self, req: RemoteSend | OverlappedSend) -> Sending:
        if (request_id := req.request_id) in self.in_flight:
            raise ValueError(f"duplicate request_id {request_id!r}")
        if self.draining:
            raise NodeDraining("prefill node is draining: no new RemoteSend")
        if len(self.in_flight) >= self.config.max_in_flight:
            raise NodeOverloaded(f"prefill node is at its limit of {self.config.max_in_flight} "
                                 "RemoteSends")
        sending = self.in_flight[request_id] = Sending(cache_salt=req.cache_salt, priority=req.priority, lora=req.lora)
        self._ended.pop(request_id, None)
        return sending

    def _deadline(self, timeout_s: float | None) -> float:
        bound = self.config.transfer_timeout_s
        return time.monotonic() + (bound if timeout_s is None else min(bound, timeout_s))

    async def _send(self, request_id: str, prompt: list[int], end: int, sending: Sending,
                    deadline: float, dst_slots: list[int] | None) -> SendResult:
        stream = self.layers.open(request_id) if self.layers is not None else None
        destination = None  # the layer stream's: D's slots once the window is known
        try:
            t0 = time.perf_counter()
            if stream is not None:  # layers flow to the window from the moment it is known
                destination = asyncio.ensure_future(self._send_layers_to_window(
                    request_id, len(prompt), end, sending, stream, deadline, dst_slots))
            last = await self._prefill(request_id, prompt[:end], sending, len(prompt))
            if destination is not None:
                dst_slots = await destination
            elif sending.delivered is None:
                sending.delivered = await self._wait_window(request_id, sending, deadline)
                dst_slots = self._check_window(request_id, len(prompt), end, *sending.delivered)
            window, peer = sending.delivered
            t1 = time.perf_counter()
            src_slots = last.slots  # pinned until _end_send releases them (an Abort: below)
            plan = None if sending.stream else \
                plan_transfer(self.layout, src_slots[window.begin:end], peer.layout, dst_slots)
            if sending.aborted:
                raise RequestAborted(f"RemoteSend of {request_id!r} aborted before writing")
            _check_lease(request_id, window.lease_deadline)
            remaining = min(deadline, window.lease_deadline) - time.monotonic()
            if remaining <= 0:
                raise TimedOut(f"RemoteSend of {request_id!r} reached its deadline before "
                               "writing")
            sending.writing = True
            tag = notification_tag(request_id, window.lease_id)
            if sending.stream is not None:
                plan = await self._finish_stream(sending, tag, src_slots, last.kv_ready)
            else:
                await write_window(self, sending, request_id, peer.agent_name, plan, tag, remaining,
                                   last.kv_ready)
            t2 = time.perf_counter()
        finally:
            if destination is not None:
                destination.cancel()
                destination.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved
            # Shielded: a second cancellation must not cut the clean-up short.
            await asyncio.shield(self._end_send(request_id, sending, stream))
        self.remote_sends_total += 1
        self.last_kv_window_begin = window.begin
        self.kv_bytes_sent_total += plan.total_bytes
        return SendResult(window.begin, end, plan.total_bytes, plan.num_descriptors,
                          last.num_cached_tokens, t1 - t0, t2 - t1, getattr(plan, "writes", 1))

    async def _end_send(self, request_id: str, sending: Sending, stream) -> None:
        """After a send, however it ended: no WRITE of it in flight past the first step, then
        its pages' release queued, and its decode node told if nothing was written."""
        if stream is not None:
            self.layers.drop(stream)
            await self.layers.stopped(stream, "the send ended")
        del self.in_flight[request_id]
        self._ended[request_id] = landed(sending)
        while len(self._ended) > _MAX_ENDED:
            self._ended.popitem(last=False)
        delivered = sending.delivered or delivered_of(sending.window)
        if not sending.writing and delivered is not None:
            window, peer = delivered
            tell_no_write(self, peer.agent_name, no_write_tag(request_id, window.lease_id))
        # Queued, not awaited: the reply (and StartGeneration after it) would wait for the step
        # in progress, another request's prefill chunk. A later command sees the pages free.
        self.engine.post(lambda e, rid: e.release(rid), request_id)

    async def _send_layers_to_window(self, request_id: str, prompt_len: int, end: int, sending: Sending,
                                     stream, deadline: float, dst_slots: list[int] | None) -> list[int]:
        """Once the window is known (checked here, once): point the layer stream's writes
        at it, or drop the stream when this window goes whole (`--kv-send`); D's slots."""
        if dst_slots is None:
            sending.delivered = await self._wait_window(request_id, sending, deadline)
            dst_slots = self._check_window(request_id, prompt_len, end, *sending.delivered)
        window, peer = sending.delivered
        if sending.aborted or self.config.kv_send == "auto" and peer.host_id == self.host_id != "":
            self.layers.drop(stream)
            return dst_slots
        sending.stream, sending.writing = stream, True  # from here the stream owns the notices
        sending.write = on_loop(stream.future)
        self.layers.aim(stream, peer.agent_name, peer.layout, window.begin, end, dst_slots,
                        min(deadline, window.lease_deadline), no_write_tag(request_id, window.lease_id))
        return dst_slots

    async def _finish_stream(self, sending: Sending, tag: bytes, src_slots: list[int], kv_ready):
        """The rest of a layer-wise window and its notification, awaited to the end."""
        try:
            await asyncio.shield(on_loop(self.layers.finish(sending.stream, tag, src_slots, kv_ready)))
        except StreamFailed as err:
            if sending.aborted:
                raise RequestAborted(f"RemoteSend aborted during its layer-wise write: {err}") from None
            raise PeerUnavailable(f"KV write failed: {err}") from None
        return sending.stream

    def _check_window(self, request_id: str, prompt_len: int, end: int, window: Window,
                      peer: DecodePeer) -> list[int]:
        """Every precondition of a write that depends on the window; D's slots. The window's
        lease is spent from here on: it is never written twice."""
        begin, end = resolve_kv_window(window.begin, end, prompt_len)
        self.spent.check(request_id, window.lease_id)
        check_capability(request_id, end, window, self.config.max_window_age_s)
        _check_lease(request_id, window.lease_deadline)
        validate_append_metadata(window.kv_append_metadata, end - begin, peer.layout.num_slots)
        self.spent.add(request_id, window.lease_id, "used")
        return decode_append_metadata(window.kv_append_metadata)

    async def fence(self, request_id: str, lease_id: str) -> tuple[bool, bool]:
        """Return once no write of (`request_id`, `lease_id`) is in flight here and none
        can begin: whether a send of it was in progress, and whether its write landed. D
        reuses the pages on this answer."""
        self.spent.add(request_id, lease_id, "fenced")  # a window that comes later is refused
        sending = self.in_flight.get(request_id)
        delivered = sending and (sending.delivered or delivered_of(sending.window))
        if sending is None:  # ended: its write landed, or never will
            return False, self._ended.get(request_id) == lease_id
        if not delivered or delivered[0].lease_id != lease_id:
            return False, False
        if sending.write is None or sending.stream is not None:
            await self.abort(request_id)  # no write begins after this (`_send` checks it)
        if sending.write is None:
            return True, False
        await asyncio.wait([sending.write])  # ends by the write's own deadline
        return True, sending.write.exception() is None

    async def _prefill(self, request_id: str, prompt: list[int], sending: Sending, full_prompt_len: int):
        if self.gates is not None:
            await self.gates.passage("prefill", request_id)
        if sending.aborted:
            raise RequestAborted(f"RemoteSend of {request_id!r} aborted before prefill")
        last, params = None, SamplingParams(max_tokens=1, temperature=0.0)
        async for out in self.engine.generate(request_id, prompt, params, prefill_only=True, cache_salt=sending.cache_salt,
                                              priority=sending.priority, lora=sending.lora, full_prompt_len=full_prompt_len):
            last = out
        if last is None or last.finish_reason != "prefilled":
            if sending.aborted:
                raise RequestAborted(f"RemoteSend of {request_id!r} aborted during prefill")
            raise RuntimeError(f"prefill of {request_id!r} ended with "
                               f"{getattr(last, 'finish_reason', None)!r}")
        return last

    async def _wait_window(self, request_id: str, sending: Sending, deadline: float):
        try:
            return await asyncio.wait_for(asyncio.shield(sending.window),
                                          max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise TimedOut(f"the KV window of RemoteSend {request_id!r} did not arrive before "
                           "its deadline; nothing was written") from None

    def _deliver(self, request_id: str, delivery: object) -> bool:
        sending = self.in_flight.get(request_id)
        if sending is None and request_id in self._ended:
            if isinstance(delivery, tuple):  # its send is over: this window is never written
                window, peer = delivery
                tell_no_write(self, peer.agent_name, no_write_tag(request_id, window.lease_id))
            return False
        if sending is None:
            now = time.monotonic()
            self._early_windows = {k: v for k, v in self._early_windows.items() if now - v[0] < 30}
            self._early_windows[request_id] = (now, delivery)
            while len(self._early_windows) > _MAX_EARLY:  # the oldest goes: its send then
                del self._early_windows[next(iter(self._early_windows))]  # waits, not writes
            return False
        if sending.window is None or sending.window.done():
            return False
        resolve(sending.window, delivery)
        return True

    # ---- node ----------------------------------------------------------------------------
    def busy(self) -> bool:
        return bool(self.in_flight)

    def load(self) -> PrefillLoad:
        return PrefillLoad(len(self.in_flight), self.remote_sends_total,
                           self.last_kv_window_begin, self.kv_bytes_sent_total)

    def close(self) -> None:
        self._writers.shutdown(wait=False, cancel_futures=True)
        if self.layers is not None:
            self.layers.close()


def _check_lease(request_id: str, lease_deadline: float) -> None:
    late_s = time.monotonic() - lease_deadline
    if late_s >= 0:
        raise LeaseEnded(f"the decode node's lease of request {request_id!r} ended "
                         f"{late_s * 1000:.0f} ms ago; nothing was written")
