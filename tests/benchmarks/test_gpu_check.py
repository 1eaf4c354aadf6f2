"""benchmarks/gpu.py's stage runner: a stage that dies is reported with its exit code, and
a stage stopped at its limit takes what it started along (a device machine gives one
short run: a stage must neither wait out its limit for nothing nor leave work behind)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from pdserve.benchmarks.gpu import run_stage


def dies(code: int) -> dict:
    os._exit(code)


def starts_a_child_and_hangs(pid_file: str) -> dict:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    Path(pid_file).write_text(str(child.pid))
    time.sleep(600)
    return {}


def answers(x: int) -> dict:
    return {"x": x}


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


def test_a_stage_that_dies_is_reported_with_its_exit_code_not_as_timed_out():
    result = run_stage(dies, (7,), 120)
    assert not result["ok"]
    assert result["error"] == "the stage's process died (exit code 7)"


def test_a_stage_past_its_limit_is_killed_with_its_children(tmp_path):
    pid_file = tmp_path / "pid"
    result = run_stage(starts_a_child_and_hangs, (str(pid_file),), 10)
    assert result["error"] == "timed out after 10 s"
    pid = int(pid_file.read_text())
    for _ in range(200):  # SIGKILL is delivered at once; reaping by init may take a moment
        if gone(pid):
            break
        time.sleep(0.05)
    assert gone(pid), f"the stage's child {pid} outlived it"


def test_a_stage_answer_comes_back():
    result = run_stage(answers, (3,), 120)
    assert result["ok"] and result["x"] == 3
