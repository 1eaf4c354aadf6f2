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
