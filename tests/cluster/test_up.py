"""`pdserve up` is cheap to keep running: it answers, and the idle cluster (router + prefill
+ decode) uses under 5% of one core in total (CPU time, not wall time: another load on the
machine does not change it). How soon it answers is printed, not asserted: on a loaded
machine any bound fails, and time bounds belong to benchmarks. It keys its nodes itself: a
fresh cluster key in a private file, removed at exit, and the API key given. Its ready line
names the gRPC and the OpenAI address; it takes common worker flags itself and hints at `--`
for the rest; `make serve ARGS=...` reaches it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from pdserve.engine.config import DEFAULT_KV_CACHE_MEMORY_FRACTION
from pdserve.client import AsyncClient
from pdserve.procs import NodeProcess
from pdserve.router.load import IDLE_AFTER_S
from pdserve.cli import build_parser
from pdserve.up import UpConfig, kv_share, node_args
from tests.cluster.nodes import run
from tests.cluster.test_openai_api import _post

IDLE_WINDOW_S = 5.0
# Not idle time: start-up work (imports, first allocations), and the router's polls at the
# busy rate for IDLE_AFTER_S after the last request.
SETTLE_S = IDLE_AFTER_S + 1.0


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
    node = NodeProcess(["up", "--model", tiny_model, "--port", "0", "--http-port", "0"],
                       log=tmp_path / "up.log")
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
    # A fraction given to `up` is the two pools' together: on one GPU, 0.9 each would not fit.
    config = UpConfig(model="m", device="cuda", kv_cache_memory_fraction=0.9)
    args = node_args(config, 1001, 1002, 1003, [], [])
    shares = [float(build_parser().parse_args(args[r]).kv_cache_memory_fraction) for r in ("prefill", "decode")]
    assert shares == [0.3, 0.6]
    # On a GPU the workers run in bfloat16 unless told otherwise; on the CPU, float32.
    assert build_parser().parse_args(args["decode"]).dtype == "bfloat16"
    config.dtype = "float32"
    assert build_parser().parse_args(node_args(config, 1001, 1002, 1003, [], [])["decode"]).dtype == "float32"
    config.device, config.dtype = "cpu", None
    assert build_parser().parse_args(node_args(config, 1001, 1002, 1003, [], [])["decode"]).dtype == "float32"


def test_up_gives_its_router_the_origins_chat_template_tool_parser_and_store_and_the_workers_none():
    given = build_parser().parse_args(["up", "--allowed-origins", "http://localhost:3000", "--allowed-origins",
                                       "*", "--chat-template", "{{ x }}", "--tool-call-parser", "mistral",
                                       "--responses-store-mb", "0.5"])
    config = UpConfig(model="m", allowed_origins=given.allowed_origins, chat_template=given.chat_template,
                      tool_call_parser=given.tool_call_parser, responses_store_mb=given.responses_store_mb)
    args = node_args(config, 1001, 1002, 1003, [], [])
    router = build_parser().parse_args(args["router"])
    assert (router.allowed_origins, router.chat_template, router.tool_call_parser, router.responses_store_mb) == \
        (["http://localhost:3000", "*"], "{{ x }}", "mistral", 0.5)
    assert not {"--allowed-origins", "--chat-template", "--tool-call-parser", "--responses-store-mb"} & {
        *args["prefill"], *args["decode"]}


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
    node = NodeProcess(["up", "--model", tiny_model, "--port", "0", "--http-port", "0", "--device", "cpu",
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


def test_up_names_both_front_doors_and_gives_both_workers_its_flags_and_the_name(tiny_model, tmp_path):
    """The ready line names the gRPC and the OpenAI address; the OpenAI one serves the model
    as --served-model-name (answering by its first name, taking its second), refusing the
    directory's name, renders conversations with
    --chat-template's file and reads calls as --tool-call-parser says; both workers built their KV pools in the dtype and pages `up`
    was given, under that name (their own log lines)."""
    from transformers import AutoTokenizer

    template = tmp_path / "brackets.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}")
    node = NodeProcess(["up", "--model", tiny_model, "--port", "0", "--http-port", "0",
                        "--device", "cpu", "--dtype", "float32", "--page-size", "8",
                        "--num-pages", "64", "--served-model-name", "foo", "bar", "--chat-template", str(template),
                        "--tool-call-parser", "mistral"],
                       log=tmp_path / "up.log")
    try:
        node.wait_ready()
        doors = re.search(r"router on (\S+:\d+) \(gRPC\), OpenAI API on (http://\S+:\d+/v1)",
                          node.ready_line)
        assert doors and doors.group(1) == node.address, node.ready_line
        with openai.OpenAI(base_url=doors.group(2), api_key="unused", max_retries=0,
                           timeout=60) as api:
            assert [m.id for m in api.models.list().data] == ["foo", "bar"]
            out = api.completions.create(model="bar", prompt="hello", max_tokens=2,
                                         temperature=0, extra_body={"ignore_eos": True})
            with pytest.raises(openai.NotFoundError):
                api.completions.create(model=tiny_model, prompt="hello", max_tokens=2)
            called = api.chat.completions.create(  # Mistral's dialect: its calls' ids are 9 characters
                model="foo", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0,
                tools=[{"type": "function", "function": {"name": "f"}}],
                tool_choice={"type": "function", "function": {"name": "f"}})
        assert re.fullmatch(r"[0-9a-f]{9}", called.choices[0].message.tool_calls[0].id)
        assert out.model == "foo" and out.usage.completion_tokens == 2
        status, rendered = _post(doors.group(2).removesuffix("/v1") + "/tokenize", json.dumps({
            "model": "foo", "messages": [{"role": "user", "content": "hi"}]}).encode())
        assert status == 200 and rendered["tokens"] == \
            AutoTokenizer.from_pretrained(tiny_model).encode("[user] hi", add_special_tokens=False)

        async def grpc_models():
            async with AsyncClient(node.address) as client:
                return await client.models()

        assert [m.id for m in run(grpc_models())] == ["foo"]
    finally:
        node.stop()
    pools = re.findall(r"KV cache: \d+ tokens of (\S+) in (\w+) \((\d+) pages of (\d+),",
                       (tmp_path / "up.log").read_text())
    assert pools == [("foo", "float32", "64", "8")] * 2, pools


def test_up_serves_the_openai_api_on_8000_by_default_and_0_picks_a_free_port():
    assert build_parser().parse_args(["up"]).http_port == 8000
    assert build_parser().parse_args(["up", "--http-port", "0"]).http_port == 0


@pytest.mark.parametrize("argv", [["--lease-ms", "5000"], ["--no-prefix-cache"],
                                  ["--max-num-batched-tokens=512"]])
def test_a_worker_flag_up_does_not_take_is_refused_naming_the_double_dash(argv, capsys):
    with pytest.raises(SystemExit) as refused:
        build_parser().parse_args(["up", "--dtype", "float32", *argv])
    flag = argv[0].split("=")[0]
    assert refused.value.code == 2
    assert f"{flag} is a worker flag" in capsys.readouterr().err
    # after `--` the same flag goes to both workers
    assert build_parser().parse_args(["up", "--", *argv]).worker_args == ["--", *argv]


def test_ups_worker_flags_reach_both_workers_and_the_flags_after_the_double_dash_win():
    config = UpConfig(model="m", device="cpu", page_size=8, kv_cache_mb=64, max_num_seqs=4,
                      extra=["--", "--page-size", "16", "--no-prefix-cache"])
    args = node_args(config, 1001, 1002, 1003, ["--cluster-key-file", "k"], [])
    for role in ("prefill", "decode"):
        parsed = build_parser().parse_args(args[role])
        assert (parsed.page_size, parsed.kv_cache_mb, parsed.max_num_seqs) == (16, 64, 4)
        assert not parsed.enable_prefix_cache
        assert "--kv-cache-memory-fraction" not in args[role]  # the user sized the pools


def test_up_gives_each_worker_its_tensor_parallel_size_and_the_flags_after_the_double_dash_win():
    parsed = build_parser().parse_args(["up", "--prefill-tp", "2", "--decode-tp", "1"])
    assert (parsed.prefill_tp, parsed.decode_tp) == (2, 1)
    config = UpConfig(model="m", device="cpu", prefill_tp=parsed.prefill_tp, decode_tp=parsed.decode_tp)
    args = node_args(config, 1001, 1002, 1003, ["--cluster-key-file", "k"], [])
    assert args["prefill"][args["prefill"].index("--tensor-parallel-size") + 1] == "2"
    assert "--tensor-parallel-size" not in args["decode"] + args["router"]
    assert build_parser().parse_args(args["decode"]).tensor_parallel_size == 1
    # a --tensor-parallel-size after `--` is both workers' own, whatever up's --prefill-tp says
    config = UpConfig(model="m", device="cpu", prefill_tp=2, decode_tp=4,
                      extra=["--", "--tensor-parallel-size", "1"])
    args = node_args(config, 1001, 1002, 1003, ["--cluster-key-file", "k"], [])
    assert [build_parser().parse_args(args[r]).tensor_parallel_size for r in ("prefill", "decode")] == [1, 1]


def test_make_serve_passes_args_to_up():
    root = Path(__file__).resolve().parents[2]
    plan = subprocess.run(["make", "--no-print-directory", "-n", "serve", "ARGS=--dtype bfloat16 --http-port 0"],
                          cwd=root, capture_output=True, text=True, check=True).stdout
    assert plan.splitlines()[-1] == ".venv/bin/pdserve up --dtype bfloat16 --http-port 0"


# `up` with a check that sees which nodes run while it checks and waits until the prefill
# node listens (it has logged its KV cache by then), then stops `up` as Ctrl-C would.
CHECK_BESIDE_THE_NODES = """
import os, signal, socket, sys
from pdserve.procs import descendants, free_port
from pdserve.up import UpConfig, up
from tests.cluster.nodes import wait_until

def roles():
    found = set()
    for pid in descendants(os.getpid())[1:]:
        try:
            argv = open(f"/proc/{pid}/cmdline").read().split(chr(0))
        except OSError:
            continue
        if "pdserve.cli" in argv:
            found.add(argv[argv.index("pdserve.cli") + 1])
    return found

def listening():
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0

def check():
    wait_until(lambda: roles() == {"decode", "prefill", "router"}, roles, 60)
    print("running while checked:", " ".join(sorted(roles())), flush=True)
    wait_until(listening, "the prefill node", 120)
    os.kill(os.getpid(), signal.SIGTERM)

port = free_port()
sys.exit(up(UpConfig(model=sys.argv[1], device="cpu", http_port=0, prefill_port=port), check=check))
"""


def test_up_checks_the_model_while_its_nodes_start_and_keeps_their_lines_until_it_is_done(tiny_model):
    """The check's seconds of imports are not added to the start (a check that waited for
    the nodes before they started would time out), and stopped while checking, `up` lets
    none of its nodes' lines through."""
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", CHECK_BESIDE_THE_NODES, tiny_model], cwd=root,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "running while checked: decode prefill router" in out.stdout, out.stdout
    assert out.stderr == "", out.stderr
