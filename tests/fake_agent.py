"""In-process stand-ins for `kvtransfer.agent.TransferAgent`, so the prefill and decode
roles can be tested without NIXL, gRPC or other processes.

A `FakeFabric` connects `FakeAgent`s living in this process. Each agent owns a KV pool
tensor; because every pool is in this process, the absolute addresses of a
`TransferPlan` can be copied directly with `ctypes.memmove`. Like the real agent:
- `metadata()` names the agent; `add_remote(metadata)` registers the peer, returns its name;
- `write(remote, plan, tag, timeout_s)` copies every descriptor, then delivers `tag` to
  the remote (the notification comes after the data); it raises `TransferError` for an
  unknown peer, a closed agent, an address outside either registered pool, or a timeout;
- `post`, `done`, `release`: the layer-wise sender's WRITE, copied at once by `post`;
- `send_notification`, `take_notifications`, `wait_notification` and `close` behave
  as documented in kvtransfer/agent.py; `stay_active(seconds)` records `seconds` in
  `kept_active`.

Knobs for tests (none involves wall-clock time):
- `hold_writes()` returns a `Hold`: the next writes block at their start (after `started`
  is set, before copying) until `Hold.release()`, so a test holds a write "in flight";
- `fail_next_write()` makes the next write raise `TransferError` without copying;
- `writes` (on the writer) and `received` (on the target) record what was written;
- `wait_polled(n)` waits until `take_notifications` was called `n` times in total (the
  decode role's inbox pump polls it), to prove a waiter was still waiting after polls.
"""

from __future__ import annotations

import ctypes
import threading
from collections import deque
from dataclasses import dataclass, field

from pdserve.kvtransfer.agent import TransferError
from pdserve.kvtransfer.plan import TransferPlan
from pdserve.kvtransfer.regions import dense_storage

_META_PREFIX = b"fake-agent|"


@dataclass
class WriteRecord:
    """One completed write: the peer, the notification it carried, its descriptors."""

    remote: str
    notification: bytes
    descriptors: list[tuple[int, int, int]]  # (src_addr, dst_addr, nbytes)
    timeout_s: float

    @property
    def num_bytes(self) -> int:
        return sum(n for _, _, n in self.descriptors)


@dataclass
class Hold:
    """Writes wait at their start until `release()`; `started` is set when one arrives."""

    started: threading.Event = field(default_factory=threading.Event)
    released: threading.Event = field(default_factory=threading.Event)

    def release(self) -> None:
        self.released.set()


class FakeFabric:
    """The agents of one process, by name."""

    def __init__(self) -> None:
        self._agents: dict[str, FakeAgent] = {}
        self._lock = threading.Lock()

    def agent(self, name: str, kv_cache) -> FakeAgent:
        return FakeAgent(name, kv_cache, self)

    def _register(self, agent: FakeAgent) -> None:
        with self._lock:
            if agent.name in self._agents:
                raise ValueError(f"agent {agent.name!r} already exists on this fabric")
            self._agents[agent.name] = agent

    def _unregister(self, agent: FakeAgent) -> None:
        with self._lock:
            if self._agents.get(agent.name) is agent:
                del self._agents[agent.name]

    def lookup(self, name: str) -> FakeAgent | None:
        with self._lock:
            return self._agents.get(name)


