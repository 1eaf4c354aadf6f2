"""Decode peers known to this prefill node: NIXL agent added once, layout checked once.

Keyed by the decode agent's name, which is unique per process start: a restarted decode
node has a new name, so a stale entry is never used for it. On a miss the peer's
TransferInfo comes from the RemoteSend request or from GetTransferInfo on its address.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from kvtransfer.layout import KVLayout
from pdserve.server import channel
from proto import pdserve_pb2, pdserve_pb2_grpc


class IncompatiblePeer(Exception):
    """The decode node's KV layout cannot receive this node's KV."""


@dataclass
class DecodePeer:
    agent_name: str
    layout: KVLayout


def layout_from_pb(pb: pdserve_pb2.KVLayout) -> KVLayout:
    return KVLayout.from_dict({f.name: getattr(pb, f.name) for f in pb.DESCRIPTOR.fields})


class DecodePeers:
    def __init__(self, agent, local_layout: KVLayout, timeout_s: float = 10.0) -> None:
        self.agent = agent
        self.local_layout = local_layout
        self.timeout_s = timeout_s
        self._peers: dict[str, DecodePeer] = {}
        self._lock = asyncio.Lock()

    async def get(self, agent_name: str, address: str,
                  info: pdserve_pb2.TransferInfo | None) -> DecodePeer:
        peer = self._peers.get(agent_name)
        if peer is not None:
            return peer
        async with self._lock:  # one handshake per peer, however many requests race
            peer = self._peers.get(agent_name)
            if peer is None:
                if info is None or not info.agent_name:
                    info = await self._fetch(address)
                if info.agent_name != agent_name:
                    raise IncompatiblePeer(f"decode node {address} runs agent {info.agent_name!r}, "
                                           f"not {agent_name!r} (restarted?)")
                layout = layout_from_pb(info.layout)
                problems = self.local_layout.incompatibilities(layout)
                if problems:
                    raise IncompatiblePeer(f"decode node {address} cannot receive this node's KV: "
                                           + "; ".join(problems))
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(None, self.agent.add_remote, info.agent_metadata)
                peer = self._peers[agent_name] = DecodePeer(agent_name, layout)
        return peer

    async def _fetch(self, address: str) -> pdserve_pb2.TransferInfo:
        async with channel(address) as ch:
            stub = pdserve_pb2_grpc.WorkerStub(ch)
            return await stub.GetTransferInfo(pdserve_pb2.TransferInfoRequest(), timeout=self.timeout_s)
