"""gRPC server reflection, used the way a generic client uses it (grpcurl, Postman, a client
in another language): it knows a node's address and nothing of pdserve, lists the services,
describes pdserve.v1.Generation, and calls it with messages built from the reflected
descriptors, requests written as JSON and answers printed as JSON. Nothing here uses the
project's generated proto/pdserve_pb2 for the calls: every message class comes from a
descriptor pool that only reflection filled."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
from google.protobuf import descriptor_pool, json_format, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

GENERATION = "pdserve.v1.Generation"


@contextmanager
def reflected(address: str) -> Iterator[tuple[grpc.Channel, ProtoReflectionDescriptorDatabase,
                                              descriptor_pool.DescriptorPool]]:
    """A channel to `address`, its reflection database, and a pool fed only by it (the pool
    asks the node for each file when first looked up, so the channel stays open)."""
    with grpc.insecure_channel(address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        yield channel, database, descriptor_pool.DescriptorPool(database)


def call_json(channel: grpc.Channel, pool: descriptor_pool.DescriptorPool, method: str,
              request_json: str) -> list[dict]:
    """`SERVICE/METHOD` called with a request parsed from JSON; every answer as JSON (one for
    a unary method, each streamed message for a server-streaming one)."""
    service_name, method_name = method.rsplit("/", 1)
    described = pool.FindServiceByName(service_name).methods_by_name[method_name]
    request_class = message_factory.GetMessageClass(described.input_type)
    response_class = message_factory.GetMessageClass(described.output_type)
    assert request_class.DESCRIPTOR.file.pool is pool, "a message class not from reflection"
    request = json_format.Parse(request_json, request_class())
    path = f"/{service_name}/{method_name}"
    kind = channel.unary_stream if described.server_streaming else channel.unary_unary
    stub = kind(path, request_serializer=request_class.SerializeToString,
                response_deserializer=response_class.FromString)
    answers = stub(request, timeout=60)
    answers = answers if described.server_streaming else [answers]
    return [json.loads(json_format.MessageToJson(answer)) for answer in answers]


def test_reflection_lists_the_services_and_describes_generation(colocated):
    with reflected(colocated.address) as (_, database, pool):
        services = set(database.get_services())
        generation = pool.FindServiceByName(GENERATION)
        methods = {m.name: (m.input_type.full_name, m.output_type.full_name,
                            m.client_streaming, m.server_streaming)
                   for m in generation.methods}
    assert {GENERATION, "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection"} <= services
    assert methods == {
        "Generate": ("pdserve.v1.GenerateRequest", "pdserve.v1.GenerateResponse", False, True),
        "Abort": ("pdserve.v1.AbortRequest", "pdserve.v1.AbortResponse", False, False),
        "GetModelInfo": ("pdserve.v1.ModelInfoRequest", "pdserve.v1.ModelInfo", False, False),
    }


def test_get_model_info_through_reflection(colocated):
    with reflected(colocated.address) as (channel, _, pool):
        (info,) = call_json(channel, pool, f"{GENERATION}/GetModelInfo", "{}")
    assert info["role"] == "both"
    assert info["vocabSize"] == 512  # the tiny checkpoint's
    assert info["maxModelLen"] > 0


def test_generate_through_reflection_streams_the_tokens_asked_for(colocated):
    request = """{"prompt": "reflected hello",
                  "sampling": {"max_tokens": 3, "temperature": 0, "ignore_eos": true}}"""
    with reflected(colocated.address) as (channel, _, pool):
        answers = call_json(channel, pool, f"{GENERATION}/Generate", request)
    tokens = [t for answer in answers for t in answer.get("tokenIds", [])]
    assert len(tokens) == 3
    assert [a["finishReason"] for a in answers if a.get("finishReason")] == ["length"]
    assert answers[-1]["usage"]["completionTokens"] == 3, "the stream ends with its usage"
