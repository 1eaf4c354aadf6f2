"""A RemoteSend in progress on a prefill node, and what its futures hold."""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from pdserve.kvtransfer.agent import TransferError

from pdserve.prefill.device import bind_device
from pdserve.prefill.peers import DecodePeer
from pdserve.prefill.requests import Window
from pdserve.runtime.errors import PeerUnavailable

log = logging.getLogger("pdserve.prefill")


@dataclass
class Sending:
    """A send in progress: abort stops it unless its write already began."""

    aborted: bool = False
    writing: bool = False
    window: asyncio.Future | None = None  # (Window, DecodePeer), while it may still come
    delivered: tuple[Window, DecodePeer] | None = None
    write: asyncio.Future | None = None  # the write, once it began
    stream: object = None  # its prefill/layer_stream.LayerStream, once aimed at the window
    cache_salt: str = ""  # the request's: its prefill matches and publishes pages under it
    priority: int = 0  # the request's: its place in the engine's line
    lora: str = ""  # the request's LoRA adapter: its prefill runs with it


def writer_threads(device: str) -> ThreadPoolExecutor:
    """The role's threads for whole-window writes and notices, with the pool's device
    current (prefill/device.py)."""
    return ThreadPoolExecutor(max_workers=8, thread_name_prefix="kv-write", initializer=bind_device,
                              initargs=(device,))


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


async def write_window(role, sending: Sending, request_id: str, agent_name: str, plan, tag: bytes,
                       timeout_s: float, kv_ready=None) -> None:
    """The whole window's NIXL write on the role's writer threads, once the engine's kernels
    stored the KV (`kv_ready`: their CUDA event; None on the CPU), awaited to its end even if
    this call is cancelled (a test gate holds it at its start, as a write that lands late)."""
    def write_in_halves():  # a writer frozen mid-window (runtime/gates.py)
        first, rest = plan.halves()
        role.agent.write(agent_name, first, b"", timeout_s)
        # To this thread, not the process: a process-directed SIGSTOP is taken by the
        # main thread, and this one would run on (and write the rest) until it is.
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
        role.agent.write(agent_name, rest, tag, timeout_s)

    async def write_kv():
        write = functools.partial(role.agent.write, agent_name, plan, tag, timeout_s)
        if role.gates is not None:
            await role.gates.passage("kv_write", request_id)
            if role.gates.stops_mid_write(request_id):
                write = write_in_halves
        await asyncio.get_running_loop().run_in_executor(role._writers, after(kv_ready, write))

    write = sending.write = asyncio.ensure_future(write_kv())
    try:
        await asyncio.shield(write)
    except asyncio.CancelledError:
        try:
            await write
        except Exception:
            pass
        raise
    except TransferError as err:
        raise PeerUnavailable(f"KV write failed: {err}") from None


def after(event, fn):
    """`fn`, run once `event` (a CUDA event, or None) has completed: in the caller's thread,
    never the event loop's."""
    def run():
        if event is not None:
            event.synchronize()
        return fn()
    return run


def tell_no_write(role, agent_name: str, tag: bytes) -> None:
    """Tell a decode node, from a writer thread, that nothing will be written for `tag`."""
    def send():
        try:
            role.agent.send_notification(agent_name, tag)
        except Exception as err:  # the decode node falls back on its quarantine timeout
            log.warning("no-write notice to %s failed: %s", agent_name, err)
    role._writers.submit(send)
