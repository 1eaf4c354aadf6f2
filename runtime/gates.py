"""Test-only pause points (`proto/testing.proto`), so fault tests reach a phase by an event
instead of by sleeping.

With the hidden flag `--test-gates PREFIX` a node builds `Gates(PREFIX)` and serves
`GatesService`; every request whose id starts with PREFIX stops at each `passage(phase)`
its role goes through until a test opens that gate. Without the flag a role holds no
`Gates` at all, and a passage costs one `is None` check. Invariants: a gate opened before
the request reaches it lets it pass at once; a passage leaves nothing behind once passed.

A request whose id starts with PREFIX + `sigstop-` (`stops_mid_write`) also makes a
prefill node stop its own process with SIGSTOP between the two halves of the window's write:
a writer frozen in the middle of a window, as a stalled host would leave it, until a test
sends SIGCONT.
"""

from __future__ import annotations

import asyncio

from pdserve.proto import testing_pb2, testing_pb2_grpc

SERVICE = testing_pb2.DESCRIPTOR.services_by_name["Gates"].full_name


class Gates:
    def __init__(self, prefix: str) -> None:
        if not prefix:
            raise ValueError("test gates need a non-empty request id prefix")
        self.prefix = prefix
        self._reached: dict[tuple[str, str], asyncio.Event] = {}
        self._opened: dict[tuple[str, str], asyncio.Event] = {}

    def _event(self, table: dict, key: tuple[str, str]) -> asyncio.Event:
        return table.setdefault(key, asyncio.Event())

    async def passage(self, phase: str, request_id: str) -> None:
        """Stop here until the gate (`phase`, `request_id`) is opened, if the id is gated."""
        if not request_id.startswith(self.prefix):
            return
        key = (phase, request_id)
        self._event(self._reached, key).set()
        try:
            await self._event(self._opened, key).wait()
        finally:
            self._reached.pop(key, None)
            self._opened.pop(key, None)

    def stops_mid_write(self, request_id: str) -> bool:
        return request_id.startswith(self.prefix + "sigstop-")

    async def reached(self, phase: str, request_id: str) -> None:
        await self._event(self._reached, (phase, request_id)).wait()

    def open(self, phase: str, request_id: str) -> None:
        self._event(self._opened, (phase, request_id)).set()


class GatesService(testing_pb2_grpc.GatesServicer):
    def __init__(self, gates: Gates) -> None:
        self.gates = gates

    async def Reached(self, request, context):
        await self.gates.reached(request.phase, request.request_id)
        return testing_pb2.GateReply(reached=True)

    async def Open(self, request, context):
        self.gates.open(request.phase, request.request_id)
        return testing_pb2.GateReply()
