"""The auth interceptor on a real in-process grpc.aio server (`runtime.server.new_server`),
called over real channels: the API key on Generation, role tokens on Worker, certificate
names under mutual TLS, for unary and server-streaming RPCs alike; a refused call never
reaches the servicer. Health and the test gates stay open."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc, testing_pb2, testing_pb2_grpc
from pdserve.runtime import auth, cluster_key, tls
from pdserve.runtime.bearer import bearer_metadata
from pdserve.runtime.cluster_key import ClusterKey
from pdserve.runtime.gates import Gates, GatesService
from pdserve.runtime.server import channel, new_server
from tests.certs import CA

SECRET = b"0123456789abcdef-cluster"
KEY = ClusterKey(SECRET)
API_KEY = "sk-test-key-123"
UNAUTHENTICATED, DENIED = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED


class Worker(pdserve_pb2_grpc.WorkerServicer):
    """Records which RPCs ran; StartGeneration streams two messages."""

    def __init__(self) -> None:
        self.ran: list[str] = []

    async def PrepareReceive(self, request, context):
        self.ran.append("PrepareReceive")
        return pdserve_pb2.PrepareReceiveResponse()

    async def StartGeneration(self, request, context):
        self.ran.append("StartGeneration")
        for i in range(2):
            yield pdserve_pb2.GenerateResponse(request_id=request.request_id, token_ids=[i])

    async def Abort(self, request, context):
        self.ran.append("Abort")
        return pdserve_pb2.AbortResponse(found=True)

    async def GetTransferInfo(self, request, context):
        self.ran.append("GetTransferInfo")
        return pdserve_pb2.TransferInfo(agent_name="a", agent_metadata=b"secret pages")

    async def GetLoad(self, request, context):
        self.ran.append("GetLoad")
        return pdserve_pb2.LoadReport(role="decode")

    async def Drain(self, request, context):
        self.ran.append("Drain")
        return pdserve_pb2.DrainResponse(draining=True)


class Generation(pdserve_pb2_grpc.GenerationServicer):
    async def Generate(self, request, context):
        for word in ("hello", " world"):
            yield pdserve_pb2.GenerateResponse(text=word)

    async def GetModelInfo(self, request, context):
        return pdserve_pb2.ModelInfo(model="tiny")


@pytest.fixture(autouse=True)
def process_settings(monkeypatch):
    """Each test sets the process-wide settings it needs; all are restored after it."""
    monkeypatch.setattr(auth, "_settings", auth.Settings())
    monkeypatch.setattr(cluster_key, "_key", ClusterKey(None))
    monkeypatch.setattr(tls, "_config", tls.TLSConfig())


class Node:
    """A server with the fake Worker, Generation, health and gates services."""

    def __init__(self, credentials=None) -> None:
        self.worker = Worker()
        self.server = new_server()
        pdserve_pb2_grpc.add_WorkerServicer_to_server(self.worker, self.server)
        pdserve_pb2_grpc.add_GenerationServicer_to_server(Generation(), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), self.server)
        testing_pb2_grpc.add_GatesServicer_to_server(GatesService(Gates("t-")), self.server)
        self.credentials = credentials

    async def __aenter__(self) -> str:
        address = "127.0.0.1:0"
        port = self.server.add_secure_port(address, self.credentials) if self.credentials \
            else self.server.add_insecure_port(address)
        await self.server.start()
        return f"127.0.0.1:{port}"

    async def __aexit__(self, *exc) -> None:
        await self.server.stop(None)


async def outcome(call):
    """A unary call's reply, or every message of a stream."""
    return [m async for m in call] if hasattr(call, "__aiter__") else await call


