"""`pdserve bench trust --attacks`: issue 38's transport attacks, replayed against a real
router (a TLS certificate, an API key, the OpenAI HTTP port) over a decode node, both bound
to 127.0.0.1. Each attack is a row: what was tried, against which configuration, what
happened, and whether it was refused.

- plain HTTP to the OpenAI port while TLS is configured (the key would cross in clear);
- 16 parallel unauthenticated 60 MB Generate calls of garbage, with the router's memory
  (VmRSS) sampled through them; the same as 60 MB HTTP POSTs;
- 300 connections sending their headers a byte at a time (the header timeout is 2 s here);
- every listener of the two nodes, as `ss` shows them, against `--host`.
The tests that assert the same: tests/cluster/test_transport.py.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import ssl
import subprocess
import tempfile
from pathlib import Path

import grpc

from pdserve.procs import NodeProcess, free_port, stop_all

HOST = "127.0.0.1"
BIG, PARALLEL, SLOW_CLIENTS, HEADER_TIMEOUT_S = 60 << 20, 16, 300, 2
RSS_BOUND_MB = 16  # refused unread: about 1 MB; parsed first it was ~800 MB


def _certificate(d: Path) -> tuple[Path, Path]:
    cert, key = d / "router.pem", d / "router-key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return cert, key


def rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def with_peak_rss(pid: int, attack) -> tuple[float, float, list]:
    """The process's RSS when `attack(measured)` set `measured` (its warm-up done), its
    peak until the attack ended, and the attack's results."""
    measured = asyncio.Event()
    task = asyncio.ensure_future(attack(measured))
    await asyncio.wait([task, asyncio.ensure_future(measured.wait())],
                       return_when=asyncio.FIRST_COMPLETED)
    before = peak = rss_mb(pid)
    while not task.done():
        await asyncio.sleep(0.02)
        peak = max(peak, rss_mb(pid))
    return before, peak, task.result()


class Target:
    def __init__(self, model: str, d: Path, nodes: list[NodeProcess]) -> None:
        cert, key = _certificate(d)
        (d / "api.key").write_text(secrets.token_hex(16) + "\n")
        self.context = ssl.create_default_context(cafile=str(cert))
        self.cert = cert.read_bytes()
        self.http_port = free_port()
        self.config = (f"router: --host {HOST} --tls-cert --api-key-file --http-port "
                       f"--http-header-timeout-s {HEADER_TIMEOUT_S}; decode: --host {HOST}")
        self.decode = NodeProcess(["decode", "--model", model, "--host", HOST, "--port", "0",
                                   "--metrics-port", "0", "--num-threads", "1",
                                   "--num-pages", "64", "--page-size", "8"], log=d / "decode.log")
        nodes.append(self.decode)
        self.decode.wait_ready()
        self.router = NodeProcess(
            ["router", "--model", model, "--host", HOST, "--port", "0", "--decode",
             self.decode.address, "--api-key-file", str(d / "api.key"), "--tls-cert", str(cert),
             "--tls-key", str(key), "--http-port", str(self.http_port),
             "--http-header-timeout-s", str(HEADER_TIMEOUT_S)], log=d / "router.log")
        nodes.append(self.router)
        self.router.wait_ready()

    async def connect(self, tls: bool = True):
        return await asyncio.open_connection(HOST, self.http_port, ssl=self.context if tls else None,
                                             server_hostname="localhost" if tls else None)


async def plain_http(t: Target) -> dict:
    try:
        reader, writer = await t.connect(tls=False)
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(32), 30)
    except (ConnectionError, asyncio.TimeoutError):
        answer = b""
    refused = not answer.startswith(b"HTTP/")
    return {"attack": "plain HTTP to the OpenAI port under TLS", "refused": refused,
            "outcome": "no HTTP answer (the port speaks TLS only)" if refused
            else f"answered {answer[:15]!r}"}


