"""The soak's faults, injected one at a time on the plan's schedule (benchmarks/chaos/plan.py).

- `kill`: SIGKILL a worker, wait `restart_after_s`, start it again on its port and wait
  until it listens.
- `stop`: SIGSTOP a worker (its whole process group) for `stop_s`, longer than the router's
  lease, then SIGCONT.
- `router`: end the router with SIGTERM (it drains) or SIGKILL, wait `router_down_s`, start
  it again on its port. Clients see errors meanwhile; they are counted, not hidden.
- `link`: drop TCP to a worker's gRPC port for `link_s` (benchmarks/chaos/firewall.py).

Invariants: a fault ends healed whatever happened inside it (a stopped node is continued, a
blocked port unblocked, a killed node restarted; only a soak cut short, whose cluster is
stopping, skips the restart) before the next one starts; a fault that falls behind its
plan (the previous one healed late) starts at once, never two at a time.
Each runs in a thread, so the client's event loop keeps sending while a node restarts.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from dataclasses import dataclass

from pdserve.benchmarks.chaos import firewall
from pdserve.benchmarks.chaos.cluster import ChaosCluster
from pdserve.benchmarks.chaos.plan import PlannedFault


@dataclass(frozen=True)
class FaultTimes:
    restart_after_s: float = 3.0  # kill: dead this long before the restart begins
    stop_s: float = 4.0           # stop: frozen this long (more than the lease)
    router_down_s: float = 1.0    # router: down this long before the restart begins
    router_grace_s: float = 10.0  # router SIGTERM: drain this long, then SIGKILL
    link_s: float = 4.0           # link: port blocked this long


class FaultInjector:
    def __init__(self, cluster: ChaosCluster, times: FaultTimes) -> None:
        self.cluster = cluster
        self.times = times
        self.records: list[dict] = []
        # Set when the soak is cut short: a fault's waits end at once and it heals.
        self.halt = threading.Event()

    async def run(self, plan: list[PlannedFault], soak_start: float,
                  last_start_s: float) -> list[dict]:
        """Inject every planned fault that can start by `last_start_s` (faults that slipped
        past it would strike after the load ends); the records (also kept as
        `self.records`, so a soak cut short still reports the faults it saw)."""
        for fault in plan:
            await asyncio.sleep(max(0.0, soak_start + fault.at_s - time.monotonic()))
            if time.monotonic() - soak_start > last_start_s:
                break
            record = {"kind": fault.kind, "target": fault.target, "how": fault.how,
                      "planned_s": fault.at_s,
                      "at_s": round(time.monotonic() - soak_start, 2)}
            self.records.append(record)
            started = time.monotonic()
            try:
                record.update(await asyncio.to_thread(self._inject, fault))
            except asyncio.CancelledError:
                self.halt.set()  # the thread heals and ends without waiting out the fault
                raise
            except Exception as err:  # reported; the soak goes on with the next fault
                record["error"] = f"{type(err).__name__}: {err}"[:500]
            record["healed_s"] = round(time.monotonic() - soak_start, 2)
            record["duration_s"] = round(time.monotonic() - started, 2)
        return self.records

    def _inject(self, fault: PlannedFault) -> dict:
        t, c = self.times, self.cluster
        if fault.kind == "kill":
            c.end_incarnation(fault.target, signal.SIGKILL)
            if not self.halt.wait(t.restart_after_s):
                c.restart(fault.target)
            return {"pid": c.nodes[fault.target].proc.pid}
        if fault.kind == "stop":
            c.signal(fault.target, signal.SIGSTOP)
            try:
                self.halt.wait(t.stop_s)
            finally:
                c.signal(fault.target, signal.SIGCONT)
            return {"stopped_s": t.stop_s}
        if fault.kind == "router":
            c.end_incarnation("router", signal.Signals[fault.how], t.router_grace_s)
            if not self.halt.wait(t.router_down_s):
                c.restart("router")
            return {"pid": c.nodes["router"].proc.pid}
        if fault.kind == "link":
            port = c.port(fault.target)
            with firewall.block(port):
                self.halt.wait(t.link_s)
            return {"port": port, "blocked_s": t.link_s}
        raise ValueError(f"unknown fault kind {fault.kind!r}")
