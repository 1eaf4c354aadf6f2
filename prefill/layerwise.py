"""Layer-by-layer KV sends: each layer's K/V goes to the decode node as soon as the engine
has written it, so the transfer of layer L overlaps the compute of layers L+1...

Why: across hosts the link decides. At 1 Gbit/s a 4096-token window of SmolLM2 in
bfloat16 (94 MB) takes ~0.75 s, all of it added to the time to first token when the
write starts after the last layer. Sent per layer, only the last layer's share is left
when the prefill ends.

How: the engine calls `LayerSends.hook(layer, ranges)` on its own thread after every
layer of every step (added by `AsyncEngine.add_layer_hook`; the engine knows nothing of
NIXL, and this class never touches the engine). For a request with an open `LayerStream`,
the hook records the span (layer, positions, the slots the engine names for them) and,
once a step's layers hold 2 MiB (or at its last layer), wakes the sender thread, which
posts one NIXL WRITE per step with all its ready layers (on the page-major pool
consecutive layers of a page are adjacent bytes, so they are one descriptor per page)
and drives it to completion. Spans that are ready before the decode node's window is known (an overlapped
send) wait for it. The completion notification is sent once, after every WRITE of the
window has landed (each NIXL UCX transfer ends with an endpoint flush), and carries the
lease id as the whole-window write's does.

On a GPU the engine's kernels are asynchronous: when the hook runs, layer L's K/V store is
only launched. The hook then records a CUDA event on the engine's stream (prefill/device.py),
and no WRITE names a span before its event has completed: the sender polls the events
while WRITEs are in flight, else waits for the first one not yet complete. The engine is
never stopped for it, and the device never synchronized whole. On the CPU the store has
run when the hook is called, and nothing is recorded.

Invariants (the whole-window path's, per span):
- Nothing is posted after an abort or a fence, past the request's deadline or past the
  decode node's lease end (`bound`, this node's monotonic clock); a WRITE still in flight
  at the bound is cancelled and the stream fails.
- The stream ends only when no WRITE of it is in flight; the role releases the source pages
  (or aborts the engine request) only after that, and a stream that ends without its
  notification tells the decode node that nothing more will be written (no-write tag).
- Positions the engine did not compute (a prefix this node had cached) and any position a
  layer missed are written at the end, before the notification (on a GPU once the
  prefill's `kv_ready` event has completed: no layer's event covers them).
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from concurrent.futures import Future

import numpy as np

from pdserve.kvtransfer.plan import plan_transfer
from pdserve.prefill.device import bind_device, kv_stored, on_gpu
from pdserve.prefill.layer_stream import LayerStream, Span, StreamFailed, on_loop


_FIRST_POLL_S = 50e-6  # the first check of a WRITE that was not done at once


class LayerSends:
    """The layer-wise streams of one prefill node and the thread that posts their WRITEs."""

    def __init__(self, agent, layout, engine, gates=None, poll_s: float = 0.002,
                 min_write_bytes: int = 2 << 20) -> None:
        self.agent, self.layout, self.engine = agent, layout, engine  # engine: the AsyncEngine
        self.poll_s = poll_s  # how often WRITEs in flight are driven on (this node has no NIXL thread)
        self.min_write_bytes = min_write_bytes
        self.layer_slot_bytes = 2 * layout.bytes_per_slot  # one position's K and V of one layer
        # Test gates (runtime/gates.py): a stream they name stops this process after its
        # first WRITE, a writer frozen mid-window.
        self.stops_mid_write = gates.stops_mid_write if gates is not None else None
        self.device = layout.device if on_gpu(layout.device) else None
        self._streams: dict[str, LayerStream] = {}
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="kv-layers", daemon=True)
        self._thread.start()
        engine.add_layer_hook(self.hook)  # in place before any request this node prefills

    # ---- the role's side (event loop thread) -------------------------------------------
    def open(self, request_id: str) -> LayerStream:
        """A stream collecting `request_id`'s layers from its next step on."""
        stream = LayerStream(request_id, self.layout.num_layers)
        with self._cond:
            self._streams[request_id] = stream
        return stream

    def aim(self, stream: LayerStream, peer: str, peer_layout, begin: int, end: int, dst_slots,
            bound: float, no_write: bytes) -> None:
        """Where the stream writes: positions [begin, end) to `dst_slots` on `peer`, no WRITE
        after `bound` (monotonic)."""
        with self._cond:
            stream.peer_layout, stream.begin, stream.end = peer_layout, begin, end
            stream.dst = np.asarray(dst_slots, dtype=np.int64)
            stream.bound, stream.no_write = bound, no_write
            stream.peer = peer
            self._cond.notify()

    def finish(self, stream: LayerStream, notification: bytes, src_slots, kv_ready=None) -> Future:
        """Write what is left (once `kv_ready`, the prefill's CUDA event, has completed),
        then the notification; the future ends with the stream."""
        with self._cond:
            stream.finishing = (notification, np.asarray(src_slots, dtype=np.int64))
            stream.kv_ready = kv_ready
            self._cond.notify()
        return stream.future

    def abort(self, stream: LayerStream, why: str) -> Future:
        """Post nothing more; the future ends once no WRITE of the stream is in flight."""
        with self._cond:
            if stream.error is None:
                stream.error = why
            self._cond.notify()
        return stream.future

    async def stopped(self, stream: LayerStream, why: str) -> None:
        """`abort`, awaited from the loop: once no WRITE of the stream is in flight (its
        StreamFailed is the abort asked for)."""
        await asyncio.wait([on_loop(self.abort(stream, why))])

    def drop(self, stream: LayerStream) -> None:
        """Forget a stream that was never aimed (its request writes the whole window)."""
        with self._cond:
            if not stream.aimed:
                self._streams.pop(stream.request_id, None)
                if not stream.future.done():
                    stream.future.set_result(None)

    def close(self) -> None:
        self.engine.remove_layer_hook(self.hook)
        with self._cond:
            self._stop = True
            for stream in self._streams.values():
                stream.error = stream.error or "the node is shutting down"
            self._cond.notify()
        self._thread.join(5)

    # ---- the engine's side (engine thread) ---------------------------------------------
    def hook(self, layer: int, ranges) -> None:
        """Never raises: a span it cannot record fails its stream, not the engine's step."""
        if not self._streams:
            return
        woke = False
        written = None
        for request_id, begin, end, slots in ranges:
            stream = self._streams.get(request_id)
            if stream is None or end <= begin:
                continue
            if stream.slot_key != (begin, end):  # once per step: the same for every layer
                stream.slots = np.asarray(slots, dtype=np.int64)
                stream.slot_key = (begin, end)
            if written is None and self.device is not None:
                try:
                    written = kv_stored(self.device)
                except Exception as err:  # unsent is safe, unfinished bytes are not
                    with self._cond:
                        stream.error = stream.error or f"no CUDA event after layer {layer}: {err!r}"
                    continue
            with self._cond:
                stream.spans.append(Span(layer, begin, end, stream.slots, written))
                stream.pending += (end - begin) * self.layer_slot_bytes
                span = stream.hooked[layer]
                span[0] = begin if span[0] < 0 else min(span[0], begin)
                span[1] = max(span[1], end)
                woke = woke or stream.pending >= self.min_write_bytes
        if woke or layer + 1 == self.layout.num_layers:
            with self._cond:
                self._cond.notify()

    # ---- the sender thread -------------------------------------------------------------
    def _run(self) -> None:
        bind_device(self.layout.device)  # this thread posts (and drives) the WRITEs
        delay = self.poll_s
        while True:
            with self._cond:
                if self._stop and not any(s.in_flight for s in self._streams.values()):
                    for stream in list(self._streams.values()):
                        self._end(stream)
                    return
                busy = any(s.in_flight for s in self._streams.values())
                if not busy and not any(self._has_work(s) for s in self._streams.values()):
                    self._cond.wait()
                streams = list(self._streams.values())
            writes = sum(s.writes for s in streams)
            for stream in streams:
                try:
                    self._service(stream)
                except Exception as err:  # the thread serves every stream: it must not die
                    with self._cond:  # the next pass drains the stream's writes, then ends it
                        stream.error = stream.error or f"layer-wise send failed: {err!r}"
            if any(s.in_flight for s in streams):
                # A WRITE just posted is checked soon, then ever less often: the last
                # layers' WRITE is on the time to first token (a GPU copy is done in tens
                # of microseconds), a slow link's is not worth many wakes.
                delay = _FIRST_POLL_S if sum(s.writes for s in streams) > writes else min(2 * delay, self.poll_s)
                with self._cond:
                    self._cond.wait(delay)
            elif self.device is not None:
                try:
                    self._wait_device(streams)
                except Exception:  # a failed event fails its stream in the next pass
                    pass

    def _wait_device(self, streams: list[LayerStream]) -> None:
        """With no WRITE to drive, wait for the first span the device has not written yet:
        nothing can be posted before it lands (the engine's stream runs them in order)."""
        with self._cond:
            pending = next((x.written for s in streams if s.error is None for x in s.spans
                            if not x.landed), None)
        if pending is not None:
            pending.synchronize()  # this event alone: never the whole device

    def _has_work(self, s: LayerStream) -> bool:
        return s.error is not None or s.aimed and (s.finishing is not None or bool(self._ready(s.spans, False)[0]))

    def _service(self, s: LayerStream) -> None:
        try:
            with self._cond:
                if s.error is None and s.aimed and time.monotonic() >= s.bound:
                    s.error = "its deadline or the decode node's lease passed during the write"
                finishing = s.finishing if s.error is None else None
                spans, s.spans = self._ready(s.spans, finishing is not None) if s.aimed and s.error is None \
                    else ([], s.spans)
                if spans and self.device is not None:  # what the device has not written waits
                    landed = [x.landed for x in spans]
                    s.spans = [x for x, ok in zip(spans, landed) if not ok] + s.spans
                    spans = [x for x, ok in zip(spans, landed) if ok]
                s.pending = sum((x.end - x.begin) * self.layer_slot_bytes for x in s.spans)
            self._poll(s)
            if spans:
                self._post_spans(s, spans)
                self._poll(s)  # on shared memory a WRITE is often done by now: no wake for it
            if finishing is not None and finishing[1] is not None and not s.spans:
                self._post_leftovers(s, finishing[1])
                s.finishing = finishing = (finishing[0], None)
        except Exception as err:  # a failed WRITE or plan: stop the stream
            with self._cond:
                s.error = s.error or f"KV write failed: {err}"
        if s.error is not None:
            self._drain(s)
            return
        if s.finishing is not None and s.finishing[1] is None and not s.in_flight and not s.spans:
            try:
                self.agent.send_notification(s.peer, s.finishing[0])
            except Exception as err:  # every byte landed, but the decode node will not hear it
                s.error = f"the KV-ready notification failed: {err}"
            self._end(s)

    def _poll(self, s: LayerStream) -> None:
        still = []
        for handle in s.in_flight:
            if self.agent.done(handle):
                self.agent.release(handle)
            else:
                still.append(handle)
        s.in_flight = still

    def _ready(self, spans, finishing: bool):
        """(spans to post now, spans to keep): a step's layers go out together once they hold
        `min_write_bytes`, with its last layer, or when the prefill has ended. Each wake of
        this thread costs the model's threads more than the bytes do (measured: one WRITE per
        layer of SmolLM2 slowed its prefill 6-12% on shared memory, 2 MiB per WRITE 1-3%)."""
        if finishing:
            return spans, []
        size: dict[tuple[int, int], int] = {}
        last = set()
        for x in spans:
            size[(x.begin, x.end)] = size.get((x.begin, x.end), 0) + (x.end - x.begin) * self.layer_slot_bytes
            if x.layer + 1 == self.layout.num_layers:
                last.add((x.begin, x.end))
        go = {k for k, n in size.items() if n >= self.min_write_bytes or k in last}
        return [x for x in spans if (x.begin, x.end) in go], [x for x in spans if (x.begin, x.end) not in go]

    def _post_spans(self, s: LayerStream, spans) -> None:
        groups: dict[tuple[int, int], tuple[list[int], np.ndarray]] = {}
        for x in spans:
            groups.setdefault((x.begin, x.end), ([], x.slots))[0].append(x.layer)
        for (begin, end), (layers, slots) in groups.items():
            lo, hi = max(begin, s.begin), min(end, s.end)
            if lo < hi:
                self._post(s, slots[lo - begin:hi - begin], lo, hi, sorted(layers))

    def _post_leftovers(self, s: LayerStream, src_all: np.ndarray) -> None:
        """Every (layer, position) of the window no span covered: one WRITE per distinct
        run, all its layers together."""
        todo: dict[tuple[int, int], list[int]] = {}
        for layer, (lo, hi) in enumerate(s.hooked):
            if lo < 0 or hi <= s.begin or lo >= s.end:  # nothing of the window computed here
                gaps = [(s.begin, s.end)]
            else:
                gaps = [(s.begin, lo), (hi, s.end)]
            for a, b in gaps:
                if a < b:
                    todo.setdefault((a, b), []).append(layer)
        if todo and s.kv_ready is not None:  # positions no span's event covers
            s.kv_ready.synchronize()
        for (a, b), layers in todo.items():
            self._post(s, src_all[a:b], a, b, layers)

    def _post(self, s: LayerStream, src: np.ndarray, lo: int, hi: int, layers: list[int]) -> None:
        plan = plan_transfer(self.layout, src, s.peer_layout, s.dst[lo - s.begin:hi - s.begin], layers=layers)
        s.in_flight.append(self.agent.post(s.peer, plan))
        s.total_bytes += plan.total_bytes
        s.num_descriptors += plan.num_descriptors
        s.writes += 1
        if s.writes == 1 and self.stops_mid_write is not None and self.stops_mid_write(s.request_id):
            # As prefill/sending.py's whole-window write: this thread stops, and with it
            # the process (SIGSTOP stops every thread), until a test sends SIGCONT.
            signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)

    def _drain(self, s: LayerStream) -> None:
        """A failed or aborted stream: wait out its WRITEs (cancel them past the bound),
        then tell the decode node nothing more comes."""
        past = time.monotonic() >= s.bound
        still = []
        for handle in s.in_flight:
            try:
                finished = past or self.agent.done(handle)
            except Exception:
                finished = True
            if finished:
                self.agent.release(handle)
            else:
                still.append(handle)
        s.in_flight = still
        if still:
            return
        if s.aimed and s.no_write:
            try:
                self.agent.send_notification(s.peer, s.no_write)
            except Exception:
                pass  # the decode node falls back on its quarantine timeout
        self._end(s)

    def _end(self, s: LayerStream) -> None:
        with self._cond:
            self._streams.pop(s.request_id, None)
        if s.future.done():
            return
        if s.error is None:
            s.future.set_result(None)
        else:
            s.future.set_exception(StreamFailed(s.error))
