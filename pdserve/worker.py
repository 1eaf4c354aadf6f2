"""A worker node: one engine, one NIXL agent, the roles it serves, and their gRPC services.

`pdserve prefill`, `decode` and `serve` (role `both`) all run `run_worker`. The engine's
KV pool is registered with the agent once at start. The Worker service of a node is
assembled from the services of its roles (`worker_servicer`): RemoteSend and DeliverWindow
are the prefill role's, PrepareReceive and StartGeneration the decode role's, Abort,
GetTransferInfo, GetLoad and Drain the node's own (`NodeService`); an RPC of a role the
node lacks answers UNIMPLEMENTED naming its role. A `both` node also serves Generation
itself (pdserve/colocated.py). With `--etcd` the node registers once it serves and
deregisters first when it drains (SIGTERM or the Drain RPC).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from dataclasses import dataclass, field

import grpc

from pdserve.decode.config import DecodeConfig
from pdserve.engine import EngineConfig
from pdserve.prefill.config import PrefillConfig
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from pdserve.runtime import metrics
from pdserve.runtime.identity import host_id
from pdserve.runtime.membership import MembershipConfig
from pdserve.runtime.server import ServerConfig

WORKER = pdserve_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
GENERATION = pdserve_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
WORKER_RPCS = tuple(m.name for m in pdserve_pb2.DESCRIPTOR.services_by_name["Worker"].methods)
ROLES = {"prefill": ("prefill",), "decode": ("decode",), "both": ("prefill", "decode")}
DEFAULT_PORTS = {"prefill": 50061, "decode": 50062, "both": 50051}


@dataclass
class WorkerConfig:
    role: str  # "prefill" | "decode" | "both"
    engine: EngineConfig
    server: ServerConfig = field(default_factory=ServerConfig)
    prefill: PrefillConfig = field(default_factory=PrefillConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    membership: MembershipConfig = field(default_factory=MembershipConfig)
    metrics_port: int | None = None  # Prometheus /metrics over HTTP; None: none
    test_gates: str = ""  # request id prefix stopped at test gates (runtime/gates.py)


def agent_name(role: str) -> str:
    """Unique per process start, so peers never reuse a stale handshake."""
    return f"{role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class Node:
    """What one worker process holds: engine, agent, KV layout, identity and roles."""

    def __init__(self, role: str, engine, agent, layout, identity, prefill=None,
                 decode=None) -> None:
        self.role, self.engine, self.agent, self.layout = role, engine, agent, layout
        self.identity = identity  # runtime.identity.NodeIdentity
        self.prefill, self.decode = prefill, decode  # PrefillRole / DecodeRole or None
        self.roles = [r for r in (prefill, decode) if r is not None]
        self.stop = asyncio.Event()  # set by the Drain RPC (or a signal): drain, then exit


class NodeService:
    """The Worker RPCs of the node itself, whatever its roles."""

    def __init__(self, node: Node) -> None:
        self.node = node
        # Who this node is, without its agent metadata (fixed for the process's life):
        # load reports carry it to routers; GetTransferInfo adds the metadata for peers.
        self.identity = pdserve_pb2.TransferInfo(
            agent_name=node.agent.name, layout=pdserve_pb2.KVLayout(**node.layout.to_dict()),
            role=node.role, model=node.identity.model, model_hash=node.identity.model_hash,
            host_id=host_id())

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
        n = self.node
        free, total = await n.engine.run(lambda e: (e.num_free_pages(), e.num_total_pages()))
        report = pdserve_pb2.LoadReport(role=n.role, free_pages=free, total_pages=total,
                                        identity=self.identity)
        if n.prefill is not None:
            p = n.prefill.load()
            report.num_running += p.num_running
            report.remote_sends_total = p.remote_sends_total
            report.last_kv_window_begin = p.last_kv_window_begin
            report.kv_bytes_sent_total = p.kv_bytes_sent_total
        if n.decode is not None:
            d = n.decode.load()
            report.num_running += d.num_running
            report.num_parked = d.num_parked
            report.requests_total = d.requests_total
            report.prefix_hit_tokens_total = d.prefix_hit_tokens_total
            report.leases_expired_total = d.leases_expired_total
            report.num_quarantined = d.num_quarantined
            report.late_writes_total = d.late_writes_total
            report.fenced_writers.extend(d.fenced_writers)
            report.fenced_pages = d.fenced_pages
            report.max_lease_ms = n.decode.config.max_lease_ms
        return report


def worker_servicer(role: str, *services) -> pdserve_pb2_grpc.WorkerServicer:
    """The Worker service of a node: each RPC is the method of the first of `services`
    that has it; an RPC none has answers UNIMPLEMENTED naming this node's role."""
    servicer = pdserve_pb2_grpc.WorkerServicer()
    for rpc in WORKER_RPCS:
        owner = next((s for s in services if hasattr(s, rpc)), None)
        setattr(servicer, rpc, getattr(owner, rpc) if owner else _lacking(rpc, role))
    return servicer


