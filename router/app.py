"""Runs a router node: the Generation service over a worker registry kept by discovery
(static HOST:PORT targets, and `dns:///NAME:PORT` names re-resolved while it runs)."""

from __future__ import annotations

import asyncio

from pdserve.server import new_server, serve
from proto import pdserve_pb2, pdserve_pb2_grpc
from router.config import RouterConfig
from router.discovery import DnsDiscovery
from router.dispatch import Dispatcher
from router.openai_http import start_router_http
from router.policies import make_policy
from router.registry import WorkerRegistry
from router.servicer import GenerationServicer
from router.tokenizer import PromptTokenizer

GENERATION = pdserve_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


async def run_router(config: RouterConfig) -> None:
    config.validate()
    registry = WorkerRegistry([], [], make_policy(config.prefill_policy),
                              make_policy(config.decode_policy),
                              health_interval_s=config.health_interval_s)
    discovery = DnsDiscovery(registry, config.prefill, config.decode)
    await discovery.refresh()  # static targets in; DNS names resolved before the first request
    refresher = asyncio.create_task(discovery.run()) if discovery.needed else None
    dispatcher = Dispatcher(config, registry)
    server = new_server()
    tokenizer = PromptTokenizer(config.model)
    pdserve_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(dispatcher, tokenizer), server)
    http = await start_router_http(config, dispatcher, tokenizer, registry)

    async def stop() -> None:
        if http is not None:
            await http.cleanup()
        if refresher is not None:
            refresher.cancel()
        await registry.close()

    await serve(server, role="router", host=config.host, port=config.port,
                service_names=[GENERATION], on_stop=stop, drain=dispatcher.drain)
