"""Runs a router node: the Generation service over a worker registry kept by discovery
(static HOST:PORT targets, `dns:///NAME:PORT` names re-resolved while it runs, and with
`--etcd` the workers registered in etcd, watched live), with load reports polled in the
background for the load- and prefix-aware policies and selective disaggregation."""

from __future__ import annotations

import asyncio
import logging

from pdserve.runtime.server import new_server, serve
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from pdserve.router.config import RouterConfig
from pdserve.router.discovery import DnsDiscovery
from pdserve.router.dispatch import Dispatcher
from pdserve.router.load import LoadMonitor
from pdserve.router.openai_http import start_router_http
from pdserve.router.policies import make_policy
from pdserve.router.registry import WorkerRegistry
from pdserve.router.service import GenerationService
from pdserve.router.tokenizer import PromptTokenizer

log = logging.getLogger("pdserve.router")
GENERATION = pdserve_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


async def run_router(config: RouterConfig) -> None:
    config.validate()
    options = dict(load_tokens=config.prefix_load_tokens)
    registry = WorkerRegistry([], [], make_policy(config.prefill_policy, **options),
                              make_policy(config.decode_policy, **options),
                              health_interval_s=config.health_interval_s)
    registry.lease_ms = config.lease_ms
    discovery = DnsDiscovery(registry, config.prefill, config.decode)
    await discovery.refresh()  # static targets in; DNS names resolved before the first request
    tasks = [asyncio.create_task(discovery.run())] if discovery.needed else []
    etcd = None
    if config.etcd:
        from pdserve.router.etcd_discovery import EtcdDiscovery

        etcd = EtcdDiscovery(registry, config.etcd, config.etcd_prefix)
        try:  # the pools as etcd has them before the first request; else the watch retries
            revision = await asyncio.wait_for(etcd.refresh(), 10.0)
        except Exception as err:
            log.warning("etcd at %s not readable yet (%s); retrying in the background",
                        config.etcd, err)
            revision = None
        tasks.append(asyncio.create_task(etcd.run(revision)))
    monitor = LoadMonitor(registry, config.load_interval_s, config.load_idle_interval_s)
    tasks.append(asyncio.create_task(monitor.run()))
    dispatcher = Dispatcher(config, registry)
    dispatcher.load_monitor = monitor
    server = new_server()
    tokenizer = PromptTokenizer(config.model, config.served_model_name, config.chat_template,
                                config.tool_call_parser, config.lora_modules)
    pdserve_pb2_grpc.add_GenerationServicer_to_server(GenerationService(dispatcher, tokenizer), server)
    http = await start_router_http(config, dispatcher, tokenizer, registry)

    async def stop() -> None:
        if http is not None:
            await http.cleanup()
        for task in tasks:
            task.cancel()
        if etcd is not None:
            await etcd.close()
        await registry.close()

    await serve(server, role="router", host=config.server.host, port=config.server.port,
                service_names=[GENERATION], on_stop=stop, drain=dispatcher.drain)
