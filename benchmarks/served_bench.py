"""What the benches that run real nodes on this host and ask them through a router share
(`pdserve bench priority`, `pdserve bench cache-key`): their flags, the wait for a router's
first answer, and the report, printed and written."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from pdserve.benchmarks.model_choice import add_model_flag
from pdserve.client import AsyncClient, PdserveError
from pdserve.results import Completion


def add_flags(p) -> None:
    """The model and the nodes' dtype; --json and --out for the report."""
    add_model_flag(p)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16",
                   help="the nodes' dtype (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print the report as JSON (else a summary)")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")


async def first_answer(client: AsyncClient, timeout_s: float) -> Completion:
    """The first answer once the router sees its nodes (it serves before they load)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await client.generate("warm up", max_tokens=2, temperature=0.0)
        except PdserveError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.3)


def emit(report: dict, args, readable) -> None:
    """Print `report` (as JSON with --json, else `readable(report)`), and write it to --out."""
    text = json.dumps(report, indent=2)
    print(text if args.json else readable(report))
    if args.out is not None:
        args.out.write_text(text + "\n")
