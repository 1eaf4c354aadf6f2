"""Authentication on a real router + prefill + decode started with a cluster key file and an
API key file: clients need the API key (gRPC and HTTP), Worker RPCs need a cluster token of
a role allowed to make them, health needs nothing. The attacks of issue 17 that need no
credentials are replayed here and fail, changing nothing: reading a node's agent metadata
(the key to its KV pool, so to other users' prompts), aborting another client's stream,
draining a node, holding every page with one PrepareReceive, and writing with RemoteSend.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import urllib.error
import urllib.request

import anthropic
import grpc
import openai
import pytest

from pdserve.client import AsyncClient
from pdserve.procs import free_port
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from pdserve.runtime.bearer import bearer_metadata
from pdserve.runtime.cluster_key import ClusterKey
from tests.cluster.nodes import GREEDY, WORKER_FLAGS, Cluster, gate_open, gate_reached, run

API_KEY = "sk-pdserve-test-" + secrets.token_hex(8)
HELD = "held-"  # the decode node holds these streams after their first token
UNAUTHENTICATED, DENIED = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED


class KeyedCluster(Cluster):
    def build(self) -> None:
        secret = secrets.token_hex(32)
        (self.logs / "cluster.key").write_text(secret + "\n")
        (self.logs / "cluster.key").chmod(0o600)
        (self.logs / "api.key").write_text(API_KEY + "\n")
        self.key = ClusterKey(secret.encode())
        keyed = ["--cluster-key-file", str(self.logs / "cluster.key")]
        common = ["--model", self.model, "--host", "127.0.0.1", *keyed]
        self.start("prefill", ["prefill", *common, *WORKER_FLAGS], wait=False)
        self.start("decode", ["decode", *common, *WORKER_FLAGS, "--test-gates", HELD],
                   wait=False)
        self.wait("prefill", "decode")
        http_port = free_port()
        self.start("router", ["router", *common, "--api-key-file", str(self.logs / "api.key"),
                              "--http-port", str(http_port), "--prefill",
                              self.address("prefill"), "--decode", self.address("decode")])
        self.http = f"http://127.0.0.1:{http_port}"

    def token(self, role: str):
        return bearer_metadata(self.key.token(role))


@pytest.fixture(scope="session")
def keyed(tiny_model, tmp_path_factory):
    cluster = KeyedCluster(tmp_path_factory.mktemp("auth-logs"), tiny_model)
    try:
        cluster.build()
        yield cluster
    finally:
        cluster.stop()


async def worker(address: str, rpc: str, request, metadata=None):
    """One Worker call; a stream is read to its end."""
    async with grpc.aio.insecure_channel(address) as ch:
        call = getattr(pdserve_pb2_grpc.WorkerStub(ch), rpc)(request, metadata=metadata,
                                                             timeout=30)
        return [m async for m in call] if hasattr(call, "__aiter__") else await call


async def refused(address: str, rpc: str, request, metadata=None) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await worker(address, rpc, request, metadata)
    return err.value


async def pools_full(c: KeyedCluster) -> bool:
    reports = [await worker(c.address(n), "GetLoad", pdserve_pb2.LoadRequest(), c.token("router"))
               for n in ("prefill", "decode")]
    return all(r.free_pages == r.total_pages and r.num_parked == 0 and r.num_running == 0
               for r in reports)


async def answer(c: KeyedCluster, api_key: str | None, prompt: str = "keys and locks"):
    async with AsyncClient(c.address("router"), api_key=api_key) as client:
        return await client.generate(prompt, max_tokens=4, timeout=60, **GREEDY)


def test_grpc_clients_need_the_api_key(keyed, monkeypatch):
    async def go():
        errors = []
        for key in ("", "sk-wrong"):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await answer(keyed, key)
            errors.append(err.value)
        monkeypatch.setenv("PDSERVE_API_KEY", API_KEY)  # the client library's default
        return errors, await answer(keyed, API_KEY), await answer(keyed, None)

    errors, good, from_env = run(go())
    assert [e.code() for e in errors] == [UNAUTHENTICATED] * 2
    assert all(API_KEY not in e.details() and "sk-wrong" not in e.details() for e in errors)
    assert len(good.token_ids) == 4 and good.finish_reason == "length"
    assert from_env.token_ids == good.token_ids


def test_http_clients_need_the_api_key_and_health_metrics_and_version_stay_open(keyed):
    body = json.dumps({"model": keyed.model, "prompt": "keys", "max_tokens": 3}).encode()
    for header in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": API_KEY}):
        request = urllib.request.Request(keyed.http + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json", **header})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(request, timeout=30)
        assert err.value.code == 401 and err.value.headers["WWW-Authenticate"] == "Bearer"
        error = json.loads(err.value.read())["error"]
        assert error["type"] == "authentication_error" and API_KEY not in error["message"]
    for path in ("/health", "/metrics", "/version"):
        with urllib.request.urlopen(keyed.http + path, timeout=10) as reply:
            assert reply.status == 200
    api = openai.OpenAI(base_url=keyed.http + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed.http + "/v1", api_key="sk-wrong", max_retries=0).models.list()
    out = api.completions.create(model=keyed.model, prompt="keys", max_tokens=3, temperature=0,
                                 extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3
    # Anthropic's clients send the key as x-api-key, and read Anthropic's error shape
    claude = anthropic.Anthropic(base_url=keyed.http, api_key=API_KEY, max_retries=0, timeout=60)
    message = claude.messages.create(model=keyed.model, messages=[{"role": "user", "content": "keys"}], max_tokens=3,
                                     extra_body={"ignore_eos": True})
    assert message.usage.output_tokens == 3
    with pytest.raises(anthropic.AuthenticationError) as refused:
        anthropic.Anthropic(base_url=keyed.http, api_key="sk-wrong", max_retries=0).messages.create(
            model=keyed.model, messages=[{"role": "user", "content": "keys"}], max_tokens=3)
    assert refused.value.body["error"]["type"] == "authentication_error"


def test_health_and_pdserve_generate_work_as_documented(keyed, tmp_path):
    pdserve = [sys.executable, "-m", "pdserve.cli"]
    for node in ("router", "prefill", "decode"):  # health needs no key
        result = subprocess.run([*pdserve, "health", "--server", keyed.address(node)],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0 and "SERVING" in result.stdout, result.stderr
    ask = [*pdserve, "generate", "--server", keyed.address("router"), "--prompt", "keys",
           "--max-tokens", "3", "--temperature", "0", "--ignore-eos", "--json"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    without = subprocess.run(ask, env=env, capture_output=True, text=True, timeout=60)
    assert without.returncode == 1 and "UNAUTHENTICATED" in without.stderr
    with_key = subprocess.run([*ask, "--api-key-file", str(keyed.logs / "api.key")],
                              env=env, capture_output=True, text=True, timeout=60)
    assert with_key.returncode == 0, with_key.stderr
    assert len(json.loads(with_key.stdout)["choices"][0]["token_ids"]) == 3


def test_worker_calls_without_the_cluster_token_are_refused_and_change_nothing(keyed):
    c = keyed
    prompt = list(range(1, 200))
    hog = pdserve_pb2.PrepareReceiveRequest(  # a long hold: the longest lease accepted
        request_id="hog", prompt_token_ids=prompt, kv_window_end=-1, lease_ms=600_000)
    write = pdserve_pb2.RemoteSendRequest(
        request_id="overwrite", prompt_token_ids=prompt, kv_window_begin=0, kv_window_end=8,
        kv_append_metadata=[1, 0, 8], lease_id="made-up", lease_remaining_ms=600_000)

    async def go():
        errors = [await refused(c.address("decode"), "PrepareReceive", hog),
                  await refused(c.address("prefill"), "RemoteSend", write),
                  await refused(c.address("decode"), "GetTransferInfo",
                                pdserve_pb2.TransferInfoRequest()),
                  await refused(c.address("decode"), "Abort", pdserve_pb2.AbortRequest(
                      request_id="anyone")),
                  await refused(c.address("decode"), "Drain", pdserve_pb2.DrainRequest()),
                  await refused(c.address("decode"), "GetLoad", pdserve_pb2.LoadRequest(),
                                bearer_metadata(ClusterKey(b"a guessed cluster key").token(
                                    "router")))]
        return errors, await pools_full(c), await answer(c, API_KEY)

    errors, full, after = run(go())
    assert [e.code() for e in errors] == [UNAUTHENTICATED] * 6
    assert "Worker/PrepareReceive" in errors[0].details() and "none was sent" in errors[0].details()
    assert full, "a refused call reserved or kept pages"
    assert len(after.token_ids) == 4, "the nodes kept serving"


def test_reading_a_nodes_kv_pool_needs_a_peer_workers_token(keyed):
    """Issue 17's "read other users' prompts": the agent metadata from GetTransferInfo lets
    its holder READ the whole KV pool. No credentials, or a router's, get none of it."""
    c = keyed
    info = pdserve_pb2.TransferInfoRequest()

    async def go():
        anonymous = await refused(c.address("decode"), "GetTransferInfo", info)
        as_router = await refused(c.address("decode"), "GetTransferInfo", info, c.token("router"))
        as_peer = await worker(c.address("decode"), "GetTransferInfo", info, c.token("worker"))
        return anonymous, as_router, as_peer

    anonymous, as_router, as_peer = run(go())
    assert anonymous.code() == UNAUTHENTICATED
    assert as_router.code() == DENIED
    assert "GetTransferInfo is for worker callers only; this caller is a router" in \
        as_router.details()
    assert as_peer.agent_metadata, "a peer worker still gets what it needs to write KV"


