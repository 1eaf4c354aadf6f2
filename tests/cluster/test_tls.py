"""TLS on every endpoint: the router serves clients over TLS, and router <-> workers (and
prefill -> decode) use mutual TLS; callers without a trusted certificate are refused, and
so are callers whose certificate the CA signed but whose name the workers do not list for
the role an RPC needs (`--tls-router-names`, `--tls-worker-names`).

Certificates (tests/certs.py): one CA; the router's ("pdserve router") and the workers'
("pdserve worker"), both valid for 127.0.0.1; an "intruder" the same CA signed, listed
nowhere; and a stranger from another CA.
"""

from __future__ import annotations

import grpc
import pytest

from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from tests.certs import CA
from tests.cluster.nodes import WORKER_FLAGS, Cluster, run


@pytest.fixture(scope="module")
def tls_cluster(tiny_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    ca, stranger_ca = CA(), CA("stranger CA")
    issued = {"router": ca.issue("pdserve router"), "worker": ca.issue("pdserve worker"),
              "intruder": ca.issue("intruder"), "stranger": stranger_ca.issue("stranger")}
    files = {"ca": ca.cert}
    for name, cert in issued.items():
        files[f"{name}_cert"], files[f"{name}_key"] = cert.cert, cert.key
    for name, data in files.items():
        (d / f"{name}.pem").write_bytes(data)

    def tls(who: str) -> list[str]:
        return ["--tls-cert", str(d / f"{who}_cert.pem"), "--tls-key", str(d / f"{who}_key.pem"),
                "--tls-ca", str(d / "ca.pem")]

    c = Cluster(d, tiny_model)
    try:
        for role in ("prefill", "decode"):
            c.start(role, [role, "--model", tiny_model, "--host", "127.0.0.1", *WORKER_FLAGS,
                           *tls("worker"), "--tls-require-client-cert",
                           "--tls-router-names", "pdserve router",
                           "--tls-worker-names", "pdserve worker"], wait=False)
        c.wait("prefill", "decode")
        c.start("router", ["router", "--model", tiny_model, "--host", "127.0.0.1",
                           "--prefill", c.address("prefill"), "--decode", c.address("decode"),
                           *tls("router")])
        yield {name: c.address(name) for name in ("router", "prefill", "decode")} | files
    finally:
        c.stop()


def _secure(address, files, client: str | None):
    creds = grpc.ssl_channel_credentials(
        root_certificates=files["ca"],
        private_key=files[f"{client}_key"] if client is not None else None,
        certificate_chain=files[f"{client}_cert"] if client is not None else None)
    return grpc.aio.secure_channel(address, creds)


async def _get_load(ch):
    return await pdserve_pb2_grpc.WorkerStub(ch).GetLoad(pdserve_pb2.LoadRequest(), timeout=10)


async def _refused(call, ch) -> grpc.aio.AioRpcError:
    async with ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(ch)
        return err.value


def test_router_serves_tls_and_workers_require_mutual_tls(tls_cluster):
    t = tls_cluster

    async def generate(ch):
        stub = pdserve_pb2_grpc.GenerationStub(ch)
        request = pdserve_pb2.GenerateRequest(prompt="secure hello", sampling=pdserve_pb2.SamplingParams(
            max_tokens=4, temperature=0.0, ignore_eos=True))
        return [m async for m in stub.Generate(request, timeout=30)]

    async def go():
        async with _secure(t["router"], t, None) as ch:
            msgs = await generate(ch)
        plain = await _refused(generate, grpc.aio.insecure_channel(t["router"]))
        no_cert = await _refused(_get_load, _secure(t["decode"], t, None))
        stranger = await _refused(_get_load, _secure(t["decode"], t, "stranger"))
        async with _secure(t["decode"], t, "worker") as ch:
            report = await _get_load(ch)
        return msgs, plain.code(), no_cert.code(), stranger.code(), report

    msgs, plain, no_cert, stranger, report = run(go())
    tokens = [tok for m in msgs for tok in m.token_ids]
    assert len(tokens) == 4 and msgs[-1].HasField("usage")
    # router -> P -> D over mutual TLS, each node presenting the name of its role
    assert msgs[-1].usage.route.prefill_endpoint == t["prefill"]
    assert not msgs[-1].usage.route.remote_send_skipped
    assert plain == no_cert == stranger == grpc.StatusCode.UNAVAILABLE
    assert report.role == "decode" and report.free_pages == report.total_pages


def test_a_ca_signed_certificate_acts_only_in_the_role_its_name_is_listed_for(tls_cluster):
    t = tls_cluster

    async def drain(ch):
        return await pdserve_pb2_grpc.WorkerStub(ch).Drain(pdserve_pb2.DrainRequest(), timeout=10)

    async def transfer_info(ch):
        return await pdserve_pb2_grpc.WorkerStub(ch).GetTransferInfo(
            pdserve_pb2.TransferInfoRequest(), timeout=10)

    async def go():
        intruder = [await _refused(call, _secure(t["decode"], t, "intruder"))
                    for call in (_get_load, transfer_info, drain)]
        worker_drain = await _refused(drain, _secure(t["decode"], t, "worker"))
        router_info = await _refused(transfer_info, _secure(t["decode"], t, "router"))
        async with _secure(t["decode"], t, "worker") as ch:
            report = await _get_load(ch)
        return intruder, worker_drain, router_info, report

    intruder, worker_drain, router_info, report = run(go())
    assert [e.code() for e in intruder] == [grpc.StatusCode.PERMISSION_DENIED] * 3
    assert "'intruder'" in intruder[0].details() and "--tls-router-names" in intruder[0].details()
    assert worker_drain.code() == router_info.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "Worker/Drain is for router callers only" in worker_drain.details()
    assert "Worker/GetTransferInfo is for worker callers only" in router_info.details()
    assert report.free_pages == report.total_pages, "the decode node was not drained"
