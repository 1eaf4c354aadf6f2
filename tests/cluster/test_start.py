"""What a user meets when a server starts, as real processes: a taken port, a directory
that is no checkpoint, weights cut short or missing, or a model of a kind pdserve does not
run ends the command with one line and exit status 1 before any model loads; a node's C kernels are built before its ready line, and a node on the torch path
says so in that line and in `pdserve_c_kernels`."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pdserve.engine
from pdserve.procs import NodeProcess, free_port
from tests.cluster.nodes import WORKER_FLAGS, sample, scrape
from tests.engine.test_architectures import olmo_checkpoint

ENGINE = Path(pdserve.engine.__file__).parent  # its kernels: every .c file beneath
MODEL_LOADED = "KV cache:"  # the worker's log line once its model and KV pool are loaded


def pdserve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`pdserve ARGS` to its end (the bound only guards against a hang)."""
    return subprocess.run([sys.executable, "-m", "pdserve.cli", *args], capture_output=True,
                          text=True, timeout=300, env={**os.environ, **(env or {})})


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err[-3000:]
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture
def taken_port():
    """A port some other process listens on, for the length of the test."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen(1)
        yield other.getsockname()[1]


@pytest.mark.parametrize("flag", ["--port", "--metrics-port"])
def test_a_taken_port_ends_a_worker_with_one_line_before_its_model_loads(tiny_model, taken_port,
                                                                         flag):
    other = ["--port", "0"] if flag == "--metrics-port" else []
    out = pdserve("decode", "--model", tiny_model, "--host", "127.0.0.1", *WORKER_FLAGS, *other,
                  flag, str(taken_port))
    assert out.returncode == 1
    line = one_line(out.stderr)
    assert f"127.0.0.1:{taken_port} ({flag})" in line and "in use" in line, line
    assert MODEL_LOADED not in out.stderr + out.stdout


@pytest.mark.parametrize("flags, says", [
    (["--device", "cuda:99"], ["--device cuda:99", "--device cpu" if not torch.cuda.is_available() else "pass one"]),
    (["--device", "gpu"], ["--device must be cpu, cuda or cuda:N, got 'gpu'"]),
    (["--page-size", "0"], ["--page-size must be an integer >= 1, got 0"]),
    (["--kv-cache-mb", "-5"], ["--kv-cache-mb must be > 0, got -5"]),
    (["--lora-modules", "nodir"], ["--lora-modules entry 'nodir' is not NAME=DIR"]),
    (["--lora-modules", "a=/nonexistent"], ["LoRA adapter 'a': /nonexistent/adapter_config.json does not exist"])])
def test_a_bad_engine_flag_ends_a_worker_with_one_line_before_its_model_loads(tiny_model, flags, says):
    out = pdserve("serve", "--model", tiny_model, "--host", "127.0.0.1", "--port", "0", *flags)
    assert out.returncode == 1
    line = one_line(out.stderr)
    assert line.startswith("pdserve serve: ") and all(s in line for s in says), line
    assert MODEL_LOADED not in out.stderr + out.stdout


def test_a_taken_port_ends_a_router_with_one_line(tiny_model, taken_port):
    out = pdserve("router", "--model", tiny_model, "--host", "127.0.0.1", "--port", str(taken_port),
                  "--decode", "127.0.0.1:1")
    assert out.returncode == 1
    assert f"127.0.0.1:{taken_port} (--port)" in one_line(out.stderr)


def test_a_second_up_on_a_taken_port_says_so_in_one_line_and_starts_no_node(tiny_model, taken_port):
    out = pdserve("up", "--model", tiny_model, "--port", str(taken_port))
    assert out.returncode == 1
    assert f"127.0.0.1:{taken_port} (--port)" in one_line(out.stderr)
    assert "listening" not in out.stdout


def test_an_empty_model_directory_is_one_line_naming_what_is_missing(tmp_path):
    out = pdserve("serve", "--model", str(tmp_path), "--port", "0")
    assert out.returncode == 1
    line = one_line(out.stderr)
    for missing in ("config.json", "weights (*.safetensors)", "tokenizer"):
        assert missing in line, line
    (tmp_path / "config.json").write_text("{}")  # now only the weights and tokenizer are named
    line = one_line(pdserve("serve", "--model", str(tmp_path), "--port", "0").stderr)
    assert "config.json" not in line and "weights" in line and "tokenizer" in line, line


def test_weights_cut_short_or_a_missing_shard_are_one_line_naming_each_file(tmp_path):
    from pdserve.engine.checkpoint import write_checkpoint

    model_dir = write_checkpoint(tmp_path / "m", max_shard_size="50KB")  # several files and their index
    shards = sorted(model_dir.glob("*.safetensors"))
    os.truncate(shards[0], shards[0].stat().st_size // 2)  # as an interrupted download leaves it
    shards[-1].unlink()
    out = pdserve("serve", "--model", str(model_dir), "--port", "0")
    assert out.returncode == 1
    line = one_line(out.stderr)
    assert f"{shards[0].name} cannot be read (" in line and "download or save them again" in line, line
    assert f"{shards[-1].name} (listed in model.safetensors.index.json) is missing" in line, line
    assert len(shards) > 2 and shards[1].name not in line, line
    assert MODEL_LOADED not in out.stderr + out.stdout


@pytest.mark.parametrize("command", ["serve", "up"])
def test_a_model_pdserve_cannot_run_is_one_line_naming_its_kind(tmp_path, command):
    out = pdserve(command, "--model", str(olmo_checkpoint(tmp_path)), "--port", "0")
    assert out.returncode == 1
    line = one_line(out.stderr)
    assert line.startswith(f"pdserve {command}: {tmp_path}: model_type 'olmo' (OlmoForCausalLM) is not "
                           f"supported"), line
    assert MODEL_LOADED not in out.stderr + out.stdout and "listening" not in out.stdout


def start_worker(tmp_path: Path, model: str, env: dict[str, str]) -> tuple[NodeProcess, int]:
    port = free_port()
    node = NodeProcess(["serve", "--model", model, "--host", "127.0.0.1", "--port", "0",
                        *WORKER_FLAGS, "--metrics-port", str(port)],
                       log=tmp_path / "serve.log", env={**os.environ, **env})
    node.wait_ready(300)
    return node, port


def test_a_node_on_the_torch_path_says_so_in_its_ready_line_and_metric(tiny_model, tmp_path):
    node, metrics_port = start_worker(tmp_path, tiny_model, {"PDSERVE_NO_C_KERNELS": "1"})
    try:
        assert "torch path: PDSERVE_NO_C_KERNELS is set" in node.ready_line, node.ready_line
        samples = scrape(f"http://127.0.0.1:{metrics_port}/metrics")
        assert sample(samples, "pdserve_c_kernels", state="torch", reason="disabled") == 1
        assert sample(samples, "pdserve_c_kernels", state="c", reason="") == 0
    finally:
        node.stop()


def test_the_kernels_are_built_before_the_ready_line(tiny_model, tmp_path):
    cache = tmp_path / "cache"  # empty: every kernel must be compiled by this node
    node, metrics_port = start_worker(tmp_path, tiny_model, {"PDSERVE_CACHE": str(cache)})
    try:
        assert node.ready_line.endswith("(C kernels built)"), node.ready_line
        built = sorted(p.name.rsplit("-", 1)[0] for p in (cache / "kernels").glob("*.so"))
        assert built == sorted(p.stem for p in ENGINE.rglob("*.c")), built
        samples = scrape(f"http://127.0.0.1:{metrics_port}/metrics")
        assert sample(samples, "pdserve_c_kernels", state="c", reason="") == 1
    finally:
        node.stop()
