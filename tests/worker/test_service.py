"""The Worker service of a node, assembled from its roles: each RPC reaches its role's half,
an RPC of a role the node lacks is UNIMPLEMENTED naming the node's role, and GetLoad
reports every field of every role's load. Roles, engine and agent are stand-ins: what is
tested is the assembly, not the roles (tests/prefill, tests/decode)."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import grpc
import pytest

from pdserve.decode.requests import DecodeLoad
from pdserve.engine.step_budget import StepLoad
from pdserve.prefill.requests import PrefillLoad
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from pdserve.worker.node import Node
from pdserve.worker.service import WorkerService, load_report

WORKER_RPCS = [m.name for m in pdserve_pb2.DESCRIPTOR.services_by_name["Worker"].methods]
PREFILL_LOAD = PrefillLoad(num_running=2, remote_sends_total=7, last_kv_window_begin=16,
                           kv_bytes_sent_total=4096)
DECODE_LOAD = DecodeLoad(num_parked=1, num_running=3, requests_total=9, prefix_hit_tokens_total=40,
                         leases_expired_total=2, num_quarantined=1, late_writes_total=1,
                         fenced_writers=["prefill-a"], fenced_pages=4)


class Aborted(Exception):
    def __init__(self, code, details):
        super().__init__(details)
        self.code, self.details = code, details


class Context:
    async def abort(self, code, details):
        raise Aborted(code, details)

    def time_remaining(self):
        return None


class Engine:
    step_load = StepLoad(decodes=3, prompt_backlog_tokens=700, decode_step_s=0.05,
                         prompt_token_s=0.004, itl_target_s=0.125)

    async def run(self, fn):
        return fn(self)

    def num_free_pages(self):
        return 48

    def num_total_pages(self):
        return 64


class Role:
    def __init__(self, load, **attrs):
        self._load, self.aborted = load, []
        self.__dict__.update(attrs)

    def load(self):
        return self._load

    async def abort(self, request_id, settled, lease_id=""):
        self.aborted.append(request_id)
        return True


def node_of(role: str) -> Node:
    prefill = Role(PREFILL_LOAD) if role in ("prefill", "both") else None
    decode = Role(DECODE_LOAD, config=SimpleNamespace(max_lease_ms=5000)) \
        if role in ("decode", "both") else None
    agent = SimpleNamespace(name=f"{role}-agent", metadata=lambda: b"meta")
    layout = SimpleNamespace(to_dict=lambda: {"dtype": "float32", "page_size": 8})
    identity = SimpleNamespace(model="tiny", model_hash="abc")
    return Node(role, Engine(), agent, layout, identity, prefill, decode)


def test_every_worker_rpc_is_named_by_the_service():
    inherited = [rpc for rpc in WORKER_RPCS
                 if getattr(WorkerService, rpc) is getattr(pdserve_pb2_grpc.WorkerServicer, rpc)]
    assert not inherited, f"left to the generated stub (UNIMPLEMENTED without a reason): {inherited}"


@pytest.mark.parametrize("role,rpc", [("prefill", "PrepareReceive"), ("decode", "RemoteSend"),
                                      ("decode", "DeliverWindow"), ("decode", "FenceWrites")])
def test_an_rpc_of_a_role_the_node_lacks_is_unimplemented_naming_the_nodes_role(role, rpc):
    service = WorkerService(node_of(role))
    with pytest.raises(Aborted) as caught:
        asyncio.run(getattr(service, rpc)(None, Context()))
    assert caught.value.code == grpc.StatusCode.UNIMPLEMENTED
    assert caught.value.details == f"{rpc}: this is a {role} node"


def test_a_prefill_nodes_start_generation_stream_is_unimplemented():
    service = WorkerService(node_of("prefill"))

    async def first():
        return await service.StartGeneration(None, Context()).__anext__()

    with pytest.raises(Aborted) as caught:
        asyncio.run(first())
    assert caught.value.code == grpc.StatusCode.UNIMPLEMENTED


def test_a_start_generation_stream_left_early_closes_the_decode_stream_at_once():
    service = WorkerService(node_of("decode"))
    closed = []

    async def decode_stream(request, context):
        try:
            for i in range(3):
                yield i
        finally:
            closed.append(True)

    service.decode = SimpleNamespace(StartGeneration=decode_stream)

    async def leave_after_one():
        stream = service.StartGeneration(None, Context())
        assert await stream.__anext__() == 0
        await stream.aclose()
        return list(closed)  # before the loop could finalize a dropped generator

    assert asyncio.run(leave_after_one()) == [True]


def test_abort_reaches_every_role_of_a_both_node():
    node = node_of("both")
    found = asyncio.run(WorkerService(node).Abort(pdserve_pb2.AbortRequest(request_id="r1"),
                                                  Context()))
    assert found.found and node.prefill.aborted == node.decode.aborted == ["r1"]


def test_the_load_of_a_both_node_carries_every_field_of_both_roles():
    report = asyncio.run(WorkerService(node_of("both")).GetLoad(pdserve_pb2.LoadRequest(),
                                                                Context()))
    for load in (PREFILL_LOAD, DECODE_LOAD):
        for name, value in dataclasses.asdict(load).items():
            if name != "num_running":
                assert getattr(report, name) == value, name
    assert report.num_running == PREFILL_LOAD.num_running + DECODE_LOAD.num_running
    assert (report.role, report.free_pages, report.total_pages, report.max_lease_ms) == \
        ("both", 48, 64, 5000)
    assert report.identity.agent_name == "both-agent" and report.identity.model_hash == "abc"
    assert (report.num_decoding, report.prompt_backlog_tokens) == (3, 700)
    assert [round(v, 3) for v in (report.decode_step_ms, report.prompt_token_ms,
                                  report.itl_target_ms)] == [50, 4, 125]


def test_a_load_field_the_report_lacks_is_an_error_not_a_value_lost():
    @dataclasses.dataclass
    class Renamed:
        num_running: int
        remote_sends: int  # LoadReport calls it remote_sends_total

    with pytest.raises(ValueError, match="remote_sends"):
        load_report("prefill", [Renamed(1, 2)])