class FakeAgent:
    """A TransferAgent over `kv_cache` (a tensor whose bytes are one region) on `fabric`."""

    def __init__(self, name: str, kv_cache, fabric: FakeFabric) -> None:
        if not (kv_cache.is_contiguous() or dense_storage(kv_cache)):
            raise ValueError("the KV pool tensor must be one region (contiguous, or a layer-major view)")
        self.name = name
        self.kv_cache = kv_cache  # keeps the memory alive while the agent may write it
        self.base_addr = int(kv_cache.data_ptr())
        self.nbytes = kv_cache.numel() * kv_cache.element_size()
        self.fabric = fabric
        self._cond = threading.Condition()
        self._remotes: set[str] = set()
        self._notifs: deque[tuple[str, bytes]] = deque()
        self._hold: Hold | None = None
        self._fail_next: str | None = None
        self._closed = False
        self.writes: list[WriteRecord] = []  # completed writes this agent made
        self.received: list[tuple[str, int, int]] = []  # (sender, dst_addr, nbytes)
        self.notifications_sent: list[tuple[str, bytes]] = []  # standalone ones
        self.add_remote_calls = 0
        self.remote_regions: dict[str, list[tuple[int, int, int]] | None] = {}  # as add_remote got them
        self.polls = 0  # take_notifications calls
        self.kept_active: list[float | None] = []  # stay_active calls
        fabric._register(self)

    # ---- knobs ------------------------------------------------------------------------
    def hold_writes(self) -> Hold:
        """Writes from now on block at their start until the returned hold is released."""
        with self._cond:
            self._hold = Hold()
            return self._hold

    def fail_next_write(self, message: str = "injected write failure") -> None:
        with self._cond:
            self._fail_next = message

    def wait_polled(self, n: int, timeout_s: float = 5.0) -> bool:
        """Whether `take_notifications` was called `n` times in all within `timeout_s`."""
        with self._cond:
            return self._cond.wait_for(lambda: self.polls >= n, timeout_s)

    # ---- TransferAgent API ------------------------------------------------------------
    def metadata(self) -> bytes:
        return _META_PREFIX + self.name.encode()

    def add_remote(self, metadata: bytes, regions=None, memory_kind: str = "") -> str:
        if not isinstance(metadata, bytes) or not metadata.startswith(_META_PREFIX):
            raise TransferError(f"cannot load remote agent metadata: {metadata!r}")
        name = metadata[len(_META_PREFIX):].decode()
        if self.fabric.lookup(name) is None:
            raise TransferError(f"cannot load remote agent metadata: no agent {name!r}")
        with self._cond:
            self.add_remote_calls += 1
            self._remotes.add(name)
            self.remote_regions[name] = None if regions is None else list(regions)
        return name

    @property
    def remotes(self) -> list[str]:
        with self._cond:
            return sorted(self._remotes)

    def write(self, remote_name: str, plan, notification: bytes, timeout_s: float = 30.0) -> None:
        if isinstance(notification, str):
            notification = notification.encode()
        remote = self._peer(remote_name)
        if isinstance(plan, TransferPlan):
            descriptors = plan.descriptors
        else:
            descriptors = [(int(s), int(d), int(n)) for s, d, n in plan]
        for src, dst, n in descriptors:
            if not (self.base_addr <= src and src + n <= self.base_addr + self.nbytes):
                raise TransferError(f"source 0x{src:x}+{n} is outside {self.name!r}'s pool")
            if not (remote.base_addr <= dst and dst + n <= remote.base_addr + remote.nbytes):
                raise TransferError(f"destination 0x{dst:x}+{n} is outside {remote_name!r}'s pool")
        with self._cond:
            hold, fail = self._hold, self._fail_next
            self._fail_next = None
        if hold is not None:
            hold.started.set()
            if not hold.released.wait(timeout_s):
                raise TransferError(f"WRITE to {remote_name!r} timed out after {timeout_s}s")
        if fail is not None:
            raise TransferError(f"WRITE to {remote_name!r} failed: {fail}")
        for src, dst, n in descriptors:
            ctypes.memmove(dst, src, n)
        with self._cond:
            self.writes.append(WriteRecord(remote_name, notification, descriptors, timeout_s))
            self._cond.notify_all()  # for a test waiting on `writes`
        remote._receive(self.name, [(dst, n) for _, dst, n in descriptors], notification)

    def post(self, remote_name: str, plan, notification: bytes = b"") -> WriteRecord:
        """The layer-wise sender's non-blocking WRITE: here it copies at once (a held write
        blocks the posting thread, as a stalled link would); `done` is then True."""
        self.write(remote_name, plan, notification)
        return self.writes[-1]

    def done(self, handle) -> bool:
        return True

    def release(self, handle) -> None:
        pass

    def send_notification(self, remote_name: str, message: bytes) -> None:
        if isinstance(message, str):
            message = message.encode()
        remote = self._peer(remote_name)
        with self._cond:
            self.notifications_sent.append((remote_name, message))
        remote._receive(self.name, [], message)

    def stay_active(self, seconds: float | None = None) -> None:
        self.kept_active.append(seconds)

    def take_notifications(self) -> list[tuple[str, bytes]]:
        with self._cond:
            out = list(self._notifs)
            self._notifs.clear()
            self.polls += 1
            self._cond.notify_all()
            return out

    def wait_notification(self, tag: bytes, timeout_s: float = 30.0) -> bool:
        """Wait until a notification equal to `tag` arrives (consuming it); False on timeout."""
        with self._cond:
            def arrived():
                return any(msg == tag for _, msg in self._notifs)
            if not self._cond.wait_for(arrived, timeout_s):
                return False
            for i, (_, msg) in enumerate(self._notifs):
                if msg == tag:
                    del self._notifs[i]
                    return True
        return False  # unreachable

    def close(self) -> None:
        with self._cond:
            self._closed = True
            if self._hold is not None:
                self._hold.release()
        self.fabric._unregister(self)

    # ---- internals ----------------------------------------------------------------------
    def _peer(self, remote_name: str) -> FakeAgent:
        with self._cond:
            if self._closed:
                raise TransferError(f"agent {self.name!r} is closed")
            if remote_name not in self._remotes:
                raise TransferError(f"unknown remote agent {remote_name!r}: call add_remote first")
        remote = self.fabric.lookup(remote_name)
        if remote is None:
            raise TransferError(f"remote agent {remote_name!r} is gone")
        return remote

    def _receive(self, sender: str, ranges: list[tuple[int, int]], notification: bytes) -> None:
        with self._cond:
            self.received.extend((sender, dst, n) for dst, n in ranges)
            self._notifs.append((sender, notification))
            self._cond.notify_all()
