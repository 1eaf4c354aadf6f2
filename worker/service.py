"""A worker node's `pdserve.v1.Worker` service, assembled from the roles it serves.

Each RPC is named here and goes to its one owner: RemoteSend, DeliverWindow and FenceWrites
to the prefill role's half (prefill/service.py), PrepareReceive and StartGeneration to the
decode role's half (decode/service.py); Abort, GetTransferInfo, GetLoad and Drain are the
node's own, whatever its roles. An RPC of a role this node lacks answers UNIMPLEMENTED
naming the node's role (a router that calls a prefill node's PrepareReceive hears why).
"""

from __future__ import annotations

import contextlib
import dataclasses

import grpc

from pdserve.decode.service import DecodeService
from pdserve.prefill.service import PrefillService
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from pdserve.runtime.identity import host_id
from pdserve.worker.node import Node


class WorkerService(pdserve_pb2_grpc.WorkerServicer):
    def __init__(self, node: Node) -> None:
        self.node = node
        self.prefill = PrefillService(node.prefill) if node.prefill is not None else None
        self.decode = DecodeService(node.decode) if node.decode is not None else None
        # Who this node is, without its agent metadata (fixed for the process's life):
        # load reports carry it to routers; GetTransferInfo adds the metadata for peers.
        shards = getattr(node.layout, "shards", ())  # a tensor-parallel node's rank pools
        self.identity = pdserve_pb2.TransferInfo(
            agent_name=node.agent.name,
            layout=pdserve_pb2.KVLayout(**(shards[0].layout if shards else node.layout).to_dict()),
            role=node.role, model=node.identity.model, model_hash=node.identity.model_hash,
            host_id=host_id(), total_kv_heads=node.layout.num_kv_heads if shards else 0,
            shards=[pdserve_pb2.KVShard(layout=pdserve_pb2.KVLayout(**s.layout.to_dict()),
                                        head_begin=s.head_begin, rank=s.rank) for s in shards])

    # ---- the prefill role's ------------------------------------------------------------
    async def RemoteSend(self, request, context):
        await self._require(self.prefill, "RemoteSend", context)
        return await self.prefill.RemoteSend(request, context)

    async def DeliverWindow(self, request, context):
        await self._require(self.prefill, "DeliverWindow", context)
        return await self.prefill.DeliverWindow(request, context)

    async def FenceWrites(self, request, context):
        await self._require(self.prefill, "FenceWrites", context)
        return await self.prefill.FenceWrites(request, context)

    # ---- the decode role's -------------------------------------------------------------
    async def PrepareReceive(self, request, context):
        await self._require(self.decode, "PrepareReceive", context)
        return await self.decode.PrepareReceive(request, context)

    async def StartGeneration(self, request, context):
        await self._require(self.decode, "StartGeneration", context)
        # Closed here, not left to the garbage collector: a cancelled stream's cleanup
        # (aborting the request) runs when the call ends.
        async with contextlib.aclosing(self.decode.StartGeneration(request, context)) as stream:
            async for msg in stream:
                yield msg

    # ---- the node's own ----------------------------------------------------------------
    async def Abort(self, request, context):
        found = False
        for role in self.node.roles:
            found = await role.abort(request.request_id, settled=request.kv_write_settled,
                                     lease_id=request.lease_id) or found
        return pdserve_pb2.AbortResponse(found=found)

    async def GetTransferInfo(self, request, context):
        info = pdserve_pb2.TransferInfo()
        info.CopyFrom(self.identity)
        info.agent_metadata = self.node.agent.metadata()
        return info

    async def Drain(self, request, context):
        self.node.stop.set()  # serve() turns health NOT_SERVING, deregisters, drains, exits
        return pdserve_pb2.DrainResponse(draining=True)

    async def GetLoad(self, request, context):
        node = self.node
        free, total = await node.engine.run(lambda e: (e.num_free_pages(), e.num_total_pages()))
        max_lease_ms = node.decode.config.max_lease_ms if node.decode is not None else 0
        return load_report(node.role, [r.load() for r in node.roles], free_pages=free,
                           total_pages=total, max_lease_ms=max_lease_ms, identity=self.identity,
                           **step_fields(node.engine.step_load))

    async def _require(self, service, rpc: str, context) -> None:
        if service is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                                f"{rpc}: this is a {self.node.role} node")


def step_fields(load) -> dict:
    """The engine's StepLoad (engine/step_budget.py) as LoadReport fields, in ms."""
    return dict(num_decoding=load.decodes, prompt_backlog_tokens=load.prompt_backlog_tokens,
                decode_step_ms=load.decode_step_s * 1e3, prompt_token_ms=load.prompt_token_s * 1e3,
                itl_target_ms=load.itl_target_s * 1e3)


def load_report(role: str, loads: list, **node_fields) -> pdserve_pb2.LoadReport:
    """One LoadReport from the roles' loads (`PrefillLoad`, `DecodeLoad`): their fields are
    named as the report's (a name the report lacks is a ValueError here, not a value lost);
    `num_running` is the only field both roles report, and adds up on a `both` node."""
    fields: dict = {}
    for load in loads:
        fields.update(dataclasses.asdict(load))
    fields["num_running"] = sum(load.num_running for load in loads)
    return pdserve_pb2.LoadReport(role=role, **fields, **node_fields)
