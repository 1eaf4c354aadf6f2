"""benchmarks/gpu.py's stage runner: a stage that dies is reported with its exit code, and
a stage stopped at its limit takes what it started along (a device machine gives one
short run: a stage must neither wait out its limit for nothing nor leave work behind). The
engine and families stages run quick on the CPU, so a bug in their CPU-side code shows here."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from pathlib import Path

from pdserve.benchmarks import stage_progress
from pdserve.benchmarks.gpu import run_stage

# The limit of the stages that hang: these import in a tenth of a second, so 3 s leaves them
# time to report and to start their child on a busy machine.
LIMIT_S = 3


def dies(code: int) -> dict:
    os._exit(code)


def starts_a_child_and_hangs(pid_file: str) -> dict:
    child = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])
    Path(pid_file).write_text(str(child.pid))
    signal.pause()  # until killed: the hang under test
    return {}


def hangs() -> dict:
    print(os.getpid(), flush=True)  # to the check's stdout, which it inherits
    signal.pause()  # until killed: the hang under test
    return {}


def answers(x: int) -> dict:
    return {"x": x}


def reports_then(x: int, end: str) -> dict:
    stage_progress.report({"x": x})
    stage_progress.report({"x": x, "y": 2 * x})  # the last report stands
    if end == "raises":
        raise RuntimeError("after the figures")
    signal.pause()  # until killed at the limit
    return {}


def ends(pid: int, timeout_s: float = 120) -> bool:
    """Whether process `pid` has exited (a zombie counts) within `timeout_s`: its pidfd
    becomes readable when it does."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout_s)[0])
    finally:
        os.close(fd)


def test_a_stage_that_dies_is_reported_with_its_exit_code_not_as_timed_out():
    result = run_stage(dies, (7,), 120)
    assert not result["ok"]
    assert result["error"] == "the stage's process died (exit code 7)"


def test_a_stage_past_its_limit_is_killed_with_its_children(tmp_path):
    pid_file = tmp_path / "pid"
    result = run_stage(starts_a_child_and_hangs, (str(pid_file),), LIMIT_S)
    assert result["error"] == f"timed out after {LIMIT_S} s"
    pid = int(pid_file.read_text())
    assert ends(pid), f"the stage's child {pid} outlived it"


def test_a_stage_that_fails_keeps_the_figures_it_reported_before():
    raised = run_stage(reports_then, (3, "raises"), 120)
    assert (raised["ok"], raised["x"], raised["y"]) == (False, 3, 6)
    assert raised["error"] == "RuntimeError('after the figures')"
    timed_out = run_stage(reports_then, (4, "hangs"), LIMIT_S)
    assert (timed_out["ok"], timed_out["x"], timed_out["y"]) == (False, 4, 8)
    assert timed_out["error"] == f"timed out after {LIMIT_S} s"


def test_a_stage_dies_with_the_check_though_it_has_a_process_group_of_its_own():
    # Its own group keeps it from a terminal's Ctrl-C and an outer `timeout`: killed, the
    # check takes it along all the same (a stage left running would hold the GPU).
    check = subprocess.Popen([sys.executable, "-c", "from pdserve.benchmarks.gpu import run_stage; "
                              "from tests.benchmarks.test_gpu_check import hangs; run_stage(hangs, (), 600)"],
                             cwd=Path(__file__).resolve().parents[2], stdout=subprocess.PIPE, text=True)
    try:
        stage = int(check.stdout.readline())  # once the stage has started
    finally:
        check.kill()
        check.wait()
        check.stdout.close()
    survived = not ends(stage)
    if survived:
        os.kill(stage, signal.SIGKILL)  # not left behind for the rest of the suite
    assert not survived, f"the stage {stage} outlived the check"


def test_a_stage_answer_comes_back():
    result = run_stage(answers, (3,), 120)
    assert result["ok"] and result["x"] == 3


def test_the_engine_stage_runs_on_tiny_models_and_reports_every_figure(tmp_path):
    from pdserve.benchmarks.gpu_engine import stage_engine

    # The stage's own code on the CPU, its figures' shapes checked: a bug in the parts a CPU
    # takes shows up here, not on device time. The CUDA branches (graphs, events, CUPTI)
    # run only on a GPU.
    r = run_stage(stage_engine, ("cpu", tmp_path, True, 4), 600)
    assert r["ok"], r.get("traceback") or r
    assert [row["batch"] for row in r["decode_steps"]] == [1, 4, 8]
    assert all(row["all_steps_full"] for row in r["decode_steps"])
    assert [(a["batch"], a["splits"]) for a in r["attention"]] == [(1, 3), (4, 3)]
    assert all(a["us_unsplit"] > 0 and a["us_as_run"] > 0 and len(a["us_by_tile"]) >= 2 for a in r["attention"])
    assert [p["batch"] for p in r["profile"]] == [1, 4] and all(p["top"] for p in r["profile"])
    assert r["throughput"]["generated_tokens"] == 8 * 8 and r["transformers"]["tokens_per_s"] > 0
    assert sorted(r["host"]["batches"]) == ["1", "4", "8"]
    assert all(row["graph_steps"] == 4 for row in r["host"]["batches"].values())


def test_the_families_stage_compares_each_familys_tokens_with_transformers(tmp_path):
    from pdserve.benchmarks.gpu import GPU_FAMILIES, stage_families

    # Quick on the CPU: the first two families on the torch backend (the GPU run takes every
    # family of GPU_FAMILIES through Triton and CUDA graphs).
    r = run_stage(stage_families, ("cpu", tmp_path, True), 600)
    assert r["ok"], r.get("traceback") or r
    assert r["families"] == {f: {"identical": 3, "of": 3, "backend": "torch", "graphs": False}
                             for f in GPU_FAMILIES[:2]}
