"""A TCP relay from our network namespace into another one (`Link.forward`).

A test or benchmark in the root namespace cannot dial `10.2xx.x.x:PORT` inside a link's
namespace. A `Relay` listens on 127.0.0.1 here and carries each accepted connection's
bytes, both ways, to a target dialled from inside the namespace. Invariants:
- The listening socket is made by the caller's thread, so it lives in the caller's
  namespace; the relay's own thread then enters the target namespace (namespaces are per
  thread, so nothing else moves) and every upstream socket it dials lives there.
- Bytes are relayed as they come, in order, with half-closes passed on (EOF one way shuts
  down writing the other way), so long-lived bidirectional streams (gRPC over HTTP/2)
  work as well as request/response. A connection never buffers more than `BUFFER` bytes
  per direction: a full buffer stops reading from that side (back-pressure).
- `close()` stops the thread and closes every socket it made; it is idempotent.
"""

from __future__ import annotations

import selectors
import socket
import threading
from typing import Callable

BUFFER = 1 << 20
CHUNK = 1 << 16


class _Pair:
    """A client connection and its upstream: `out[s]` holds the bytes waiting to be sent to `s`."""

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.client, self.upstream = client, upstream
        self.peer = {client: upstream, upstream: client}
        self.out = {client: bytearray(), upstream: bytearray()}
        self.eof: set[socket.socket] = set()  # sides that sent us EOF
        self.shut: set[socket.socket] = set()  # sides we have shut down writing to
        self.connecting = True

    def done(self) -> bool:
        return len(self.shut) == 2

    def interest(self, s: socket.socket) -> int:
        mask = 0
        if s not in self.eof and not (s is self.upstream and self.connecting) \
                and len(self.out[self.peer[s]]) < BUFFER:
            mask |= selectors.EVENT_READ
        if self.out[s] or (s is self.upstream and self.connecting):
            mask |= selectors.EVENT_WRITE
        return mask


class Relay:
    """Listen on `listen_host:<free port>` here; dial `target` after `enter()` in the relay's thread."""

    def __init__(self, enter: Callable[[], None], target: tuple[str, int], listen_host: str = "127.0.0.1",
                 start_timeout_s: float = 10.0) -> None:
        self.target = target
        self._listener = socket.create_server((listen_host, 0))
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._wake_r, self._wake_w = socket.socketpair()
        self._stop = False
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, args=(enter,), daemon=True,
                                        name=f"relay-{self.port}-{target[0]}:{target[1]}")
        self._thread.start()
        if not self._started.wait(start_timeout_s) or self._error is not None:
            self.close()
            raise RuntimeError(f"relay to {target} did not start: {self._error}")

    def close(self) -> None:
        self._stop = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(10)
        for s in (self._listener, self._wake_r, self._wake_w):
            s.close()

    def _main(self, enter: Callable[[], None]) -> None:
        try:
            enter()
        except BaseException as err:  # reported by __init__
            self._error = err
            self._started.set()
            return
        self._started.set()
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ, None)
        sel.register(self._wake_r, selectors.EVENT_READ, None)
        pairs: set[_Pair] = set()
        try:
            while not self._stop:
                for key, mask in sel.select():
                    if key.fileobj is self._listener:
                        self._accept(sel, pairs)
                    elif key.data is not None and key.data in pairs:
                        self._event(sel, pairs, key.data, key.fileobj, mask)
        finally:
            for pair in list(pairs):
                self._drop(sel, pairs, pair)
            sel.close()

    def _accept(self, sel: selectors.BaseSelector, pairs: set[_Pair]) -> None:
        try:
            client, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        client.setblocking(False)
        upstream = socket.socket(socket.AF_INET6 if ":" in self.target[0] else socket.AF_INET)
        upstream.setblocking(False)
        for s in (client, upstream):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        upstream.connect_ex(self.target)
        pair = _Pair(client, upstream)
        pairs.add(pair)
        self._update(sel, pair)

    def _event(self, sel: selectors.BaseSelector, pairs: set[_Pair], pair: _Pair, s: socket.socket,
               mask: int) -> None:
        try:
            if s is pair.upstream and pair.connecting and mask & selectors.EVENT_WRITE:
                err = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if err:
                    raise ConnectionRefusedError(err, "relay could not reach the target")
                pair.connecting = False
            if mask & selectors.EVENT_READ:
                data = s.recv(CHUNK)
                if data:
                    pair.out[pair.peer[s]] += data
                else:
                    pair.eof.add(s)
            if pair.out[s] and not pair.connecting:
                sent = s.send(pair.out[s])
                del pair.out[s][:sent]
            for side in (pair.client, pair.upstream):  # pass on a half-close once drained
                if pair.peer[side] in pair.eof and not pair.out[side] and side not in pair.shut:
                    if not (side is pair.upstream and pair.connecting):
                        side.shutdown(socket.SHUT_WR)
                        pair.shut.add(side)
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._drop(sel, pairs, pair)  # reset or refused: the client sees its connection close
            return
        if pair.done():
            self._drop(sel, pairs, pair)
        else:
            self._update(sel, pair)

    @staticmethod
    def _update(sel: selectors.BaseSelector, pair: _Pair) -> None:
        for s in (pair.client, pair.upstream):
            mask = pair.interest(s)
            registered = s in sel.get_map() if s.fileno() >= 0 else False
            if mask and registered:
                sel.modify(s, mask, pair)
            elif mask:
                sel.register(s, mask, pair)
            elif registered:
                sel.unregister(s)

    @staticmethod
    def _drop(sel: selectors.BaseSelector, pairs: set[_Pair], pair: _Pair) -> None:
        pairs.discard(pair)
        for s in (pair.client, pair.upstream):
            if s.fileno() >= 0 and s in sel.get_map():
                sel.unregister(s)
            s.close()
