"""`pdserve bench start`: how long a user waits for `pdserve up` (router + prefill + decode)
to print its ready line, against one `pdserve serve` node (the baseline: the least a start
that loads the model costs), both started here as commands, one after the other.

Each round starts `serve`, then `up`, on the same model and KV size, and stops each once it
is ready; the figures are the medians over `--repeats` rounds, after one `serve` start
that is not counted (it builds the C kernels and reads the checkpoint into the page cache,
as every later start finds them). `up_over_serve` is 1 when `up` costs no more than one node.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from pdserve.procs import NodeProcess

COMMANDS = {
    "serve": ["serve", "--host", "127.0.0.1", "--port", "0", "--num-threads", "1"],
    "up": ["up", "--port", "0", "--http-port", "0", "--device", "cpu", "--num-threads", "1"],
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench start", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a Hugging Face checkpoint directory")
    p.add_argument("--repeats", type=int, default=5, help="rounds of both starts (default %(default)s)")
    p.add_argument("--kv-cache-mb", type=int, default=64, help="each worker's KV pool (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print the report as JSON (else a summary)")
    return p


def ready_s(command: str, model: str, kv_cache_mb: int, log: Path) -> float:
    """Seconds from starting `pdserve COMMAND` to its ready line; the command is then stopped."""
    start = time.monotonic()
    node = NodeProcess([*COMMANDS[command], "--model", model, "--kv-cache-mb", str(kv_cache_mb)], log=log)
    try:
        node.wait_ready(600)
        return time.monotonic() - start
    finally:
        node.stop()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.repeats < 1:
        print(f"pdserve bench start: error: --repeats must be at least 1, got {args.repeats}", file=sys.stderr)
        return 2
    logs = Path(tempfile.mkdtemp(prefix="pdserve-bench-start-"))
    ready_s("serve", args.model, args.kv_cache_mb, logs / "warm-up.log")
    rounds = [{c: round(ready_s(c, args.model, args.kv_cache_mb, logs / f"{c}-{i}.log"), 3) for c in COMMANDS}
              for i in range(args.repeats)]
    medians = {c: round(statistics.median(r[c] for r in rounds), 3) for c in COMMANDS}
    report = {"benchmark": "start", "model": args.model, "repeats": args.repeats, "kv_cache_mb": args.kv_cache_mb,
              "rounds": rounds, "serve_ready_s": medians["serve"], "up_ready_s": medians["up"],
              "up_over_serve": round(medians["up"] / medians["serve"], 3), "logs": str(logs)}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"{args.model}: ready after {medians['serve']:.2f} s (serve), {medians['up']:.2f} s (up): "
              f"{report['up_over_serve']}x, medians of {args.repeats}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
