"""`benchmarks/link.py`: two hosts on one machine. The namespaces exist only inside the
`with`, the veth carries the rate tc allows, `forward` relays HTTP and a gRPC stream into
a namespace, a node started with `netns=` sees only its host, and `pdserve bench transfer
--link` moves the KV window across the veth (its byte counters say so), not through
shared memory. Skipped, with the reason, where namespaces cannot be made (not root)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pdserve.benchmarks.link import PREFIX, Host, Link, LinkError, cleanup_stale, parse_link, rate_bits
from pdserve import netns
from pdserve.procs import NodeProcess, dial_address
from tests.cluster.nodes import wait_until


@pytest.fixture(scope="module")
def linkable() -> None:
    reason = Link.unavailable()
    if reason is not None:
        pytest.skip(reason)


def ours() -> set[str]:
    return {n for n in os.listdir(netns.NETNS_DIR) if n.startswith(f"{PREFIX}-{os.getpid()}-")} \
        if os.path.isdir(netns.NETNS_DIR) else set()


def in_host(host: Host, fn, *args, timeout_s: float = 20.0):
    """`fn(*args)` on a thread inside `host` (only that thread moves); its result."""
    out: dict = {}

    def body() -> None:
        try:
            netns.enter(host.ns, remount_sys=False)
            out["value"] = fn(*args)
        except BaseException as err:  # re-raised below
            out["error"] = err

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), f"{fn.__name__} in {host.ns} did not finish within {timeout_s}s"
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_parse_link_reads_rate_and_delay():
    assert parse_link("1gbit") == ("1gbit", 0.0)
    assert parse_link("1gbit,1ms") == ("1gbit", 1.0)
    assert parse_link("25GBIT, 0.5ms") == ("25gbit", 0.5)
    assert parse_link("200mbit,500us") == ("200mbit", 0.5)
    assert rate_bits("25gbit") == 25e9 and rate_bits("200mbit") == 2e8 and rate_bits("64kbit") == 64e3
    for bad in ("", "1gb", "fast", "1gbit,1", "1gbit,1ms,2ms", "0gbit", "-1gbit", "1gbit,x"):
        with pytest.raises(ValueError, match="bad link"):
            parse_link(bad)


def test_the_link_exists_only_inside_the_with(linkable):
    with Link("200mbit") as link:
        a, b = link.hosts
        assert ours() == {a.ns, b.ns} and a.address != b.address
        seen = a.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
        assert "pd0" in seen and "lo" in seen and len(seen.splitlines()) == 2
        shaping = subprocess.run(["tc", "-n", b.ns, "qdisc", "show", "dev", "pd0"], capture_output=True,
                                 text=True, check=True).stdout
        assert "tbf" in shaping and "200Mbit" in shaping  # both ends shaped
    assert ours() == set()
    with pytest.raises(KeyError):
        with Link(None) as link:
            assert len(ours()) == 2
            raise KeyError("boom")
    assert ours() == set()


def _comm(pid: int) -> str:
    with open(f"/proc/{pid}/comm") as comm:
        return comm.read().strip()


def test_leaving_refuses_to_hide_a_process_still_inside(linkable):
    with pytest.raises(LinkError, match="still in them"):
        with Link(None, release_timeout_s=0.5) as link:
            sleeper = subprocess.Popen(link.hosts[0].command(["sleep", "60"]))
            wait_until(lambda: _comm(sleeper.pid) == "sleep", "the launcher to move in and exec sleep")
    sleeper.kill()  # the Link never kills what it did not start
    sleeper.wait()
    assert ours() == set()


def test_stale_namespaces_of_dead_runs_are_removed(linkable):
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale, live = f"{PREFIX}-{dead.pid}-0-a", f"{PREFIX}-{os.getpid()}-999-a"
    for name in (stale, live):
        subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert stale in cleanup_stale()
        names = os.listdir(netns.NETNS_DIR)
        assert stale not in names and live in names
    finally:
        for name in (stale, live):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _serve_bytes(server: socket.socket) -> tuple[int, float]:
    """(bytes received, perf_counter when the last of them arrived)."""
    conn, _ = server.accept()
    with conn:
        buf, n = bytearray(1 << 20), 0
        while k := conn.recv_into(buf):
            n += k
        return n, time.perf_counter()


def test_bulk_tcp_gets_the_shaped_rate(linkable):
    nbytes = 8 << 20
    with Link("200mbit") as link:
        a, b = link.hosts
        server = in_host(b, socket.create_server, (b.address, 0))
        result: dict = {}
        receiver = threading.Thread(target=lambda: result.update(got=_serve_bytes(server)), daemon=True)
        receiver.start()

        def send() -> None:
            with socket.create_connection((b.address, server.getsockname()[1]), timeout=10) as c:
                c.sendall(b"\x5a" * nbytes)

        started = time.perf_counter()
        in_host(a, send)
        receiver.join(20)
        server.close()
        got, last = result["got"]
    assert got == nbytes
    # From before the connection to the last byte: a loaded machine only slows the
    # transfer, so only the ceiling is asserted (an unshaped veth runs at many Gbit/s).
    achieved = got * 8 / (last - started) / rate_bits("200mbit")
    assert achieved <= 1.1, f"{achieved:.2f} of the shaped rate"


def test_a_delay_shows_in_the_round_trip_or_is_refused_without_netem(linkable):
    """Where the kernel has no netem (this machine's), asking for a delay is refused by
    name and leaves nothing behind, rather than giving an undelayed link."""
    reason = Link.unavailable(delay_ms=20)
    if reason is not None:
        assert "netem" in reason
        with pytest.raises(LinkError, match="netem"):
            with Link("200mbit", 20.0):
                pass
        assert ours() == set()
        return
    with Link("200mbit", 20.0) as link:
        a, b = link.hosts
        server = in_host(b, socket.create_server, (b.address, 0))

        def connect() -> float:
            t = time.perf_counter()
            socket.create_connection((b.address, server.getsockname()[1]), timeout=10).close()
            return time.perf_counter() - t

        rtt = in_host(a, connect)
        server.close()
    # A floor only: load adds to a round trip (the connect's timeout bounds it above).
    assert rtt >= 0.038, f"connect took {rtt * 1e3:.1f} ms over a 20 ms each-way link"


class _Echo(BaseHTTPRequestHandler):
    def do_GET(self):
        self._reply(b"hello from " + self.server.server_address[0].encode())

    def do_POST(self):
        self._reply(self.rfile.read(int(self.headers["Content-Length"]))[::-1])

    def _reply(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_forward_relays_http_both_ways(linkable):
    with Link(None) as link:
        b = link.hosts[1]
        httpd = in_host(b, ThreadingHTTPServer, (b.address, 0), _Echo)
        serving = threading.Thread(target=httpd.serve_forever, daemon=True)
        serving.start()
        try:
            port = link.forward(b, httpd.server_address[1])
            url = f"http://127.0.0.1:{port}/"
            with urllib.request.urlopen(url, timeout=10) as r:
                assert r.read() == f"hello from {b.address}".encode()
            payload = os.urandom(3 << 20)
            with urllib.request.urlopen(urllib.request.Request(url, data=payload), timeout=20) as r:
                assert r.read() == payload[::-1]
        finally:
            httpd.shutdown()
            httpd.server_close()
            serving.join(10)
    with pytest.raises(OSError):  # the relay stopped with the link
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


GRPC_ECHO = """
import os, socket, sys
from concurrent import futures
import grpc
names = sorted(n for _, n in socket.if_nameindex())
print("interfaces", ",".join(names), "sys", ",".join(sorted(os.listdir("/sys/class/net"))),
      file=sys.stderr, flush=True)
def chat(requests, context):
    for message in requests:
        yield message
big = [("grpc.max_receive_message_length", 8 << 20), ("grpc.max_send_message_length", 8 << 20)]
server = grpc.server(futures.ThreadPoolExecutor(2), options=big, handlers=[
    grpc.method_handlers_generic_handler("echo.Echo", {"Chat": grpc.stream_stream_rpc_method_handler(chat)})])
port = server.add_insecure_port(sys.argv[1] + ":0")
server.start()
print(f"pdserve echo listening on {sys.argv[1]}:{port}", flush=True)
server.wait_for_termination()
"""


def test_a_node_is_dialled_at_the_host_it_listens_on():
    assert dial_address("10.200.0.2", 5) == "10.200.0.2:5"
    assert dial_address("0.0.0.0", 5) == dial_address("::", 5) == dial_address("[::]", 5) == "127.0.0.1:5"
    assert dial_address("::1", 5) == dial_address("[::1]", 5) == "[::1]:5"


def test_a_node_in_a_namespace_sees_only_its_host_and_streams_through_forward(linkable, tmp_path):
    import queue

    import grpc

    with Link(None) as link:
        b = link.hosts[1]
        node = NodeProcess([b.address], program=[sys.executable, "-c", GRPC_ECHO], netns=b.ns,
                           log=tmp_path / "echo.log")
        try:
            assert node.wait_ready(60) == f"{b.address}:{node.port}"  # the host it printed
            assert "interfaces lo,pd0 sys lo,pd0" in (tmp_path / "echo.log").read_text()
            port = link.forward(b, node.port)
            big = [("grpc.max_receive_message_length", 8 << 20), ("grpc.max_send_message_length", 8 << 20)]
            with grpc.insecure_channel(f"127.0.0.1:{port}", options=big) as channel:
                outbox: queue.Queue = queue.Queue()
                replies = channel.stream_stream("/echo.Echo/Chat")(iter(outbox.get, None), timeout=30)
                for i in range(5):  # each reply comes back before the next request is sent
                    outbox.put(f"ping {i}".encode())
                    assert next(replies) == f"ping {i}".encode()
                payload = os.urandom(4 << 20)
                outbox.put(payload)
                assert next(replies) == payload
                outbox.put(None)
                assert list(replies) == []
        finally:
            node.stop()


def test_bench_transfer_crosses_the_link(linkable, capsys):
    from pdserve.benchmarks.transfer import main

    rc = main(["--link", "1gbit", "--tokens", "256", "--repeats", "1", "--layers", "2", "--kv-heads", "2",
               "--head-dim", "64", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["verified"] is True
    assert out["link_gbit"] == 1.0 and out["link_delay_ms"] == 0.0
    assert out["link_fraction"] > 0 and out["kv_gbit"] == pytest.approx(out["kv_gbps"] * 8, rel=1e-3)
    # UCX's TCP carried the payload over pd0: with shared memory the veth would see ~nothing
    assert out["link_bytes_a_to_b"] >= out["link_payload_bytes"] == 256 * 2 * 2 * 2 * 64 * 2 * 5
    assert ours() == set()
