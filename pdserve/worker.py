"""A worker node: one engine, one NIXL agent, the Worker service, and for role `both` also
the Generation service.

The engine's KV pool is registered with the agent once at start. Role-specific RPCs go to
the prefill or decode edge; a node without that role answers UNIMPLEMENTED naming its
role. Abort reaches both roles; GetLoad merges the engine's page counts with each role's
counters. With `--etcd`, the node registers itself once it serves (pdserve/membership.py)
and deregisters first when it drains (SIGTERM or the Drain RPC).
"""

from __future__ import annotations

import os
import socket
import uuid

import grpc

from pdserve.server import new_server, serve, wait_idle
from proto import pdserve_pb2, pdserve_pb2_grpc

WORKER = pdserve_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
GENERATION = pdserve_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


def agent_name(role: str) -> str:
    """Unique per process start, so peers never reuse a stale handshake."""
    return f"{role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class WorkerServicer(pdserve_pb2_grpc.WorkerServicer):
    def __init__(self, role: str, model: str, engine, agent, layout, prefill=None, decode=None,
                 model_hash: str = "", stop=None):
        self.role, self.model, self.model_hash = role, model, model_hash
        self.engine, self.agent, self.layout = engine, agent, layout
        self.prefill, self.decode = prefill, decode  # PrefillEdge / DecodeEdge or None
        self.stop = stop  # asyncio.Event that starts the drain (Drain RPC), or None

    async def _lacks(self, rpc: str, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{rpc}: this is a {self.role} node")

    async def PrepareReceive(self, request, context):
        if self.decode is None:
            await self._lacks("PrepareReceive", context)
        return await self.decode.prepare_receive(request, context)

    async def RemoteSend(self, request, context):
        if self.prefill is None:
            await self._lacks("RemoteSend", context)
        return await self.prefill.remote_send(request, context)

    async def StartGeneration(self, request, context):
        if self.decode is None:
            await self._lacks("StartGeneration", context)
        async for msg in self.decode.start_generation(request, context):
            yield msg

    async def Abort(self, request, context):
        found = False
        for edge in (self.prefill, self.decode):
            if edge is not None:
                found = await edge.role.abort(request.request_id,
                                              settled=request.kv_write_settled) or found
        return pdserve_pb2.AbortResponse(found=found)

    async def GetTransferInfo(self, request, context):
        return pdserve_pb2.TransferInfo(
            agent_name=self.agent.name, agent_metadata=self.agent.metadata(),
            layout=pdserve_pb2.KVLayout(**self.layout.to_dict()), role=self.role, model=self.model,
            model_hash=self.model_hash)

    async def DeliverWindow(self, request, context):
        if self.prefill is None:
            await self._lacks("DeliverWindow", context)
        return await self.prefill.deliver_window(request, context)

    async def Drain(self, request, context):
        if self.stop is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this node cannot drain by RPC")
        self.stop.set()  # serve() turns health NOT_SERVING, deregisters, drains, exits
        return pdserve_pb2.DrainResponse(draining=True)

    async def GetLoad(self, request, context):
        free, total = await self.engine.run(lambda e: (e.num_free_pages(), e.num_total_pages()))
        report = pdserve_pb2.LoadReport(role=self.role, free_pages=free, total_pages=total)
        for edge in (self.prefill, self.decode):
            if edge is not None:
                for key, value in edge.role.stats().items():
                    setattr(report, key, getattr(report, key) + value)
        return report


async def run_worker(role: str, prefill_config=None, decode_config=None,
                     metrics_port: int | None = None, membership=None) -> None:
    """Build and serve a `prefill`, `decode` or `both` node until SIGTERM/SIGINT or a Drain
    RPC; with a `metrics_port`, also Prometheus /metrics over HTTP on it; with `membership`
    (a `MembershipConfig`), registered in etcd while it serves."""
    import asyncio

    from engine.async_engine import AsyncEngine
    from pdserve.identity import model_hash
    from kvtransfer.agent import TransferAgent
    from kvtransfer.layout import KVLayout

    config = (prefill_config or decode_config)
    engine_config = config.engine
    engine = AsyncEngine(engine_config)
    kv_cache, page_size, limits = await engine.run(
        lambda e: (e.kv_cache, e.page_size, (e.vocab_size, e.max_model_len)))
    agent = TransferAgent(agent_name(role), kv_cache)
    layout = KVLayout.from_tensor(kv_cache, page_size)

    prefill = decode = None
    if prefill_config is not None:
        from prefill.peers import DecodePeers
        from prefill.role import PrefillRole
        from prefill.servicer import PrefillEdge

        prefill = PrefillEdge(PrefillRole(engine, agent, layout, prefill_config),
                              DecodePeers(agent, layout))
    if decode_config is not None:
        from decode.role import DecodeRole
        from decode.servicer import DecodeEdge

        decode = DecodeEdge(DecodeRole(engine, agent, decode_config), *limits)

    from pdserve.worker_metrics import ObservedColocatedServicer, ObservedWorkerServicer

    server = new_server()
    services = [WORKER]
    stop_event = asyncio.Event()
    servicer = ObservedWorkerServicer(role, engine_config.model_dir, engine, agent, layout,
                                      prefill, decode, model_hash=model_hash(engine_config.model_dir),
                                      stop=stop_event)
    registration = None
    pdserve_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    if role == "both":
        tokenizer = await engine.run(lambda e: e.tokenizer)
        pdserve_pb2_grpc.add_GenerationServicer_to_server(
            ObservedColocatedServicer(engine, tokenizer, engine_config.model_dir, *limits), server)
        services.append(GENERATION)
    http = await _start_metrics(servicer, config.host, metrics_port)

    async def stop() -> None:
        if http is not None:
            await http.cleanup()
        for edge in (prefill, decode):
            if edge is not None:
                edge.role.close()
        engine.shutdown()
        agent.close()

    roles = [edge.role for edge in (prefill, decode) if edge is not None]

    async def register(port: int) -> None:
        nonlocal registration
        if membership is not None and membership.etcd:
            registration = membership.registration(servicer, config.host, port)
            await registration.start()

    async def drain() -> None:  # SIGTERM or Drain: leave discovery, no new work, finish
        if registration is not None:
            await registration.withdraw()
        for r in roles:
            r.draining = True
        await wait_idle(lambda: not any(r.busy() for r in roles), config.drain_timeout_s)

    await serve(server, role=role, host=config.host, port=config.port,
                service_names=services, on_stop=stop, drain=drain, on_start=register,
                stop=stop_event)


async def _start_metrics(servicer: WorkerServicer, host: str, port: int | None):
    if port is None:
        return None
    from pdserve import metrics
    from pdserve.http import metrics_app, start_http
    from pdserve.worker_metrics import worker_refresh

    metrics.NODE.info({"role": servicer.role, "model": servicer.model})
    return await start_http(metrics_app(lambda: worker_refresh(servicer)), host, port,
                            f"{servicer.role} /metrics")


class MembershipConfig:
    """Where a worker registers itself (`--etcd`, `--etcd-prefix`, `--etcd-ttl-s`,
    `--advertise-address`); `etcd` empty: no registration."""

    def __init__(self, etcd: str = "", prefix: str = "", ttl_s: int = 5,
                 advertise_address: str = "") -> None:
        self.etcd, self.prefix, self.ttl_s = etcd, prefix, ttl_s
        self.advertise_address = advertise_address

    def registration(self, servicer: WorkerServicer, host: str, port: int):
        from pdserve.identity import NodeIdentity
        from pdserve.membership import DEFAULT_PREFIX, Registration, WorkerRecord, advertised_address

        layout = servicer.layout
        identity = NodeIdentity(model=servicer.model, model_hash=servicer.model_hash,
                                dtype=layout.dtype, num_layers=layout.num_layers,
                                num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim,
                                page_size=layout.page_size, role=servicer.role)
        address = self.advertise_address or advertised_address(host, port)
        roles = ["prefill", "decode"] if servicer.role == "both" else [servicer.role]
        record = WorkerRecord(address, roles[0], servicer.agent.name, identity)
        return Registration(self.etcd, record, self.prefix or DEFAULT_PREFIX, self.ttl_s)
