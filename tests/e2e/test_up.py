"""`pdserve up` is cheap to keep running: first answer within 15 s of start, and the idle
cluster (router + prefill + decode) uses under 5% of one core in total."""

from __future__ import annotations

import time

from pdserve.client import Client
from tests.e2e.conftest import run
from tests.e2e.procs import Node, cpu_seconds

IDLE_WINDOW_S = 10.0


def test_up_answers_within_15s_and_idles_under_5_percent_of_a_core(tiny_model, tmp_path):
    start = time.monotonic()
    node = Node(["up", "--model", tiny_model, "--port", "0"], tmp_path / "up.log")
    try:
        async def ask():
            async with Client(node.address) as client:
                return await client.complete("hello", max_tokens=4, temperature=0.0)

        out = run(ask())
        first_answer_s = time.monotonic() - start
        assert len(out.token_ids) >= 1

        pids = node.pids()
        assert len(pids) >= 4  # up + router + prefill + decode
        time.sleep(2.0)  # let start-up work settle
        before = cpu_seconds(pids)
        time.sleep(IDLE_WINDOW_S)
        idle_core_fraction = (cpu_seconds(pids) - before) / IDLE_WINDOW_S
        print(f"\npdserve up: first answer after {first_answer_s:.2f} s; idle CPU "
              f"{100 * idle_core_fraction:.2f}% of one core over {IDLE_WINDOW_S:.0f} s "
              f"({len(pids)} processes)")
        assert first_answer_s < 15.0, f"first answer after {first_answer_s:.2f} s"
        assert idle_core_fraction < 0.05, f"idle CPU {100 * idle_core_fraction:.2f}% of a core"
    finally:
        node.stop()
