"""A RemoteSend in progress on a prefill node, and what its futures hold."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from prefill.peers import DecodePeer
from prefill.requests import Window


@dataclass
class Sending:
    """A send in progress: abort stops it unless its write already began."""

    aborted: bool = False
    writing: bool = False
    window: asyncio.Future | None = None  # (Window, DecodePeer), while it may still come
    delivered: tuple[Window, DecodePeer] | None = None
    write: asyncio.Future | None = None  # the write, once it began


def resolve(future: asyncio.Future, delivery: object) -> None:
    if isinstance(delivery, BaseException):
        future.set_exception(delivery)
        future.exception()  # retrieved: the send may have ended before waiting
    else:
        future.set_result(delivery)


def landed(sending: Sending) -> str | None:
    """The lease id a send's write landed in, if it did."""
    write, delivered = sending.write, sending.delivered
    if write is None or not write.done() or write.cancelled() or write.exception() is not None:
        return None
    return delivered[0].lease_id if delivered else None


def delivered_of(future: asyncio.Future | None):
    """The (window, peer) a future holds, if it came (a window may come after the prefill
    failed: its decode node must still hear that nothing will be written)."""
    if future is not None and future.done() and future.exception() is None:
        return future.result()
    return None
