"""Decode peers known to this prefill node: NIXL agent added once, layout checked once.

Keyed by the decode agent's name, which is unique per process start: a restarted decode
node has a new name, so a stale entry is never used for it. On a miss the peer's transfer
identity comes with the request (`PeerRef.info`) or from `GetTransferInfo` on its address.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from functools import partial

import grpc

from pdserve.kvtransfer.layout import KVLayout
from pdserve.kvtransfer.regions import memory_kind_of, regions_of
from pdserve.kvtransfer.shards import KVShard, KVShards
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from pdserve.runtime.errors import PeerUnavailable, Refused
from pdserve.runtime.server import channel


class IncompatiblePeer(Refused):
    """The decode node's KV layout cannot receive this node's KV (or it is not the node
    the request named)."""


@dataclass(frozen=True)
class PeerInfo:
    """A decode node's transfer identity: its NIXL agent and where its KV pool lives."""

    agent_name: str
    agent_metadata: bytes
    layout: KVLayout | KVShards  # KVShards: a tensor-parallel node, one pool per rank
    host_id: str = ""  # runtime/identity.py host_id(); "" when unknown

    @classmethod
    def from_pb(cls, info: pdserve_pb2.TransferInfo) -> "PeerInfo":
        def layout_of(pb):
            return KVLayout.from_dict({f.name: getattr(pb, f.name) for f in pb.DESCRIPTOR.fields})

        layout = layout_of(info.layout)
        if info.shards:
            layout = KVShards(tuple(KVShard(layout_of(s.layout), s.head_begin, s.rank) for s in info.shards),
                              info.total_kv_heads)
        return cls(info.agent_name, info.agent_metadata, layout, info.host_id)


@dataclass(frozen=True)
class PeerRef:
    """How a request names its decode node: agent name, Worker address, and optionally the
    identity itself (saves the GetTransferInfo round trip)."""

    agent_name: str
    address: str
    info: PeerInfo | None = None


@dataclass(frozen=True)
class DecodePeer:
    agent_name: str
    layout: KVLayout | KVShards
    host_id: str = ""


class DecodePeers:
    def __init__(self, agent, local_layout: KVLayout, timeout_s: float = 10.0) -> None:
        self.agent = agent
        self.local_layout = local_layout
        self.timeout_s = timeout_s
        self._peers: dict[str, DecodePeer] = {}
        self._lock = asyncio.Lock()

    async def get(self, ref: PeerRef) -> DecodePeer:
        peer = self._peers.get(ref.agent_name)
        if peer is not None:
            return peer
        async with self._lock:  # one handshake per peer, however many requests race
            peer = self._peers.get(ref.agent_name)
            if peer is None:
                info = ref.info or await self._fetch(ref.address)
                if info.agent_name != ref.agent_name:
                    raise IncompatiblePeer(f"decode node {ref.address} runs agent "
                                           f"{info.agent_name!r}, not {ref.agent_name!r} "
                                           "(restarted?)")
                problems = self.local_layout.incompatibilities(info.layout)
                if problems:
                    raise IncompatiblePeer(f"decode node {ref.address} cannot receive this "
                                           "node's KV: " + "; ".join(problems))
                loop = asyncio.get_running_loop()
                # the peer's regions give each destination descriptor its own device id, and
                # its memory kind the descriptors' (a GPU pool may write into a CPU one)
                add = partial(self.agent.add_remote, info.agent_metadata, regions=regions_of(info.layout),
                              memory_kind=memory_kind_of(info.layout))
                await loop.run_in_executor(None, add)
                peer = self._peers[ref.agent_name] = DecodePeer(ref.agent_name, info.layout, info.host_id)
        return peer

    async def _fetch(self, address: str) -> PeerInfo:
        try:
            async with channel(address) as ch:
                info = await pdserve_pb2_grpc.WorkerStub(ch).GetTransferInfo(
                    pdserve_pb2.TransferInfoRequest(), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as err:
            raise PeerUnavailable(f"GetTransferInfo on {address}: {err.details()}") from None
        return PeerInfo.from_pb(info)
