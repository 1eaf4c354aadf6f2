"""benchmarks/gpu.py's stage runner: a stage that dies is reported with its exit code, and
a stage stopped at its limit takes what it started along (a device machine gives one
short run: a stage must neither wait out its limit for nothing nor leave work behind)."""

from __future__ import annotations

import os
import signal
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


def hangs(pid_file: str) -> dict:
    Path(pid_file).write_text(str(os.getpid()))
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


def test_a_stage_dies_with_the_check_though_it_has_a_process_group_of_its_own(tmp_path):
    # Its own group keeps it from a terminal's Ctrl-C and an outer `timeout`: killed, the
    # check takes it along all the same (a stage left running would hold the GPU).
    pid_file = tmp_path / "pid"
    check = subprocess.Popen([sys.executable, "-c", "import sys; from pdserve.benchmarks.gpu import run_stage; "
                              "from tests.benchmarks.test_gpu_check import hangs; run_stage(hangs, (sys.argv[1],), 600)",
                              str(pid_file)], cwd=Path(__file__).resolve().parents[2])
    try:
        for _ in range(1200):  # until the stage has started
            if pid_file.exists() and pid_file.read_text():
                break
            time.sleep(0.05)
        stage = int(pid_file.read_text())
    finally:
        check.kill()
        check.wait()
    for _ in range(200):
        if gone(stage):
            break
        time.sleep(0.05)
    survived = not gone(stage)
    if survived:
        os.kill(stage, signal.SIGKILL)  # not left behind for the rest of the suite
    assert not survived, f"the stage {stage} outlived the check"


def test_a_stage_answer_comes_back():
    result = run_stage(answers, (3,), 120)
    assert result["ok"] and result["x"] == 3