async def big_generate(t: Target) -> dict:
    options = [("grpc.max_send_message_length", BIG + 1024),
               ("grpc.ssl_target_name_override", "localhost")]
    garbage = b"\x0a" + b"\xff" * BIG

    async def attack(measured: asyncio.Event):
        async with grpc.aio.secure_channel(t.router.address, grpc.ssl_channel_credentials(t.cert),
                                           options=options) as ch:
            call = ch.unary_stream("/pdserve.v1.Generation/Generate", request_serializer=bytes,
                                   response_deserializer=bytes)

            async def one(body: bytes = garbage):
                try:
                    return [m async for m in call(body, timeout=120)] and "OK"
                except grpc.aio.AioRpcError as err:
                    return err.code().name
            await one(b"\x0a\x01")  # connection and TLS set up before the measure
            measured.set()
            return await asyncio.gather(*(one() for _ in range(PARALLEL)))

    before, peak, codes = await with_peak_rss(t.router.proc.pid, attack)
    return {"attack": f"{PARALLEL} parallel unauthenticated {BIG >> 20} MB Generate calls of garbage",
            "refused": set(codes) == {"UNAUTHENTICATED"} and peak - before < RSS_BOUND_MB,
            "outcome": f"{sorted(set(codes))}; router RSS {before:.0f} -> peak {peak:.0f} MB"}


async def big_post(t: Target) -> dict:
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % BIG
    chunk = b" " * (1 << 20)

    async def one(megabytes: int = BIG >> 20):
        reader, writer = await t.connect()
        writer.write(head)
        answer = asyncio.ensure_future(reader.read(12))
        try:
            for _ in range(megabytes):
                if answer.done():
                    break
                writer.write(chunk)
                await asyncio.wait([answer, asyncio.ensure_future(writer.drain())],
                                   return_when=asyncio.FIRST_COMPLETED)
            return (await asyncio.wait_for(answer, 30)).decode(errors="replace")
        finally:
            writer.transport.abort()

    async def attack(measured: asyncio.Event):
        # as many 1 MB POSTs first: what connections cost, not bodies, is paid before the measure
        await asyncio.gather(*(one(1) for _ in range(PARALLEL)))
        measured.set()
        return await asyncio.gather(*(one() for _ in range(PARALLEL)))

    before, peak, answers = await with_peak_rss(t.router.proc.pid, attack)
    return {"attack": f"{PARALLEL} parallel unauthenticated {BIG >> 20} MB HTTP POSTs",
            "refused": set(answers) == {"HTTP/1.1 401"} and peak - before < RSS_BOUND_MB,
            "outcome": f"{sorted(set(answers))}; router RSS {before:.0f} -> peak {peak:.0f} MB"}


async def slow_headers(t: Target) -> dict:
    loop = asyncio.get_running_loop()

    async def one() -> float:
        reader, writer = await t.connect()
        started = loop.time()
        for byte in b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" * 100:  # never ends its headers
            try:
                writer.write(bytes([byte]))
                await writer.drain()
                if await asyncio.wait_for(reader.read(1), 0.5) == b"":
                    break
            except asyncio.TimeoutError:
                continue
            except (ConnectionError, ssl.SSLError):
                break
            if loop.time() - started > 60:
                return float("inf")
        return loop.time() - started

    held = await asyncio.gather(*(one() for _ in range(SLOW_CLIENTS)))
    return {"attack": f"{SLOW_CLIENTS} connections sending headers a byte at a time",
            "refused": max(held) < 60,
            "outcome": f"all closed by the router after {min(held):.1f}-{max(held):.1f} s"}


def listening_addresses(pid: int) -> list[str]:
    """The local addresses of the TCP and UDP sockets process `pid` listens on (`ss`)."""
    out = subprocess.run(["ss", "-Hltunp"], capture_output=True, text=True, check=True).stdout
    return [line.split()[4] for line in out.splitlines() if f"pid={pid}," in line]


def listeners(t: Target) -> dict:
    found = {name: listening_addresses(node.proc.pid)
             for name, node in (("decode", t.decode), ("router", t.router))}
    outside = [a for addrs in found.values() for a in addrs
               if re.sub(r":\d+$", "", a) not in (HOST, f"[::ffff:{HOST}]")]
    return {"attack": "listeners outside --host (gRPC, HTTP, /metrics, UCX)", "refused": not outside,
            "outcome": "; ".join(f"{n}: {', '.join(a)}" for n, a in found.items())}


def run_attacks(model_dir: str) -> list[dict]:
    """Start the two nodes, run every attack, stop the nodes whatever happened."""
    nodes: list[NodeProcess] = []
    with tempfile.TemporaryDirectory(prefix="pdserve-trust-") as d:
        try:
            t = Target(model_dir, Path(d), nodes)
            rows = [listeners(t)]
            for attack in (plain_http, big_generate, big_post, slow_headers):
                rows.append(asyncio.run(attack(t)))
            return [{**row, "configuration": t.config} for row in rows]
        finally:
            stop_all(nodes)