def test_routers_learn_a_keyed_nodes_identity_without_its_agent_metadata(keyed):
    """A router checks static nodes' compatibility (model hash, dtype, KV geometry) through
    GetLoad, which it may call, and never gets the agent metadata."""
    c = keyed

    async def go():
        return [await worker(c.address(n), "GetLoad", pdserve_pb2.LoadRequest(),
                             c.token("router")) for n in ("prefill", "decode")]

    for role, report in zip(("prefill", "decode"), run(go())):
        identity = report.identity
        assert identity.role == role and identity.model_hash and identity.layout.num_layers > 0
        assert identity.agent_metadata == b""
    assert "does not tell its identity" not in c.log_text("router")


def test_abort_and_drain_by_a_stranger_or_a_worker_are_refused_and_the_stream_goes_on(keyed):
    """Issue 17's "abort and drain": Worker Abort with another client's request id, and
    Drain, refused without a router's token; the held stream then finishes whole."""
    c = keyed
    request_id = f"{HELD}victim"
    abort = pdserve_pb2.AbortRequest(request_id=request_id)

    async def go():
        async with AsyncClient(c.address("router"), api_key=API_KEY) as client:
            stream = client.responses("a secret of one user", request_id=request_id,
                                   max_tokens=6, timeout=60, **GREEDY)
            first = await anext(stream)
            await gate_reached(c.address("decode"), "stream", request_id)
            attacks = [await refused(c.address("decode"), "Abort", abort),
                       await refused(c.address("decode"), "Abort", abort, c.token("worker")),
                       await refused(c.address("decode"), "Drain", pdserve_pb2.DrainRequest()),
                       await refused(c.address("decode"), "Drain", pdserve_pb2.DrainRequest(),
                                     c.token("worker"))]
            await gate_open(c.address("decode"), "stream", request_id)
            rest = [m async for m in stream]
        return attacks, [first, *rest], await answer(c, API_KEY)

    attacks, messages, after = run(go())
    assert [e.code() for e in attacks] == [UNAUTHENTICATED, DENIED, UNAUTHENTICATED, DENIED]
    assert "Worker/Abort is for router callers only; this caller is a worker" in \
        attacks[1].details()
    tokens = [t for m in messages for t in m.token_ids]
    assert len(tokens) == 6 and [m.finish_reason for m in messages if m.finish_reason] == ["length"]
    assert len(after.token_ids) == 4, "the decode node is not draining"
