"""`pdserve up` is cheap to keep running: it answers, and the idle cluster (router + prefill
+ decode) uses under 5% of one core in total (CPU time, not wall time: another load on the
machine does not change it). How soon it answers is printed, not asserted: on a loaded
machine any bound fails, and time bounds belong to benchmarks. It keys its nodes itself: a
fresh cluster key in a private file, removed at exit, and the API key given."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from pdserve.engine.config import DEFAULT_KV_CACHE_MEMORY_FRACTION
from pdserve.client import AsyncClient
from pdserve.procs import NodeProcess
from pdserve.up import UpConfig, kv_share, node_args
from tests.cluster.nodes import run

IDLE_WINDOW_S = 3.0
SETTLE_S = 1.0  # start-up work (imports, first allocations) is not idle time


def cpu_seconds(pids: list[int]) -> float:
    """utime + stime of these processes, in seconds."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / tick


def test_up_answers_and_idles_under_5_percent_of_a_core(tiny_model, tmp_path):
    start = time.monotonic()
    node = NodeProcess(["up", "--model", tiny_model, "--port", "0"], log=tmp_path / "up.log")
    try:
        node.wait_ready()

        async def ask():
            async with AsyncClient(node.address) as client:
                return await client.generate("hello", max_tokens=4, temperature=0.0)

        out = run(ask())
        first_answer_s = time.monotonic() - start
        assert len(out.token_ids) >= 1

        pids = node.pids()
        assert len(pids) >= 4  # up + router + prefill + decode
        time.sleep(SETTLE_S)
        before = cpu_seconds(pids)
        time.sleep(IDLE_WINDOW_S)  # the thing measured: CPU used while nothing happens
        idle_core_fraction = (cpu_seconds(pids) - before) / IDLE_WINDOW_S
        print(f"\npdserve up: first answer after {first_answer_s:.2f} s; idle CPU "
              f"{100 * idle_core_fraction:.2f}% of one core over {IDLE_WINDOW_S:.0f} s "
              f"({len(pids)} processes)")
        assert idle_core_fraction < 0.05, f"idle CPU {100 * idle_core_fraction:.2f}% of a core"
    finally:
        node.stop()
    # Both workers sized their KV against the same free memory: together they take the
    # default share of it, not twice that.
    shares = [float(f) for f in re.findall(r"sized by --kv-cache-memory-fraction ([0-9.]+) of",
                                           (tmp_path / "up.log").read_text())]
    assert len(shares) == 2 and abs(sum(shares) - DEFAULT_KV_CACHE_MEMORY_FRACTION) < 1e-3, shares


def test_up_leaves_a_kv_size_the_user_gave_to_both_workers():
    assert kv_share("prefill", ["--kv-cache-mb", "64"]) == kv_share("decode", ["--num-pages=8"]) == []
    assert kv_share("decode", []) == ["--kv-cache-memory-fraction", "0.1667"]


def _device_args(monkeypatch, found: str, **config) -> dict[str, list[str]]:
    """Each child's command line, with `found` as the device this machine would default to."""
    import pdserve.up

    monkeypatch.setattr(pdserve.up, "default_device", lambda: found)
    args = node_args(UpConfig(model="m", **config), 1001, 1002, 1003, ["--cluster-key-file", "k"], [])
    return {role: [a for a in argv if a.startswith("--device") or a.startswith("cuda")
                   or a == "cpu"] for role, argv in args.items()}


def test_up_gives_both_workers_the_device_asked_for_and_the_router_none(monkeypatch):
    assert _device_args(monkeypatch, "cuda", device="cpu") == \
        {"prefill": ["--device", "cpu"], "decode": ["--device", "cpu"], "router": []}
    assert _device_args(monkeypatch, "cpu", device="cuda:1")["decode"] == ["--device", "cuda:1"]


def test_up_defaults_the_workers_to_the_device_found_here(monkeypatch):
    assert _device_args(monkeypatch, "cuda")["prefill"] == ["--device", "cuda"]
    assert _device_args(monkeypatch, "cpu")["decode"] == ["--device", "cpu"]
    # a --device among the flags after `--` is the workers' own: up adds none
    assert _device_args(monkeypatch, "cuda", extra=["--", "--device=cuda:2"])["prefill"] == ["--device=cuda:2"]


def test_up_finds_the_device_torch_would_use_without_importing_it_on_a_machine_with_no_gpu():
    import subprocess
    import sys

    probe = "import sys; from pdserve.up import default_device; print(default_device(), 'torch' in sys.modules)"
    found, imported = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                                     check=True, cwd=Path(__file__).resolve().parents[2]).stdout.split()
    import torch

    assert found == ("cuda" if torch.cuda.is_available() else "cpu")
    if not Path("/dev/nvidia0").exists():
        assert imported == "False", "up imported torch to learn there is no GPU"



def test_up_keys_its_nodes_with_a_fresh_private_cluster_key_removed_at_exit(tiny_model, tmp_path):
    import grpc
    import pytest

    from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
    from pdserve.runtime.server import channel

    (tmp_path / "api.key").write_text("sk-up-test\n")
    node = NodeProcess(["up", "--model", tiny_model, "--port", "0", "--device", "cpu",
                        "--api-key-file", str(tmp_path / "api.key")], log=tmp_path / "up.log")
    try:
        node.wait_ready()
        commands = [Path(f"/proc/{pid}/cmdline").read_text().split("\0")
                    for pid in node.pids()[1:]]
        nodes = {args[args.index("pdserve.cli") + 1]: args
                 for args in commands if "pdserve.cli" in args}
        assert set(nodes) == {"router", "prefill", "decode"}

        def value(role: str, flag: str) -> str | None:
            args = nodes[role]
            return args[args.index(flag) + 1] if flag in args else None

        key_files = {value(role, "--cluster-key-file") for role in nodes}
        api_files = {role: value(role, "--api-key-file") for role in nodes}
        assert len(key_files) == 1 and None not in key_files  # one key, on every node
        assert api_files["prefill"] is api_files["decode"] is None  # only the router's
        secret_files = [*key_files, api_files["router"]]
        assert all(Path(p).stat().st_mode & 0o777 == 0o600 for p in secret_files)
        assert not any("sk-up-test" in a for args in nodes.values() for a in args)
        assert [value(role, "--device") for role in ("prefill", "decode", "router")] == ["cpu", "cpu", None]

        async def go():
            async with AsyncClient(node.address, api_key="sk-up-test") as client:
                out = await client.generate("hello", max_tokens=2, temperature=0.0)
            async with AsyncClient(node.address, api_key="") as client:
                with pytest.raises(grpc.aio.AioRpcError) as anonymous_client:
                    await client.generate("hello", max_tokens=2)
            async with channel(f"127.0.0.1:{value('decode', '--port')}") as ch:
                with pytest.raises(grpc.aio.AioRpcError) as anonymous_call:
                    await pdserve_pb2_grpc.WorkerStub(ch).GetLoad(pdserve_pb2.LoadRequest())
            return out, anonymous_client.value.code(), anonymous_call.value.code()

        out, client_refused, call_refused = run(go())
        assert len(out.token_ids) == 2
        assert client_refused == call_refused == grpc.StatusCode.UNAUTHENTICATED
    finally:
        node.stop()
    assert not any(Path(p).exists() for p in secret_files), "key files left behind"
