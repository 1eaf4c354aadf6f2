"""Runs a worker node: one engine, one NIXL agent, the roles it serves and their gRPC
services, until SIGTERM/SIGINT or a Drain RPC.

`pdserve prefill`, `decode` and `serve` (role `both`) all run `run_worker`. Before it
serves, a CPU node builds every C kernel (`engine.native.build_all`) and every node runs
one warm-up request (`engine.warm_up`), so the first request pays no compile; a CPU node
whose kernels fell back to torch says so in a warning, its ready line and
`pdserve_c_kernels`. The engine's KV pool is registered with the agent once at start.
The node serves its Worker service (worker/service.py); a `both` node also serves
Generation itself (worker/colocated.py). With a metrics port it serves Prometheus /metrics
over HTTP, its gauges sampled at each scrape (`sample_gauges`). With `--etcd` the node
registers once it serves and deregisters first when it drains (SIGTERM or the Drain RPC).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from dataclasses import replace

from pdserve.decode.role import DecodeRole
from pdserve.engine import native
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.warm_up import warm_up
from pdserve.kvtransfer.agent import TransferAgent
from pdserve.kvtransfer.layout import KVLayout
from pdserve.kvtransfer.shards import KVShard, KVShards
from pdserve.kvtransfer.net_devices import bind_to_host
from pdserve.models.catalogue import served_name
from pdserve.prefill.role import PrefillRole
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from pdserve.runtime import metrics
from pdserve.runtime.gates import Gates
from pdserve.runtime.devices import default_device
from pdserve.runtime.identity import NodeIdentity, model_hash, ucx_moves_gpu_memory
from pdserve.runtime.server import new_server, serve, wait_idle
from pdserve.worker.config import ROLES, WorkerConfig
from pdserve.worker.node import Node
from pdserve.worker.service import WorkerService

log = logging.getLogger("pdserve.worker")
WORKER = pdserve_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
GENERATION = pdserve_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


def agent_name(role: str) -> str:
    """Unique per process start, so peers never reuse a stale handshake."""
    return f"{role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def model_name(config: WorkerConfig) -> str:
    """What clients and peers call the model: --served-model-name, else `served_name`."""
    return config.served_model_name[0] if config.served_model_name else served_name(config.engine.model_dir)


async def build_node(config: WorkerConfig, gates: Gates | None = None) -> Node:
    """The engine (its KV pool allocated), the agent that registers the pool, and the
    roles of `config.role` over both."""
    role = config.role
    on_cpu = config.engine.device.split(":")[0] == "cpu"
    kernels = await asyncio.to_thread(native.build_all) if on_cpu else None  # before any request
    if kernels is not None and kernels.state != "c":
        log.warning("%s", kernels.describe())
    if on_cpu and default_device() == "cuda":
        log.warning("this machine has a GPU torch can use, and this node runs on the CPU: pass --device cuda "
                    "(`pdserve up` picks it by itself)")
    metrics.set_c_kernels(kernels.state if kernels else "unused", kernels.reason if kernels else "")
    # A prefill node never decodes: CUDA graphs of decode steps would only hold GPU memory.
    engine = AsyncEngine(replace(config.engine, cuda_graphs=False) if role == "prefill" else config.engine)
    await engine.run(warm_up)
    pools, head_begins, page_size, vocab_size, max_model_len, sizing = await engine.run(
        lambda e: (e.kv_pools, e.kv_head_begins, e.page_size, e.vocab_size, e.max_model_len, e.kv_cache_sizing))
    kv_cache = pools[0]
    log.info("KV cache: %d tokens of %s in %s (%d pages of %d, %d MiB%s; sized by %s)",
             kv_cache.shape[0] * page_size, model_name(config),
             config.engine.dtype, kv_cache.shape[0], page_size,
             sum(p.numel() * p.element_size() for p in pools) >> 20,
             f" over {len(pools)} tensor-parallel ranks" if len(pools) > 1 else "", sizing)
    bind_to_host(config.server.host)  # UCX listens only where the node's ports do
    if not on_cpu and not ucx_moves_gpu_memory():
        log.warning("UCX_TLS=%s leaves out cuda_copy: UCX cannot move this node's KV pool in GPU memory, "
                    "and every KV write will fail; add cuda_copy (and cuda_ipc)", os.environ["UCX_TLS"])
    layout = KVLayout.from_tensor(kv_cache, page_size)
    if len(pools) > 1:  # every rank's pool, each with its heads, under this node's one agent
        layout = KVShards(tuple(KVShard(KVLayout.from_tensor(p, page_size), b, r)
                                for r, (p, b) in enumerate(zip(pools, head_begins))),
                          max(b + p.shape[-2] for p, b in zip(pools, head_begins)))
    # A decode node receives: over TCP (another host) each write's bytes land only as its
    # UCX worker progresses, so NIXL's own thread (asleep in poll() between events and its
    # periodic wake-ups, kvtransfer/agent.py) moves them at the link's rate, where the
    # agent's 10 ms poll capped a link near 3 Gbit/s. Nodes that write drive their writes,
    # and each send wakes their poller first, so while idle it polls only twice a second.
    agent = TransferAgent(agent_name(role), layout.regions() if len(pools) > 1 else kv_cache,
                          progress_thread=role == "decode", idle_poll_interval_s=0.5)
    identity = NodeIdentity(
        model=model_name(config), model_hash=model_hash(config.engine.model_dir, config.engine.lora_modules),
        dtype=layout.dtype, num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim, page_size=layout.page_size, role=role)
    prefill = decode = None
    if "prefill" in ROLES[role]:
        prefill = PrefillRole(engine, agent, layout, config.prefill, gates)
    if "decode" in ROLES[role]:
        decode = DecodeRole(engine, agent, config.decode, vocab_size, max_model_len, gates,
                            layout.page_size)
    node = Node(role, engine, agent, layout, identity, prefill, decode)
    node.kernels = kernels
    return node


async def run_worker(config: WorkerConfig) -> None:
    """Build and serve a `prefill`, `decode` or `both` node until SIGTERM/SIGINT or a Drain
    RPC; with a metrics port, also Prometheus /metrics over HTTP on it; with `--etcd`,
    registered in etcd while it serves."""
    gates = Gates(config.test_gates) if config.test_gates else None
    node = await build_node(config, gates)
    server = new_server()
    names = [WORKER]
    pdserve_pb2_grpc.add_WorkerServicer_to_server(WorkerService(node), server)
    colocated = None
    if node.role == "both":
        from pdserve.worker.colocated import ColocatedService

        colocated = ColocatedService(node.decode, config.engine.model_dir, config.served_model_name,
                                     config.chat_template, config.tool_call_parser, config.engine.lora_modules)
        pdserve_pb2_grpc.add_GenerationServicer_to_server(colocated, server)
        names.append(GENERATION)
    if gates is not None:
        from pdserve.proto import testing_pb2_grpc
        from pdserve.runtime.gates import SERVICE as GATES, GatesService

        testing_pb2_grpc.add_GatesServicer_to_server(GatesService(gates), server)
        names.append(GATES)
    http = await _start_metrics(node, config)
    openai = None  # a `both` node's OpenAI API (--http-port)
    if colocated is not None and config.http_port is not None:
        from pdserve.worker.colocated import start_openai_http

        openai = await start_openai_http(colocated, config.server.host, config.http_port,
                                         lambda: sample_gauges(node))
    registration = None

    async def register(port: int) -> None:
        nonlocal registration
        if config.membership.etcd:
            from pdserve.runtime.membership import WorkerRecord, advertised_address

            address = config.membership.advertise_address or \
                advertised_address(config.server.host, port)
            record = WorkerRecord(address, ROLES[node.role][0], node.agent.name, node.identity)
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
        for runner in (http, openai):
            if runner is not None:
                await runner.cleanup()
        for r in node.roles:
            r.close()
        node.engine.shutdown()
        node.agent.close()

    await serve(server, role=node.role, host=config.server.host, port=config.server.port,
                service_names=names, on_stop=stop, drain=drain, on_start=register,
                stop=node.stop, note=node.kernels.describe() if node.kernels else "")


async def sample_gauges(node: Node) -> None:
    """This node's gauges, sampled when /metrics is scraped (an idle node does no work)."""
    free, total, waiting, running, preempted = await node.engine.run(_pages_and_queues)
    metrics.set_pages(node.role, free, total)
    metrics.PREEMPTIONS.labels(role=node.role).set(preempted)
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


def _pages_and_queues(engine) -> tuple[int, int, int, int, int]:
    """On the engine thread: free and total KV pages, sequences waiting and running, and
    preemptions since start. These should come from an engine accessor, not the scheduler."""
    s = engine.scheduler
    return engine.num_free_pages(), engine.num_total_pages(), s.num_waiting(), len(s.running), s.num_preemptions


async def _start_metrics(node: Node, config: WorkerConfig):
    if config.metrics_port is None:
        return None
    from pdserve.runtime.http import metrics_app, start_http

    metrics.NODE.info({"role": node.role, "model": node.identity.model})
    return await start_http(metrics_app(lambda: sample_gauges(node)), config.server.host,
                            config.metrics_port, f"{node.role} /metrics")
