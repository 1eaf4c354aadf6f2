"""The soak's cluster: 2 prefill + 2 decode workers and one router as processes on loopback.

Nodes are named `p1 p2 d1 d2 router`. A node that is killed or stopped is started again on
the port it had, so the router's endpoint list (and the client's address) stays valid.
Every start of a node is an *incarnation*; its memory (VmRSS of the node and its
children, from /proc) is read when it starts and when it ends (or when the soak ends), so
growth is reported per incarnation and a restart does not hide a leak.

Invariants: every process this class started is stopped by `stop()`, whatever happened
(and dies with the soak anyway: `NodeProcess` sets a death signal); a restart never starts
a second process on a port while the first may still hold it (the old one is reaped
first).
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from pathlib import Path

from pdserve.procs import NodeProcess, stop_all


@dataclass
class Incarnation:
    pid: int
    started_s: float          # soak clock (seconds since the cluster was built)
    rss_start_mb: float
    rss_end_mb: float | None = None
    ended_by: str = ""        # "SIGKILL", "SIGTERM", "start failed: ...", or "" (ran to the end)

    def to_dict(self) -> dict:
        growth = None if self.rss_end_mb is None else round(self.rss_end_mb - self.rss_start_mb, 1)
        return {"pid": self.pid, "started_s": round(self.started_s, 1),
                "rss_start_mb": round(self.rss_start_mb, 1),
                "rss_end_mb": None if self.rss_end_mb is None else round(self.rss_end_mb, 1),
                "rss_growth_mb": growth, "ended_by": self.ended_by}


def rss_mb(node: NodeProcess) -> float:
    """VmRSS of the node and its descendants, in MiB (0 for processes already gone)."""
    total_kb = 0
    for pid in node.pids():
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total_kb += int(line.split()[1])
        except (OSError, ValueError, IndexError):
            pass
    return total_kb / 1024


class ChaosCluster:
    def __init__(self, model: str, logs: Path, worker_flags: list[str], decode_flags: list[str],
                 router_flags: list[str], start_timeout_s: float = 180.0) -> None:
        self.model = model
        self.logs = Path(logs)
        self.worker_flags = list(worker_flags)
        self.decode_flags = list(decode_flags)
        self.router_flags = list(router_flags)
        self.start_timeout_s = start_timeout_s
        self.nodes: dict[str, NodeProcess] = {}
        self.args: dict[str, list[str]] = {}
        self.incarnations: dict[str, list[Incarnation]] = {}
        self.restarts: dict[str, int] = {}
        self.t0 = time.monotonic()

    # --- building --------------------------------------------------------------------
    def build(self) -> None:
        common = ["--model", self.model, "--host", "127.0.0.1"]
        for name in ("p1", "p2", "d1", "d2"):  # start all four, then wait: start-ups overlap
            role = "prefill" if name[0] == "p" else "decode"
            extra = self.decode_flags if role == "decode" else []
            self._spawn(name, [role, *common, *self.worker_flags, *extra], port=0)
        for name in ("p1", "p2", "d1", "d2"):
            self._ready(name)
        prefill = ",".join(self.address(n) for n in ("p1", "p2"))
        decode = ",".join(self.address(n) for n in ("d1", "d2"))
        self._spawn("router", ["router", *common, "--prefill", prefill, "--decode", decode,
                               *self.router_flags], port=0)
        self._ready("router")

    def _spawn(self, name: str, args: list[str], port: int) -> None:
        self.args[name] = list(args)
        count = self.restarts.get(name, 0)
        log = self.logs / (f"{name}.log" if count == 0 else f"{name}-{count}.log")
        self.nodes[name] = NodeProcess([*args, "--port", str(port)], log=log, threads=1)

    def _ready(self, name: str) -> None:
        """Wait until `name` listens; an incarnation that never does is recorded as ended
        (so the next fault's reading is not charged to the one before), then raised."""
        node = self.nodes[name]
        runs = self.incarnations.setdefault(name, [])
        try:
            node.wait_ready(self.start_timeout_s)
        except RuntimeError:
            runs.append(Incarnation(node.proc.pid, self.now(), 0.0, 0.0,
                                    f"start failed: exit code {node.proc.returncode}"))
            raise
        runs.append(Incarnation(node.proc.pid, self.now(), rss_mb(node)))

    def begin_soak(self) -> None:
        """Restart the clock at the soak's start and read every node's memory again: the
        first incarnations' growth counts from here, after the capacity phase has warmed
        their pools and caches (a restarted one's counts from its listening line)."""
        self.t0 = time.monotonic()
        for name, node in self.nodes.items():
            current = self.incarnations[name][-1]
            current.started_s, current.rss_start_mb = 0.0, rss_mb(node)

    # --- what faults do ----------------------------------------------------------------
    def now(self) -> float:
        return time.monotonic() - self.t0

    def address(self, name: str) -> str:
        return self.nodes[name].address

    def port(self, name: str) -> int:
        return self.nodes[name].port

    @property
    def workers(self) -> dict[str, str]:
        return {n: self.address(n) for n in ("p1", "p2", "d1", "d2")}

    def end_incarnation(self, name: str, sig: int, grace_s: float = 15.0) -> None:
        """Read the node's memory, then end it with `sig` (SIGKILL: at once; SIGTERM: it
        drains, SIGKILL after `grace_s`) and reap it."""
        node = self.nodes[name]
        current = self.incarnations[name][-1]
        if current.rss_end_mb is None:  # else it already ended (a restart that failed)
            current.rss_end_mb = rss_mb(node)
            current.ended_by = signal.Signals(sig).name
        if sig == signal.SIGKILL:
            node.kill()
            node.stop()  # closes its pipes and log
        else:
            node.stop(grace_s, sig)

    def restart(self, name: str) -> None:
        """Start `name` again on the port it had, and wait until it listens."""
        port = self.nodes[name].port
        self.restarts[name] = self.restarts.get(name, 0) + 1
        self._spawn(name, self.args[name], port=port)
        self._ready(name)

    def signal(self, name: str, sig: int) -> None:
        self.nodes[name].send_signal(sig)

    def alive(self, name: str) -> bool:
        return self.nodes[name].alive()

    # --- the end -----------------------------------------------------------------------
    def close_incarnations(self) -> None:
        """Read the memory of every node still running: the end of its incarnation."""
        for name, node in self.nodes.items():
            current = self.incarnations.get(name, [None])[-1]
            if current is not None and current.rss_end_mb is None and node.alive():
                current.rss_end_mb = rss_mb(node)

    def memory(self) -> dict[str, list[dict]]:
        return {name: [i.to_dict() for i in runs] for name, runs in self.incarnations.items()}

    def stop(self) -> None:
        for node in self.nodes.values():  # a node left stopped must run again to exit
            node.send_signal(signal.SIGCONT)
        stop_all(list(self.nodes.values())[::-1])
