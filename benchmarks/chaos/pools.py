"""Pages leaked once the faults stop: each worker's pool, read through Worker.GetLoad.

After the last fault and the last request, every reservation has either been released or
outlived its lease, and every quarantined page its grace, so each pool must be full again:
`leaked = total_pages - free_pages` summed over the workers must be 0. Pages held by the
prefix cache count as free (the pool reports them so: they are evicted on demand).
`settle` polls until every pool is full or `timeout_s` (the lease plus the grace plus
slack) passes, and returns the last reading of each, so a leak shows what was left.
A worker that does not answer at the end is reported with its error and its pages as last
seen (one leaked page if it never answered): unknown pages are never assumed free.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from pdserve.runtime.server import channel


def _reading(report: pdserve_pb2.LoadReport) -> dict:
    return {"total_pages": report.total_pages, "free_pages": report.free_pages,
            "leaked_pages": report.total_pages - report.free_pages,
            "parked": report.num_parked, "running": report.num_running,
            "quarantined": report.num_quarantined, "late_writes": report.late_writes_total,
            "leases_expired": report.leases_expired_total}


def _full(reading: dict) -> bool:
    return ("error" not in reading and reading["leaked_pages"] == 0 and reading["parked"] == 0
            and reading["running"] == 0 and reading["quarantined"] == 0)


async def read(address: str, timeout_s: float = 5.0) -> dict:
    try:
        async with channel(address) as ch:
            report = await pdserve_pb2_grpc.WorkerStub(ch).GetLoad(pdserve_pb2.LoadRequest(),
                                                                   timeout=timeout_s)
    except grpc.aio.AioRpcError as err:
        return {"error": f"{err.code().name}: {err.details()}"}
    return _reading(report)


async def settle(workers: dict[str, str], timeout_s: float, poll_s: float = 0.25) -> dict:
    """{name: last reading} once every pool is full, or when `timeout_s` has passed."""
    deadline = time.monotonic() + timeout_s
    last: dict[str, dict] = {}
    while True:
        readings = await asyncio.gather(*(read(a) for a in workers.values()))
        for name, reading in zip(workers, readings):
            if "error" in reading and "total_pages" in last.get(name, {}):
                reading = {**last[name], "error": reading["error"]}  # keep what was last seen
            last[name] = reading
        if all(_full(r) for r in last.values()) or time.monotonic() >= deadline:
            return {"waited_s": round(timeout_s - max(0.0, deadline - time.monotonic()), 2),
                    "leaked": sum(leaked(r) for r in last.values()), "nodes": last}
        await asyncio.sleep(poll_s)


def leaked(reading: dict) -> int:
    """Pages not back in the pool; a node never read counts as 1 (a leak of unknown size)."""
    if "leaked_pages" not in reading:
        return 1
    return reading["leaked_pages"]
