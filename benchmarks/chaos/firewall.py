"""The soak's link fault: drop every TCP packet to one loopback port for a while (iptables).

A rule `INPUT -i lo -p tcp --dport PORT -j DROP` cuts a node's gRPC port off from the
router and its peers while the process itself runs on; established connections stall
(their segments are dropped, not refused) and new ones hang in SYN, as over a dead link.
NIXL's shared-memory path is not TCP and is not cut.

Invariants:
- Only rules this process added are ever removed: each carries the comment
  `pdserve-chaos-<pid>`. `clear()` removes all of them; it runs in `block`'s `finally` and at
  interpreter exit, and a later soak removes the rules of a soak that died without its
  exit handlers (its pid no longer alive), never those of a soak still running.
- `available()` says why the fault cannot run (not root, no iptables, or the kernel refuses
  a rule); the soak then leaves the fault out and says so in its report.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import subprocess
import time
from contextlib import contextmanager

from pdserve.procs import pid_alive

PREFIX = "pdserve-chaos-"
COMMENT = f"{PREFIX}{os.getpid()}"
_RULE = re.compile(rf"^-A INPUT (.*--comment \"?{PREFIX}(\d+)\"?.*)$")


def _iptables(*args: str) -> subprocess.CompletedProcess:
    """iptables' result; where it is not installed, a failed one (so `clear()` at the start
    and end of every soak finds nothing to remove instead of raising)."""
    command = ["iptables", "-w", "5", *args]
    if shutil.which("iptables") is None:
        return subprocess.CompletedProcess(command, 127, "", "iptables is not installed")
    return subprocess.run(command, capture_output=True, text=True, timeout=15)


def _rule(port: int) -> list[str]:
    return ["INPUT", "-i", "lo", "-p", "tcp", "--dport", str(port), "-m", "comment",
            "--comment", COMMENT, "-j", "DROP"]


def available() -> str:
    """"" when the link fault can run here, else why not."""
    if os.geteuid() != 0:
        return "not root: iptables needs CAP_NET_ADMIN"
    if shutil.which("iptables") is None:
        return "iptables is not installed"
    listed = _iptables("-L", "INPUT", "-n")
    if listed.returncode != 0:
        return f"iptables -L failed: {listed.stderr.strip()}"
    probe = _rule(1)  # port 1: nothing of ours listens there
    added = _iptables("-I", *probe)
    if added.returncode != 0:
        return f"iptables refused a DROP rule with a comment match: {added.stderr.strip()}"
    _iptables("-D", *probe)
    return ""


def _our_rules(mine_only: bool) -> list[str]:
    """The INPUT rules soaks added (as `iptables -S` prints them, without `-A `): this
    process's, or with `mine_only=False` also those of soaks no longer alive."""
    listed = _iptables("-S", "INPUT")
    out = []
    for line in listed.stdout.splitlines() if listed.returncode == 0 else []:
        match = _RULE.match(line)
        if not match:
            continue
        pid = int(match.group(2))
        if pid == os.getpid() or (not mine_only and not pid_alive(pid)):
            out.append(match.group(1))
    return out


def clear(mine_only: bool = True) -> int:
    """Remove the rules this process added (with `mine_only=False`, also dead soaks'); how
    many were removed."""
    removed = 0
    for _ in range(100):  # bounded: each pass removes one rule
        rules = _our_rules(mine_only)
        if not rules:
            break
        spec = rules[0].replace('"', "").split()
        if _iptables("-D", "INPUT", *spec).returncode != 0:
            break
        removed += 1
    return removed


@contextmanager
def block(port: int):
    """Drop TCP to 127.0.0.1:`port` inside the block; the rule is gone afterwards,
    whatever happened."""
    atexit.register(clear)  # registering twice is harmless: clear() is idempotent
    added = _iptables("-I", *_rule(port))
    if added.returncode != 0:
        raise RuntimeError(f"iptables could not block port {port}: {added.stderr.strip()}")
    started = time.monotonic()
    try:
        yield started
    finally:
        for _ in range(5):  # bounded: a busy xtables lock is retried a few times
            if _iptables("-D", *_rule(port)).returncode == 0:
                break
            time.sleep(0.2)
