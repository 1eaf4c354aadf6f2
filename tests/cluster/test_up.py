"""`pdserve up` is cheap to keep running: first answer within 15 s of start, and the idle
cluster (router + prefill + decode) uses under 5% of one core in total."""

from __future__ import annotations

import os
import time
from pathlib import Path

from pdserve.client import Client
from pdserve.procs import NodeProcess
from tests.cluster.nodes import run

IDLE_WINDOW_S = 3.0
SETTLE_S = 1.0  # start-up work (imports, first allocations) is not idle time


def cpu_seconds(pids: list[int]) -> float:
    """utime + stime of these processes, in seconds."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / tick


def test_up_answers_within_15s_and_idles_under_5_percent_of_a_core(tiny_model, tmp_path):
    start = time.monotonic()
    node = NodeProcess(["up", "--model", tiny_model, "--port", "0"], log=tmp_path / "up.log")
    try:
        node.wait_ready()

        async def ask():
            async with Client(node.address) as client:
                return await client.complete("hello", max_tokens=4, temperature=0.0)

        out = run(ask())
        first_answer_s = time.monotonic() - start
        assert len(out.token_ids) >= 1

        pids = node.pids()
        assert len(pids) >= 4  # up + router + prefill + decode
        time.sleep(SETTLE_S)
        before = cpu_seconds(pids)
        time.sleep(IDLE_WINDOW_S)  # the thing measured: CPU used while nothing happens
        idle_core_fraction = (cpu_seconds(pids) - before) / IDLE_WINDOW_S
        print(f"\npdserve up: first answer after {first_answer_s:.2f} s; idle CPU "
              f"{100 * idle_core_fraction:.2f}% of one core over {IDLE_WINDOW_S:.0f} s "
              f"({len(pids)} processes)")
        assert first_answer_s < 15.0, f"first answer after {first_answer_s:.2f} s"
        assert idle_core_fraction < 0.05, f"idle CPU {100 * idle_core_fraction:.2f}% of a core"
    finally:
        node.stop()
