"""A prefill node frozen in the middle of a window's write, with real processes and SIGSTOP.

Request `slow-sigstop-…` makes each prefill node that writes it land the first half of the
window and then stop its own process (runtime/gates.py), as a stalled host would. The
decode node must not reuse those pages on the strength of a clock: it holds them, asks the
writer for proof, and after lease + grace reports the writer fenced; the router stops
using the frozen nodes at once, and the client still gets the right answer within its
deadline. After SIGCONT the second halves land, the pages come back, and the prefill nodes
take work again.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

from pdserve.client import AsyncClient
from tests.cluster.conftest import SLOW
from tests.cluster.nodes import (GREEDY, full, gate_open, load, open_gates, run, stopped_at,
                                 wait_for, wait_pools_full, wait_until)

PROMPT = [(i * 29) % 480 + 20 for i in range(120)]


def _stopped(node) -> bool:
    return any(Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "T"
               for pid in node.pids())


def _story(c, request_id: str) -> str:
    """What the routers and decode nodes logged about the request (for a failure)."""
    return "\n".join(f"{name}: {line}" for name in ("short", "d1", "d2", "p1", "p2")
                     for line in c.log_text(name).splitlines()
                     if request_id in line or "fenced" in line or "proof" in line)


def test_writer_stopped_mid_window_is_fenced_changes_no_output_and_leaks_nothing(fault_cluster):
    c = fault_cluster
    request_id = f"{SLOW}sigstop-1"
    d_addresses = [c.address(d) for d in ("d1", "d2")]

    def bystander(i):
        return [(i * 17 + j * 5) % 480 + 20 for j in range(48)]

    async def fenced() -> set[str]:
        return {w for d in d_addresses for w in (await load(d)).fenced_writers}

    async def go():
        before = sum([(await load(d)).late_writes_total for d in d_addresses])
        await open_gates(c, "prefill", request_id)
        async with AsyncClient(c.address("short")) as short, AsyncClient(c.address("main")) as main:
            slow = asyncio.ensure_future(short.generate(
                PROMPT, request_id=request_id, max_tokens=6, timeout=40, **GREEDY))
            frozen = []
            for _ in range(2):  # the first prefill node, then the one the router retries
                name = await stopped_at(c, "kv_write", request_id,
                                        tuple(n for n in ("p1", "p2") if n not in frozen))
                await gate_open(c.address(name), "kv_write", request_id)
                await asyncio.to_thread(wait_until, lambda: _stopped(c.nodes[name]),
                                        "the prefill node to stop itself", 20)
                frozen.append(name)
            try:
                out = await slow  # D prefilled it itself once both leases ran out
                # Past lease + grace a frozen writer is fenced: listed, its pages still held.
                try:
                    walls = await wait_for(fenced, timeout_s=20)
                except AssertionError:
                    raise AssertionError(f"no writer fenced:\n{_story(c, request_id)}") from None
                bystanders = await asyncio.gather(*(
                    main.generate(bystander(i), max_tokens=6, **GREEDY) for i in range(6)))
                quarantined = sum([(await load(d)).num_quarantined for d in d_addresses])
            finally:
                for name in frozen:
                    c.nodes[name].send_signal(signal.SIGCONT)
            reports = await wait_pools_full([*c.workers])
            after = sum([r.late_writes_total for r in reports if r.role == "decode"])
            expected = await asyncio.gather(*(main.generate(
                bystander(i), kv_window_end=0, max_tokens=6, **GREEDY) for i in range(6)))
            slow_expected = await main.generate(PROMPT, kv_window_end=0, max_tokens=6, **GREEDY)

            async def disaggregated_again():
                o = await main.generate(bystander(100), max_tokens=2, **GREEDY)
                return not o.usage.route.remote_send_skipped

            await wait_for(disaggregated_again, timeout_s=20, poll_s=0.3)
        return (out, walls, bystanders, quarantined, reports, after - before, expected,
                slow_expected, frozen)

    (out, walls, bystanders, quarantined, reports, late, expected, slow_expected,
     frozen) = run(go(), timeout_s=150)
    assert out.token_ids == slow_expected.token_ids
    assert walls and walls <= {c.address(n) for n in frozen}
    # Both half-written reservations (and any bystander's sent to a frozen node before the
    # main router heard) are held while their writers are frozen.
    assert quarantined >= len(walls)
    assert all(b.usage.route.remote_send_skipped for b in bystanders)  # frozen: not used
    assert [b.token_ids for b in bystanders] == [e.token_ids for e in expected]
    assert late >= 2  # both second halves landed (after SIGCONT), into pages still held
    assert all(full(r) for r in reports), reports

