"""Runs a router node: the Generation service over a static worker registry."""

from __future__ import annotations

from pdserve.server import new_server, serve
from proto import pdserve_pb2, pdserve_pb2_grpc
from router.config import RouterConfig
from router.dispatch import Dispatcher
from router.policies import make_policy
from router.registry import WorkerRegistry
from router.servicer import GenerationServicer
from router.tokenizer import PromptTokenizer

GENERATION = pdserve_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


async def run_router(config: RouterConfig) -> None:
    config.validate()
    registry = WorkerRegistry(config.prefill, config.decode,
                              make_policy(config.prefill_policy), make_policy(config.decode_policy))
    dispatcher = Dispatcher(config, registry)
    server = new_server()
    pdserve_pb2_grpc.add_GenerationServicer_to_server(
        GenerationServicer(dispatcher, PromptTokenizer(config.model)), server)
    await serve(server, role="router", host=config.host, port=config.port,
                service_names=[GENERATION], on_stop=registry.close)