def _lacking(rpc: str, role: str):
    async def unimplemented(request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{rpc}: this is a {role} node")
    return unimplemented


async def sample_gauges(node: Node) -> None:
    """This node's gauges, sampled when /metrics is scraped (an idle node does no work)."""
    free, total, waiting, running = await node.engine.run(lambda e: (
        e.num_free_pages(), e.num_total_pages(), len(e.scheduler.waiting),
        len(e.scheduler.running)))
    metrics.set_pages(node.role, free, total)
    depth = metrics.QUEUE_DEPTH
    depth.labels(role=node.role, queue="waiting").set(waiting)
    depth.labels(role=node.role, queue="running").set(running)
    if node.decode is not None:
        load = node.decode.load()
        depth.labels(role=node.role, queue="parked").set(load.num_parked)
        depth.labels(role=node.role, queue="page_line").set(len(node.decode.line))
        metrics.LEASES_EXPIRED.set(load.leases_expired_total)
    if node.prefill is not None:
        depth.labels(role=node.role, queue="remote_send").set(node.prefill.load().num_running)


async def run_worker(config: WorkerConfig) -> None:
    """Build and serve a `prefill`, `decode` or `both` node until SIGTERM/SIGINT or a Drain
    RPC; with a metrics port, also Prometheus /metrics over HTTP on it; with `--etcd`,
    registered in etcd while it serves."""
    from pdserve.decode.role import DecodeRole
    from pdserve.decode.service import DecodeService
    from pdserve.engine.async_engine import AsyncEngine
    from pdserve.kvtransfer.agent import TransferAgent
    from pdserve.kvtransfer.layout import KVLayout
    from pdserve.models.catalogue import served_name
    from pdserve.prefill.role import PrefillRole
    from pdserve.prefill.service import PrefillService
    from pdserve.runtime.gates import Gates, GatesService
    from pdserve.runtime.identity import NodeIdentity, model_hash
    from pdserve.runtime.server import new_server, serve, wait_idle

    role = config.role
    engine = AsyncEngine(config.engine)
    kv_cache, page_size, vocab_size, max_model_len = await engine.run(
        lambda e: (e.kv_cache, e.page_size, e.vocab_size, e.max_model_len))
    sizing = await engine.run(lambda e: e.kv_cache_sizing)
    logging.getLogger("pdserve.worker").info(
        "KV cache: %d tokens of %s in %s (%d pages of %d, %d MiB; sized by %s)",
        kv_cache.shape[0] * page_size, served_name(config.engine.model_dir), config.engine.dtype,
        kv_cache.shape[0], page_size, kv_cache.numel() * kv_cache.element_size() >> 20, sizing)
    # A decode node receives: over TCP (another host) each write's bytes land only as its
    # UCX worker progresses, so NIXL's own thread (asleep in poll() between events: 1.3% of a
    # core idle) moves them at the link's rate, where the agent's 10 ms poll capped a link
    # near 3 Gbit/s. Nodes that write keep driving their writes themselves.
    agent = TransferAgent(agent_name(role), kv_cache, progress_thread=role == "decode")
    layout = KVLayout.from_tensor(kv_cache, page_size)
    identity = NodeIdentity(
        model=served_name(config.engine.model_dir), model_hash=model_hash(config.engine.model_dir),
        dtype=layout.dtype, num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim, page_size=layout.page_size, role=role)
    gates = Gates(config.test_gates) if config.test_gates else None
    prefill = decode = None
    services: list = []
    if "prefill" in ROLES[role]:
        prefill = PrefillRole(engine, agent, layout, config.prefill, gates)
        services.append(PrefillService(prefill))
    if "decode" in ROLES[role]:
        decode = DecodeRole(engine, agent, config.decode, vocab_size, max_model_len, gates,
                            layout.page_size)
        services.append(DecodeService(decode))
    node = Node(role, engine, agent, layout, identity, prefill, decode)

    server = new_server()
    names = [WORKER]
    pdserve_pb2_grpc.add_WorkerServicer_to_server(
        worker_servicer(role, NodeService(node), *services), server)
    if role == "both":
        from pdserve.colocated import ColocatedService

        pdserve_pb2_grpc.add_GenerationServicer_to_server(
            ColocatedService(decode, config.engine.model_dir), server)
        names.append(GENERATION)
    if gates is not None:
        from pdserve.proto import testing_pb2_grpc
        from pdserve.runtime.gates import SERVICE as GATES

        testing_pb2_grpc.add_GatesServicer_to_server(GatesService(gates), server)
        names.append(GATES)
    http = await _start_metrics(node, config)
    registration = None

    async def register(port: int) -> None:
        nonlocal registration
        if config.membership.etcd:
            from pdserve.runtime.membership import WorkerRecord, advertised_address

            address = config.membership.advertise_address or \
                advertised_address(config.server.host, port)
            record = WorkerRecord(address, ROLES[role][0], agent.name, identity)
            registration = config.membership.registration(record)
            await registration.start()

    async def drain() -> None:  # SIGTERM or Drain: no new work, leave discovery, finish
        for r in node.roles:
            r.draining = True
        if registration is not None:
            await registration.withdraw()
        await wait_idle(lambda: not any(r.busy() for r in node.roles),
                        config.server.drain_timeout_s)

    async def stop() -> None:
        if http is not None:
            await http.cleanup()
        for r in node.roles:
            r.close()
        engine.shutdown()
        agent.close()

    await serve(server, role=role, host=config.server.host, port=config.server.port,
                service_names=names, on_stop=stop, drain=drain, on_start=register,
                stop=node.stop)


async def _start_metrics(node: Node, config: WorkerConfig):
    if config.metrics_port is None:
        return None
    from pdserve.runtime.http import metrics_app, start_http

    metrics.NODE.info({"role": node.role, "model": node.identity.model})
    return await start_http(metrics_app(lambda: sample_gauges(node)), config.server.host,
                            config.metrics_port, f"{node.role} /metrics")
