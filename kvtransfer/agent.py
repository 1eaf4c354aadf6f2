"""TransferAgent: one NIXL agent (UCX backend) per worker, moving KV with WRITE.

Invariants:
- The whole KV pool is registered once, at construction, and stays registered until
  ``close()``; transfers only name addresses inside it (NIXL rejects anything else).
- A remote agent is loaded once per distinct metadata blob and reused (peer_table.py).
- Each descriptor carries the device id of the registered region holding it, on its own
  side (NIXL matches on it); one outside every known region is refused (regions.py).
- A cancelled WRITE of GPU memory is waited for on the device before `release` returns.
- ``write`` returns only when every byte has landed remotely, and the notification it
  carries is delivered after the data (NIXL sends it once the writes are flushed). It
  raises ``TransferError`` on failure or timeout and never waits past its deadline.
- No busy spinning. nixl's Python wrapper (``nixl_agent``) hard-codes the UCX progress
  thread's poll delay (``pthrDelay``) to 0, which spins a core even when idle, so the agent
  is built on ``nixl._bindings`` directly. By default NIXL's progress thread is off: a
  `Poller` thread polls every ``poll_interval_s`` (wire-up, notifications, target-side
  work), every ``idle_poll_interval_s`` after ``idle_after_s`` of no work (poller.py),
  and ``write`` drives the copy itself. Measured here, NIXL's thread made the many
  small puts of a fragmented window fight it for UCX's worker spinlock (~45% of samples
  in ``pthread_spin_lock``). ``progress_thread=True`` keeps NIXL's thread, with a
  non-zero ``pthrDelay`` so it sleeps in ``poll()`` between events.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from .peer_table import PeerLoadError, PeerTable
from .plan import TransferPlan
from .poller import Poller
from .regions import RegionTable, memory_regions


# NIXL's progress thread sleeps in poll() on UCX's event fd, so events wake it at once; the
# delay is only its periodic wake-up (NIXL's guard against a missed event), so it sets what
# an idle node spends, not how fast KV moves (docs/benchmarks.md, transfer).
PROGRESS_DELAY_US = 20_000


class TransferError(RuntimeError):
    """A KV transfer failed, timed out, or named an unknown peer."""


def _bindings() -> Any:
    import nixl  # imported lazily: it loads UCX and is not needed to plan or validate

    return nixl._bindings


class TransferAgent:
    """A worker's NIXL agent over its KV pool (a tensor, or ``[(addr, nbytes), ...]``)."""

    def __init__(
        self,
        name: str,
        memory: Any,
        *,
        progress_thread: bool = False,
        progress_delay_us: int = PROGRESS_DELAY_US,
        poll_interval_s: float = 0.01,
        idle_poll_interval_s: float = 0.1,
        idle_after_s: float = 1.0,
        backend_params: dict[str, str] | None = None,
    ) -> None:
        if progress_delay_us <= 0:
            raise ValueError("progress_delay_us must be positive (0 makes UCX's thread spin)")
        if not 0 < poll_interval_s <= idle_poll_interval_s:
            raise ValueError(f"poll_interval_s ({poll_interval_s}) must be positive, "
                             f"idle_poll_interval_s ({idle_poll_interval_s}) no shorter")
        b = _bindings()
        self._b = b
        self.name = name
        self._lock = threading.Lock()  # guards the notification buffer
        self._notifs: deque[tuple[str, bytes]] = deque(maxlen=65536)
        self._closed = False

        cfg = b.nixlAgentConfig()
        cfg.useProgThread = progress_thread
        cfg.useListenThread = False  # metadata travels over our own gRPC, not NIXL's socket
        cfg.pthrDelay = int(progress_delay_us)
        # write() and wait_notification() may run on different threads of one worker
        cfg.syncMode = b.NIXL_THREAD_SYNC_STRICT
        self._agent = b.nixlAgent(name, cfg)
        if "UCX" not in self._agent.getAvailPlugins():
            raise TransferError("the NIXL UCX plugin is not available")
        self._backend = self._agent.createBackend("UCX", dict(backend_params or {}))
        self._peers = PeerTable(self._agent, {"DRAM": b.DRAM_SEG, "VRAM": b.VRAM_SEG})

        regions, kind = memory_regions(memory)
        self._mem = b.DRAM_SEG if kind == "DRAM" else b.VRAM_SEG
        self._reg = b.nixlRegDList(self._mem, [(a, n, d, "") for a, n, d in regions])
        self._agent.registerMem(self._reg, [self._backend])
        self._regions = RegionTable(regions)
        self._keep = memory  # the registered memory must outlive the registration

        self._progress_thread = progress_thread
        self._poller: Poller | None = None
        if not progress_thread:
            self._poller = Poller(self._poll_once, f"nixl-poll-{name}", poll_interval_s, idle_poll_interval_s,
                                  idle_after_s, on_start=self.bind_device)

    def bind_device(self) -> None:
        """Make the pool's CUDA device current on the calling thread (nothing for host
        memory): UCX progress there completes CUDA copies, which wants the device's context."""
        if self._mem != self._b.DRAM_SEG:
            import torch  # a GPU pool was registered from a torch tensor

            torch.cuda.set_device(int(self._regions.dev_ids[0]))

    def stay_active(self, seconds: float | None = None) -> None:
        """Poll at the busy interval for `seconds` (default ``idle_after_s``): a node about
        to be written to calls this, so its side of the work waits for no idle poll."""
        if self._poller is not None:
            self._poller.stay_active(seconds)

    def _poll_once(self) -> bool:
        with self._lock:
            try:
                return self._agent is not None and self._drain()
            except Exception:
                return False  # a failed poll surfaces in the next write or wait

    # ----------------------------------------------------------------- metadata / peers
    def metadata(self) -> bytes:
        """This agent's NIXL metadata (connection info + registered pool), for peers."""
        return self._agent.getLocalMD()

    def add_remote(self, metadata: bytes, regions: Sequence[tuple[int, int, int]] | None = None,
                   memory_kind: str = "") -> str:
        """Load a peer's metadata once and return its agent name (peer_table.py).
        ``regions``, the peer's ``[(addr, nbytes, device id), ...]`` (`regions_of` its layout),
        set each destination descriptor's device id; never given, every destination carries
        this agent's first device id, which is right only when both use one device.
        ``memory_kind`` ("DRAM" or "VRAM", `memory_kind_of` its layout): the peer's, where it
        may differ from this agent's."""
        self.stay_active()
        try:
            return self._peers.add(metadata, regions, memory_kind)
        except PeerLoadError as e:
            raise TransferError(str(e)) from e

    def remove_remote(self, remote_name: str) -> None:
        self._peers.remove(remote_name)

    @property
    def remotes(self) -> list[str]:
        return self._peers.names()

    # ------------------------------------------------------------------------ transfers
    def _dlist(self, addrs: np.ndarray, sizes: np.ndarray, remote_name: str | None = None) -> Any:
        """Descriptors of this agent's memory (``remote_name`` None) or of a peer's."""
        arr = np.empty((addrs.size, 3), dtype=np.uint64)
        arr[:, 0] = addrs
        arr[:, 1] = sizes
        peer = None if remote_name is None else self._peers.get(remote_name)
        table = self._regions if remote_name is None else peer and peer.regions
        try:  # a peer added without regions: assume one device, ours
            arr[:, 2] = self._regions.dev_ids[0] if table is None else table.device_ids(arr[:, 0], arr[:, 1])
        except ValueError as e:
            side = "local" if remote_name is None else f"remote {remote_name!r}"
            raise TransferError(f"{side} {e}") from None
        return self._b.nixlXferDList(self._mem if peer is None or peer.mem is None else peer.mem, arr)

    def post(self, remote_name: str, plan: TransferPlan | Sequence[tuple[int, int, int]],
             notification: bytes = b"") -> Any:
        """Start a WRITE of ``plan``'s descriptors into ``remote_name`` (with
        ``notification`` delivered after its data, if not empty); the handle for `done`
        and `release`. Every posted handle must be released."""
        self.stay_active()
        if isinstance(notification, str):
            notification = notification.encode()
        if self._closed:
            raise TransferError(f"agent {self.name!r} is closed")
        if self._peers.get(remote_name) is None:
            raise TransferError(f"unknown remote agent {remote_name!r}: call add_remote first")
        if isinstance(plan, TransferPlan):
            src, dst, sizes = plan.src_addrs, plan.dst_addrs, plan.sizes
        else:
            arr = np.asarray(list(plan), dtype=np.uint64).reshape(-1, 3)
            src, dst, sizes = arr[:, 0], arr[:, 1], arr[:, 2]
        local, remote = self._dlist(src, sizes), self._dlist(dst, sizes, remote_name)
        try:
            handle = self._agent.createXferReq(self._b.NIXL_WRITE, local, remote, remote_name, notification,
                                               [self._backend])
        except Exception as e:
            raise TransferError(f"cannot create a WRITE to {remote_name!r}: {e}") from e
        try:
            self._agent.postXferReq(handle, notification)
        except Exception as e:
            self.release(handle)
            raise TransferError(f"WRITE to {remote_name!r} failed: {e}") from e
        return handle

    def done(self, handle: Any) -> bool:
        """Whether a posted WRITE has landed remotely (each NIXL UCX transfer ends with an
        endpoint flush, so done means the bytes are in the peer's memory); progresses it
        (without NIXL's thread, this call moves the data). Raises TransferError if it failed."""
        try:
            status = self._agent.getXferStatus(handle)
        except Exception as e:
            raise TransferError(f"WRITE failed: {e}") from e
        if status == self._b.NIXL_IN_PROG:
            return False
        if status != self._b.NIXL_SUCCESS:
            raise TransferError(f"WRITE failed: {status}")
        return True

    def release(self, handle: Any) -> None:
        """Free a handle, cancelling its WRITE if still in flight. In GPU memory a WRITE's
        copies are queued on the device when it is posted (UCX's cuda_ipc: one per
        descriptor), where a cancel does not reach: a cancelled one is waited for there, so
        that both sides' pages may be reused once this returns."""
        on_gpu = self._mem != self._b.DRAM_SEG
        try:
            cancelled = on_gpu and self._agent.getXferStatus(handle) == self._b.NIXL_IN_PROG
        except Exception:
            cancelled = True  # failed midway: some copies may be queued all the same
        try:
            self._agent.releaseXferReq(handle)
        except Exception:
            pass  # NIXL could not cancel; the agent frees it at destruction
        if cancelled and on_gpu:
            import torch  # only a GPU pool gets here, and it was registered from a torch tensor

            for device in sorted({int(d) for d in self._regions.dev_ids}):  # ints: torch takes no numpy ids
                torch.cuda.synchronize(device)

    def write(self, remote_name: str, plan: TransferPlan | Sequence[tuple[int, int, int]], notification: bytes,
              timeout_s: float = 30.0) -> None:
        """WRITE ``plan``'s descriptors into ``remote_name``, then deliver ``notification``.

        Returns once the data is in place remotely; raises ``TransferError`` on failure
        or when ``timeout_s`` passes (the request is cancelled).
        """
        if not (plan.num_descriptors if isinstance(plan, TransferPlan) else len(plan)):
            self.send_notification(remote_name, notification)
            return
        deadline = time.monotonic() + timeout_s
        handle = self.post(remote_name, plan, notification)
        try:
            delay = 0.0
            polls = 0
            while not self.done(handle):
                polls += 1
                if polls % 64 == 0 and time.monotonic() > deadline:
                    raise TransferError(f"WRITE to {remote_name!r} timed out after {timeout_s}s")
                if self._progress_thread:
                    # NIXL's thread moves the data; polling it hard only fights for its lock
                    time.sleep(delay)
                    delay = min(0.001, delay * 2 or 0.00002)
                elif polls % 256 == 0:
                    time.sleep(0)  # each status call copies the next chunk; let other threads run
        finally:
            self.release(handle)  # cancels it if still in flight

    # -------------------------------------------------------------------- notifications
    def send_notification(self, remote_name: str, message: bytes) -> None:
        """Send a standalone notification (not tied to a transfer)."""
        self.stay_active()
        if isinstance(message, str):
            message = message.encode()
        try:
            self._agent.genNotif(remote_name, message, [self._backend])
        except Exception as e:
            raise TransferError(f"cannot notify {remote_name!r}: {e}") from e

    def _drain(self) -> bool:
        """Notifications received into the buffer; whether there were any."""
        new = self._agent.getNotifs({}, [])
        for remote, msgs in new.items():
            for m in msgs:
                self._notifs.append((remote, bytes(m)))
        return bool(new)

    def _take(self, tag: bytes) -> bool:
        for i, (_, msg) in enumerate(self._notifs):
            if msg == tag:
                del self._notifs[i]
                return True
        return False

    def wait_notification(self, tag: bytes, timeout_s: float = 30.0) -> bool:
        """Wait until a notification equal to ``tag`` arrives (consuming it); False on timeout."""
        self.stay_active()
        if isinstance(tag, str):
            tag = tag.encode()
        deadline = time.monotonic() + timeout_s
        delay = 0.0001
        while True:
            with self._lock:
                self._drain()
                if self._take(tag):
                    return True
            now = time.monotonic()
            if now >= deadline:
                return False
            time.sleep(min(delay, deadline - now))
            delay = min(delay * 2, 0.002)

    def take_notifications(self) -> list[tuple[str, bytes]]:
        """All notifications received and not yet consumed, as (remote, message)."""
        self.stay_active()
        with self._lock:
            self._drain()
            out = list(self._notifs)
            self._notifs.clear()
            return out

    # -------------------------------------------------------------------------- closing
    def close(self) -> None:
        """Drop peers, deregister the pool and stop the progress thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._poller is not None:
            self._poller.close()
        self._peers.close()
        try:
            self._agent.deregisterMem(self._reg, [self._backend])
        except Exception:
            pass
        with self._lock:
            self._agent = None  # the C++ destructor joins NIXL's progress thread if any

    def __enter__(self) -> "TransferAgent":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
