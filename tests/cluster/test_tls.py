"""TLS on every endpoint: the router serves clients over TLS, and router <-> workers (and
prefill -> decode) use mutual TLS; callers without a trusted certificate are refused.

Certificates are made here with `cryptography`: one CA, one certificate for 127.0.0.1
used by every node (server and client), and a client certificate from a stranger CA.
"""

from __future__ import annotations

import datetime
import ipaddress

import grpc
import pytest

from proto import pdserve_pb2, pdserve_pb2_grpc
from tests.cluster.nodes import WORKER_FLAGS, Cluster, run


def _key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _cert(subject_cn, key, issuer_cn, issuer_key, ca: bool):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject_cn)]))
               .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer_cn)]))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False).add_extension(x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _pem(cert=None, key=None) -> bytes:
    from cryptography.hazmat.primitives import serialization

    if cert is not None:
        return cert.public_bytes(serialization.Encoding.PEM)
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


@pytest.fixture(scope="module")
def tls_cluster(tiny_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    ca_key, node_key, stranger_ca_key, stranger_key = _key(), _key(), _key(), _key()
    ca = _cert("pdserve test CA", ca_key, "pdserve test CA", ca_key, ca=True)
    node = _cert("pdserve node", node_key, "pdserve test CA", ca_key, ca=False)
    stranger = _cert("stranger", stranger_key, "stranger CA", stranger_ca_key, ca=False)
    files = {"ca": _pem(ca), "cert": _pem(node), "key": _pem(key=node_key),
             "stranger_cert": _pem(stranger), "stranger_key": _pem(key=stranger_key)}
    for name, data in files.items():
        (d / f"{name}.pem").write_bytes(data)
    tls = ["--tls-cert", str(d / "cert.pem"), "--tls-key", str(d / "key.pem"),
           "--tls-ca", str(d / "ca.pem")]
    c = Cluster(d, tiny_model)
    try:
        for role in ("prefill", "decode"):
            c.start(role, [role, "--model", tiny_model, "--host", "127.0.0.1", *WORKER_FLAGS,
                           *tls, "--tls-require-client-cert"], wait=False)
        c.wait("prefill", "decode")
        c.start("router", ["router", "--model", tiny_model, "--host", "127.0.0.1",
                           "--prefill", c.address("prefill"), "--decode", c.address("decode"),
                           *tls])
        yield {name: c.address(name) for name in ("router", "prefill", "decode")} | files
    finally:
        c.stop()


def _secure(address, files, client_cert: str | None):
    creds = grpc.ssl_channel_credentials(
        root_certificates=files["ca"],
        private_key=files[f"{client_cert}key"] if client_cert is not None else None,
        certificate_chain=files[f"{client_cert}cert"] if client_cert is not None else None)
    return grpc.aio.secure_channel(address, creds)


def test_router_serves_tls_and_workers_require_mutual_tls(tls_cluster):
    t = tls_cluster

    async def generate(ch):
        stub = pdserve_pb2_grpc.GenerationStub(ch)
        request = pdserve_pb2.GenerateRequest(prompt="secure hello", sampling=pdserve_pb2.SamplingParams(
            max_tokens=4, temperature=0.0, ignore_eos=True))
        return [m async for m in stub.Generate(request, timeout=30)]

    async def get_load(ch):
        return await pdserve_pb2_grpc.WorkerStub(ch).GetLoad(pdserve_pb2.LoadRequest(), timeout=10)

    async def refused(coro_fn, ch):
        async with ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await coro_fn(ch)
            return err.value.code()

    async def go():
        async with _secure(t["router"], t, None) as ch:
            msgs = await generate(ch)
        plain = await refused(generate, grpc.aio.insecure_channel(t["router"]))
        no_cert = await refused(get_load, _secure(t["decode"], t, None))
        stranger = await refused(get_load, _secure(t["decode"], t, "stranger_"))
        async with _secure(t["decode"], t, "") as ch:
            report = await get_load(ch)
        return msgs, plain, no_cert, stranger, report

    msgs, plain, no_cert, stranger, report = run(go())
    tokens = [tok for m in msgs for tok in m.token_ids]
    assert len(tokens) == 4 and msgs[-1].HasField("usage")
    assert msgs[-1].usage.route.prefill_endpoint == t["prefill"]  # router -> P -> D over mTLS
    assert plain == no_cert == stranger == grpc.StatusCode.UNAVAILABLE
    assert report.role == "decode" and report.free_pages == report.total_pages
