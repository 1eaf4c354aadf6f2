"""One request's layer-wise send (prefill/layerwise.py) as the sender sees it: the spans of
KV the engine has computed and not yet written, where the window goes, what is in flight.

A span is one layer's positions [begin, end) of one engine step. On a GPU it carries the
CUDA event recorded after that layer's K/V store was launched (prefill/device.py), and its
bytes may be written only once the event has completed (`Span.landed`); on the CPU the
store has run when the span is recorded.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from typing import NamedTuple

import numpy as np


class StreamFailed(RuntimeError):
    """A layer-wise send ended without its notification (why: the message)."""


class Span(NamedTuple):
    """Positions [begin, end) of one layer, computed in one step, at `slots` of this pool."""

    layer: int
    begin: int
    end: int
    slots: np.ndarray
    written: object = None  # GPU: the CUDA event after the layer's K/V store; CPU: None

    @property
    def landed(self) -> bool:
        """Whether the span's bytes are in memory (its K/V store has run on the device)."""
        return self.written is None or self.written.query()


class LayerStream:
    """One request's layer-wise send. Fields are guarded by the owning LayerSends' lock."""

    def __init__(self, request_id: str, num_layers: int) -> None:
        self.request_id = request_id
        self.spans: list[Span] = []  # to post
        self.pending = 0  # bytes in `spans`
        self.hooked = [[-1, -1] for _ in range(num_layers)]  # per layer: [lo, hi) computed
        self.slot_key: tuple[int, int] | None = None
        self.slots: np.ndarray | None = None
        self.peer: str | None = None  # set by `aim`
        self.peer_layout = None
        self.begin = self.end = 0
        self.dst: np.ndarray | None = None
        self.bound = 0.0
        self.no_write = b""
        self.in_flight: list = []
        self.finishing: tuple[bytes, np.ndarray] | None = None  # (notification, every src slot)
        self.kv_ready = None  # GPU: the prefill's CUDA event, before the leftovers are written
        self.error: str | None = None
        self.future: Future = Future()
        self.total_bytes = self.num_descriptors = self.writes = 0

    @property
    def aimed(self) -> bool:
        return self.peer is not None


def on_loop(future: Future) -> asyncio.Future:
    """A stream's end as a future of the running loop. Its StreamFailed counts as seen as it
    is set: an aborted send's end may never be awaited (only a fence reads it), and asyncio
    would log "exception was never retrieved" for each such one, also for one set in the
    loop's last turn, before a done callback could read it (asyncio.wrap_future's way)."""
    loop = asyncio.get_running_loop()
    ended = loop.create_future()

    def settle(done: Future) -> None:  # on the loop
        if ended.done():
            return
        if done.cancelled():
            ended.cancel()
        elif (error := done.exception()) is not None:
            ended.set_exception(error)
            ended.exception()  # seen
        else:
            ended.set_result(done.result())

    def wake(done: Future) -> None:  # on the thread that ended `future`
        try:
            loop.call_soon_threadsafe(settle, done)
        except RuntimeError:  # the loop has closed: nothing waits for it any more
            pass

    future.add_done_callback(wake)
    return ended