async def refusal(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await outcome(call)
    return err.value


def worker_call(ch, rpc: str, metadata=None):
    stub = pdserve_pb2_grpc.WorkerStub(ch)
    request = {"PrepareReceive": pdserve_pb2.PrepareReceiveRequest(request_id="r"),
               "StartGeneration": pdserve_pb2.StartGenerationRequest(request_id="r"),
               "Abort": pdserve_pb2.AbortRequest(request_id="r"),
               "GetTransferInfo": pdserve_pb2.TransferInfoRequest(),
               "GetLoad": pdserve_pb2.LoadRequest(),
               "Drain": pdserve_pb2.DrainRequest()}[rpc]
    return getattr(stub, rpc)(request, metadata=metadata, timeout=10)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_every_worker_rpc_in_the_proto_names_the_roles_that_may_call_it():
    rpcs = {m.name for m in pdserve_pb2.DESCRIPTOR.services_by_name["Worker"].methods}
    assert rpcs <= set(auth.WORKER_RPC_ROLES), rpcs - set(auth.WORKER_RPC_ROLES)
    assert auth.WORKER_RPC_ROLES["Drain"] == auth.WORKER_RPC_ROLES["Abort"] == ("router",)
    assert auth.WORKER_RPC_ROLES["GetTransferInfo"] == ("worker",)


def test_without_any_key_every_call_is_admitted_as_before():
    async def go():
        node = Node()
        async with node as address, grpc.aio.insecure_channel(address) as ch:
            for rpc in ("PrepareReceive", "StartGeneration", "GetTransferInfo", "Drain"):
                await outcome(worker_call(ch, rpc))
            return node.worker.ran

    assert run(go()) == ["PrepareReceive", "StartGeneration", "GetTransferInfo", "Drain"]


def test_generation_without_or_with_a_wrong_api_key_is_unauthenticated_and_never_echoes_it():
    auth.configure("worker", api_key=API_KEY)

    async def go():
        async with Node() as address, grpc.aio.insecure_channel(address) as ch:
            stub = pdserve_pb2_grpc.GenerationStub(ch)
            request = pdserve_pb2.GenerateRequest(prompt="hi")
            errors = [await refusal(stub.Generate(request, metadata=m))
                      for m in (None, bearer_metadata("sk-wrong-guess"))]
            errors.append(await refusal(stub.GetModelInfo(pdserve_pb2.ModelInfoRequest())))
            good = bearer_metadata(API_KEY)
            text = [m.text async for m in stub.Generate(request, metadata=good)]
            info = await stub.GetModelInfo(pdserve_pb2.ModelInfoRequest(), metadata=good)
            served = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
            return errors, text, info, served

    errors, text, info, served = run(go())
    assert [e.code() for e in errors] == [UNAUTHENTICATED] * 3
    assert "none was sent" in errors[0].details() and "not this server's" in errors[1].details()
    assert all(API_KEY not in e.details() and "sk-wrong-guess" not in e.details() for e in errors)
    assert text == ["hello", " world"] and info.model == "tiny"
    assert served.status == health_pb2.HealthCheckResponse.SERVING  # health needs no key


def test_worker_calls_without_this_clusters_token_are_unauthenticated_and_never_run():
    cluster_key._key = KEY

    async def go():
        node = Node()
        async with node as address, grpc.aio.insecure_channel(address) as ch:
            rpcs = ("PrepareReceive", "GetTransferInfo", "Abort", "Drain", "StartGeneration")
            missing = [await refusal(worker_call(ch, rpc)) for rpc in rpcs]
            other = ClusterKey(b"another-cluster-key-0000").token("router")
            forged = [await refusal(worker_call(ch, rpc, bearer_metadata(other)))
                      for rpc in rpcs]
            return missing, forged, node.worker.ran

    missing, forged, node_ran = run(go())
    assert [e.code() for e in missing + forged] == [UNAUTHENTICATED] * 10
    assert "Worker/PrepareReceive" in missing[0].details()
    assert "none was sent" in missing[0].details()
    assert "no router's or worker's" in forged[0].details()
    assert not node_ran


def test_each_worker_rpc_admits_only_its_roles_unary_and_streaming():
    cluster_key._key = KEY
    router, worker = bearer_metadata(KEY.token("router")), bearer_metadata(KEY.token("worker"))

    async def go():
        node = Node()
        async with node as address, grpc.aio.insecure_channel(address) as ch:
            denied = [await refusal(worker_call(ch, "GetTransferInfo", router)),
                      await refusal(worker_call(ch, "Drain", worker)),
                      await refusal(worker_call(ch, "Abort", worker)),
                      await refusal(worker_call(ch, "StartGeneration", worker))]
            stream = [m.token_ids[0] async for m in worker_call(ch, "StartGeneration", router)]
            info = await worker_call(ch, "GetTransferInfo", worker)
            loads = [await worker_call(ch, "GetLoad", m) for m in (router, worker)]
            unknown = await refusal(ch.unary_unary("/pdserve.v1.Worker/Nope")(b"", metadata=router))
            # The test gates stay open: fault tests hold no key.
            await testing_pb2_grpc.GatesStub(ch).Open(testing_pb2.Gate(phase="p", request_id="t-1"))
            return denied, stream, info, loads, unknown, node.worker.ran

    denied, stream, info, loads, unknown, ran = run(go())
    assert [e.code() for e in denied] == [DENIED] * 4
    assert "Worker/GetTransferInfo is for worker callers only; this caller is a router" \
        in denied[0].details()
    assert "Worker/Drain is for router callers only; this caller is a worker" in denied[1].details()
    assert stream == [0, 1] and info.agent_metadata == b"secret pages"
    assert [r.role for r in loads] == ["decode", "decode"]
    assert unknown.code() == DENIED and "Worker/Nope" in unknown.details()
    assert ran == ["StartGeneration", "GetTransferInfo", "GetLoad", "GetLoad"]


def test_channels_present_this_processs_role_token_and_keep_an_explicit_authorization():
    cluster_key._key = KEY
    auth.configure("router", api_key=API_KEY)

    async def go():
        async with Node() as address, channel(address) as ch:
            stream = [m.token_ids[0] async for m in worker_call(ch, "StartGeneration")]
            denied = await refusal(worker_call(ch, "GetTransferInfo"))
            # A client's API key on the same channel wins over the role token.
            stub = pdserve_pb2_grpc.GenerationStub(ch)
            info = await stub.GetModelInfo(pdserve_pb2.ModelInfoRequest(),
                                           metadata=bearer_metadata(API_KEY))
            return stream, denied, info

    stream, denied, info = run(go())
    assert stream == [0, 1] and denied.code() == DENIED and info.model == "tiny"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("auth-certs")
    ca = CA()
    issued = {"node": ca.issue("pdserve node"), "router": ca.issue("pdserve router"),
              "worker": ca.issue("pdserve worker"), "intruder": ca.issue("intruder", hosts=False)}
    (d / "ca.pem").write_bytes(ca.cert)
    for name, cert in issued.items():
        (d / f"{name}.pem").write_bytes(cert.cert)
        (d / f"{name}-key.pem").write_bytes(cert.key)
    return d, ca, issued


def mtls(certs, key: ClusterKey | None = None) -> grpc.ServerCredentials:
    """Configure this process as a node requiring client certificates named per role."""
    d, ca, issued = certs
    config = tls.TLSConfig(cert=str(d / "node.pem"), key=str(d / "node-key.pem"),
                           ca=str(d / "ca.pem"), require_client_cert=True,
                           router_names=["pdserve router"], worker_names=["pdserve worker"])
    tls.configure(config)
    cluster_key._key = key or ClusterKey(None)
    return tls.server_credentials()


def client_channel(address, certs, who: str) -> grpc.aio.Channel:
    d, ca, issued = certs
    creds = grpc.ssl_channel_credentials(root_certificates=ca.cert, private_key=issued[who].key,
                                         certificate_chain=issued[who].cert)
    return grpc.aio.secure_channel(address, creds)


def test_mutual_tls_refuses_a_ca_signed_certificate_whose_name_is_not_listed(certs):
    credentials = mtls(certs)

    async def go():
        async with Node(credentials) as address:
            async with client_channel(address, certs, "intruder") as ch:
                intruder = [await refusal(worker_call(ch, rpc))
                            for rpc in ("GetLoad", "GetTransferInfo", "StartGeneration")]
            async with client_channel(address, certs, "router") as ch:
                stream = [m.token_ids[0] async for m in worker_call(ch, "StartGeneration")]
                router_info = await refusal(worker_call(ch, "GetTransferInfo"))
            async with client_channel(address, certs, "worker") as ch:
                info = await worker_call(ch, "GetTransferInfo")
                drain = await refusal(worker_call(ch, "Drain"))
            return intruder, stream, router_info, info, drain

    intruder, stream, router_info, info, drain = run(go())
    assert [e.code() for e in intruder] == [DENIED] * 3
    assert "['intruder']" in intruder[0].details() and "--tls-router-names" in intruder[0].details()
    assert stream == [0, 1] and info.agent_name == "a"
    assert router_info.code() == drain.code() == DENIED
    assert "this caller is a worker (by its certificate names" in drain.details()


def test_with_a_cluster_key_the_certificate_must_match_the_tokens_role(certs):
    credentials = mtls(certs, KEY)

    async def go():
        async with Node(credentials) as address:
            async with client_channel(address, certs, "worker") as ch:  # stolen router token
                mismatch = await refusal(worker_call(ch, "PrepareReceive",
                                                     bearer_metadata(KEY.token("router"))))
                no_token = await refusal(worker_call(ch, "GetLoad"))
                load = await worker_call(ch, "GetLoad", bearer_metadata(KEY.token("worker")))
            return mismatch, no_token, load

    mismatch, no_token, load = run(go())
    assert mismatch.code() == DENIED and "router token" in mismatch.details()
    assert no_token.code() == UNAUTHENTICATED and load.role == "decode"


def test_certificate_names_need_mutual_tls_and_both_lists(certs):
    d, _, _ = certs
    base = dict(cert=str(d / "node.pem"), key=str(d / "node-key.pem"), ca=str(d / "ca.pem"))
    with pytest.raises(ValueError, match="go together"):
        tls.TLSConfig(**base, require_client_cert=True, router_names=["r"]).validate()
    with pytest.raises(ValueError, match="--tls-require-client-cert"):
        tls.TLSConfig(**base, router_names=["r"], worker_names=["w"]).validate()
    names = tls.TLSConfig(router_names=["a,b", "c"], worker_names=["w"]).caller_names()
    assert names == {"router": {"a", "b", "c"}, "worker": {"w"}}


def test_api_key_comes_from_one_place(tmp_path):
    (tmp_path / "key").write_text("sk-from-file\n")
    (tmp_path / "empty").write_text("\n")
    assert auth.APIKeyConfig(api_key_file=str(tmp_path / "key")).load() == "sk-from-file"
    assert auth.APIKeyConfig(api_key="sk-flag").load() == "sk-flag"
    assert auth.APIKeyConfig().load() is None
    for bad, match in ((dict(api_key="a", api_key_file=str(tmp_path / "key")), "not both"),
                       (dict(api_key_file=str(tmp_path / "empty")), "empty"),
                       (dict(api_key_file=str(tmp_path / "none")), "no such file")):
        with pytest.raises(ValueError, match=match):
            auth.APIKeyConfig(**bad).load()
