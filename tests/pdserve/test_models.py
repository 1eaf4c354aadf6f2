"""`--model NAME|DIR`: a node started with a catalogue name and one started with that
name's directory are the same model to every peer, and a bad name fails at once, naming it."""

from __future__ import annotations

import os
import subprocess
import sys

import grpc

from pdserve.procs import NodeProcess
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc


def identity(address: str) -> pdserve_pb2.TransferInfo:
    with grpc.insecure_channel(address) as channel:
        return pdserve_pb2_grpc.WorkerStub(channel).GetTransferInfo(
            pdserve_pb2.TransferInfoRequest(), timeout=10)


def test_a_name_and_its_directory_give_the_same_model_identity(tmp_path):
    env = {**os.environ, "PDSERVE_CACHE": str(tmp_path / "cache")}
    path = subprocess.run([sys.executable, "-m", "pdserve.cli", "models", "fetch", "demo-random"],
                          env=env, capture_output=True, text=True, check=True).stdout.strip()
    flags = ["--host", "127.0.0.1", "--port", "0", "--num-threads", "1", "--kv-cache-mb", "8"]
    by_name = NodeProcess(["decode", "--model", "demo-random", *flags], env=env,
                          log=tmp_path / "name.log")
    by_dir = NodeProcess(["decode", "--model", path, *flags], env=env, log=tmp_path / "dir.log")
    try:
        a, b = identity(by_name.wait_ready()), identity(by_dir.wait_ready())
    finally:
        by_name.stop()
        by_dir.stop()
    assert a.model == b.model == "demo-random"
    assert a.model_hash == b.model_hash != ""


def test_an_unknown_model_name_fails_at_once_naming_it_and_the_known_ones():
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "decode", "--model", "gpt-17"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "gpt-17" in out.stderr and "smollm2-135m-instruct" in out.stderr


def test_models_check_says_whether_a_directory_is_served_as_transformers_runs_it(tmp_path, monkeypatch, capsys):
    """One JSON line and the exit status: 0 for a served family whose tokens are
    transformers'; 1 naming the refusal, or the first token that differs (an engine with
    GPT-OSS's sinks left out, here)."""
    import dataclasses
    import json

    from pdserve.cli import main
    from pdserve.engine.checkpoint import write_checkpoint
    from pdserve.engine.model import arch
    from tests.engine.test_architectures import olmo_checkpoint

    model = str(write_checkpoint(tmp_path / "gpt_oss", "gpt_oss"))

    def check(directory: str, *flags: str) -> tuple[int, dict, str]:
        code = main(["models", "check", directory, "--tokens", "8", *flags])
        out, err = capsys.readouterr()
        return code, json.loads(out.strip().splitlines()[-1]), err

    code, result, _ = check(model, "--prompt", "the river city light")
    assert code == 0 and result["served"] and result["identical"] and len(result["pdserve"]) == 8
    code, result, err = check(str(olmo_checkpoint(tmp_path / "olmo")))
    assert code == 1 and not result["served"] and "model_type 'olmo'" in err
    family = arch._family
    monkeypatch.setattr(arch, "_family", lambda c, kind, act: dataclasses.replace(family(c, kind, act), sinks=False))
    code, result, err = check(model, "--prompt", "the river city light")
    assert code == 1 and not result["identical"] and f"from token {result['first_difference']} on" in err


def test_models_check_runs_a_multimodal_model_whole_where_transformers_has_no_text_class(tmp_path, capsys):
    # transformers' AutoModelForCausalLM takes no Aya Vision checkpoint: the check runs it whole.
    import json

    from pdserve.cli import main
    from pdserve.engine.families import config_of
    from tests.engine.test_multimodal import SIGLIP, save_multimodal

    d = save_multimodal(tmp_path / "aya", "AyaVision", config_of("cohere2", 512), SIGLIP, random_text=True,
                        image_token_index=5)
    assert main(["models", "check", str(d), "--tokens", "6"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["model_type"] == "cohere2" and result["identical"] and len(result["transformers"]) == 6
