"""`pdserve.launch` sets a child up in the child (death signal, cores), so starting a node
forks nothing: no at-fork handler of ours (gRPC's among them) runs in the parent."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from pdserve import launch
from pdserve.procs import NodeProcess
from tests.cluster.nodes import wait_until

PR_GET_PDEATHSIG = 2
REPORT = ("import ctypes, json, os; s = ctypes.c_int(); "
          f"ctypes.CDLL(None).prctl({PR_GET_PDEATHSIG}, ctypes.byref(s)); "
          "print(json.dumps({'cores': sorted(os.sched_getaffinity(0)), 'death': s.value, "
          "'ppid': os.getppid()}))")


def _report(argv: list[str]) -> dict:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_without_set_up_the_command_is_run_as_it_is():
    assert launch.command(["sleep", "1"]) == ["sleep", "1"]


def test_the_child_gets_its_cores_and_its_death_signal_and_keeps_its_parent():
    core = max(os.sched_getaffinity(0))
    got = _report(launch.command([sys.executable, "-c", REPORT], parent_death=signal.SIGTERM,
                                 cores={core}))
    assert got == {"cores": [core], "death": int(signal.SIGTERM), "ppid": os.getpid()}
    plain = _report([sys.executable, "-c", REPORT])
    assert plain["death"] == 0 and plain["cores"] == sorted(os.sched_getaffinity(0))


def test_a_parent_already_gone_runs_nothing():
    dead = subprocess.Popen(["true"])
    dead.wait()
    argv = [sys.executable, "-m", "pdserve.launch", "--parent", str(dead.pid), "--", sys.executable,
            "-c", "print('ran')"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "ran" not in out.stdout


def test_bad_cores_and_a_missing_command_are_refused_naming_them():
    for argv, named in ((["--cores", "x,1", "--", "true"], "'x,1'"), (["--cores", "0"], "no command"),
                        (["--", "no-such-program-here"], "'no-such-program-here'")):
        out = subprocess.run([sys.executable, "-m", "pdserve.launch", *argv],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode != 0 and named in out.stderr, (argv, out.stderr)


def test_starting_a_node_runs_no_at_fork_handler_in_the_parent(tmp_path):
    forked = []
    os.register_at_fork(before=lambda: forked.append(os.getpid()))  # stays: handlers cannot go
    node = NodeProcess([], program=["sleep", "30"], log=tmp_path / "sleep.log", cores={0})
    try:
        def running_sleep() -> bool:  # the launcher has set it up and exec'd the command
            with open(f"/proc/{node.proc.pid}/comm") as comm:
                return comm.read().strip() == "sleep"
        wait_until(running_sleep, "the launcher to exec sleep")
        with open(f"/proc/{node.proc.pid}/status") as status:
            allowed = next(line for line in status if line.startswith("Cpus_allowed_list"))
        assert allowed.split()[-1] == "0"  # pinned before the exec, and the pin kept
    finally:
        node.stop(grace_s=5)
    assert forked == []


CHATTY = """
import sys
print("pdserve fake listening on 127.0.0.1:1", flush=True)
for i in range(4000):  # 4000 lines of 40 bytes: past a pipe's 64 KiB
    print(f"UCX  WARN  a library's line {i:05d} ............", flush=True)
open(sys.argv[1], "w").write("done")
"""


def test_a_node_writing_to_stdout_after_its_ready_line_is_never_blocked(tmp_path):
    # Nothing else reads a node's stdout past the ready line; UCX logs there by default.
    done = tmp_path / "done"
    node = NodeProcess([str(done)], program=[sys.executable, "-c", CHATTY], log=tmp_path / "chatty.log")
    try:
        assert node.wait_ready(60) == "127.0.0.1:1"
        assert node.wait_ready(60) == "127.0.0.1:1"  # asked again: the same answer
        node.proc.wait(120)  # a blocked node would never end, nor write `done`
        assert done.read_text() == "done"
    finally:
        node.stop(grace_s=5)
    assert "line 03999" in (tmp_path / "chatty.log").read_text()  # copied to its log
