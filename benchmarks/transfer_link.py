"""``pdserve bench transfer --link RATE[,DELAY]``: the transfer benchmark across a network link.

On one machine two NIXL agents talk through shared memory or CMA, which says nothing
about a prefill and a decode node on two hosts. With ``--link`` this process makes a
``Link`` (``link.py``: two network namespaces, a veth shaped by tc) and re-executes the
benchmark as the sender inside host a (``pdserve.launch`` setns, as ``ip netns exec`` does);
that sender starts its receiver inside host b. Both NIXL agents are created in their
namespaces with ``Host.ucx_env()``: UCX's TCP transport on ``pd0`` only. Invariants:
- The result is the sender's, plus the link: ``link_gbit`` and ``link_delay_ms`` (what tc
  allows), ``kv_gbit``/``raw_nixl_gbit`` (achieved, Gbit/s: ``kv_gbps`` is GB/s), and
  ``link_fraction`` = KV Gbit/s / link rate (``raw_link_fraction`` for the raw write).
- ``verified`` also requires that the bytes really crossed the link: the veth's a->b
  byte counter must grow by at least the payload the benchmark wrote (warm-ups, timed
  writes and the verification write). Traffic that took another path (shared memory,
  loopback) would leave it short.
- Over TCP a WRITE lands only as fast as the receiver's UCX worker progresses (UCX's TCP
  PUT is received by the target's worker): between two polls the receiver's socket
  buffer fills and the sender stalls. With ``TransferAgent``'s 10 ms poll that measured
  2.4-4.0 Gbit/s at 10gbit and 25gbit (about 4 MB per poll; ``--receiver-poll-ms 10``);
  so the receiver, like a decode node, runs NIXL's progress thread, which shows the link
  (UCX's TCP buffer, poll-batch and segment sizes did not help).
- Nothing outlives the run: the sender is a child with a death signal, its receiver
  exits with it, and leaving the ``Link`` checks that no process is left in either host.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from pdserve.benchmarks.link import Link, LinkError, rate_bits
from pdserve import launch

TABLE = ("bytes", "descriptors", "link_gbit", "link_delay_ms", "raw_nixl_gbit", "kv_gbit", "link_fraction",
         "raw_link_fraction", "efficiency", "link_bytes_a_to_b", "verified")


def _written(result: dict[str, Any], repeats: int) -> int:
    """Payload bytes the sender wrote: per window size, 2 warm-ups, 2 per repeat, 1 check."""
    points = result.get("sweep") or [result]
    return sum(p["bytes"] * (3 + 2 * repeats) for p in points)


def link_fields(result: dict[str, Any], rate: str, delay_ms: float, a_to_b: int, b_to_a: int,
                repeats: int) -> dict[str, Any]:
    """The link's share of the result (see the module docstring)."""
    link_bits = rate_bits(rate)
    kv_bits, raw_bits = result["kv_gbps"] * 8e9, result["raw_nixl_gbps"] * 8e9
    payload = _written(result, repeats)
    return {
        "link": f"{rate},{delay_ms:g}ms" if delay_ms else rate,
        "link_gbit": link_bits / 1e9,
        "link_delay_ms": delay_ms,
        "kv_gbit": round(kv_bits / 1e9, 4),
        "raw_nixl_gbit": round(raw_bits / 1e9, 4),
        "link_fraction": round(kv_bits / link_bits, 4),
        "raw_link_fraction": round(raw_bits / link_bits, 4),
        "link_payload_bytes": payload,
        "link_bytes_a_to_b": a_to_b,
        "link_bytes_b_to_a": b_to_a,
        "link_carried_payload": a_to_b >= payload,
        "verified": bool(result["verified"]) and a_to_b >= payload,
    }


def _sender(link: Link, argv: list[str]) -> dict[str, Any]:
    """Run the benchmark as the sender in host a, its receiver in host b; its JSON result."""
    sender, receiver = link.hosts
    env = dict(os.environ, **sender.ucx_env())
    argv = [sys.executable, "-m", "pdserve.benchmarks.transfer", *argv, "--json", "--receiver-netns", receiver.ns]
    proc = subprocess.run(launch.command(argv, parent_death=signal.SIGTERM, netns=sender.ns),
                          env=env, stdout=subprocess.PIPE, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"the sender in {sender.ns} exited with {proc.returncode} and no result")
    return json.loads(lines[-1])


def run_over_link(a: argparse.Namespace, argv: list[str]) -> int:
    rate, delay_ms = a.link
    reason = Link.unavailable(delay_ms)
    if reason is not None:
        print(f"pdserve bench transfer --link: {reason}", file=sys.stderr)
        return 2
    try:
        with Link(rate, delay_ms) as link:
            before = [h.counters() for h in link.hosts]
            result = _sender(link, argv)
            after = [h.counters() for h in link.hosts]
    except (LinkError, RuntimeError) as err:
        print(f"pdserve bench transfer --link: {err}", file=sys.stderr)
        return 1
    result.update(link_fields(result, rate, delay_ms, after[0]["tx_bytes"] - before[0]["tx_bytes"],
                              after[1]["tx_bytes"] - before[1]["tx_bytes"], a.repeats))
    if a.json:
        print(json.dumps(result))
    else:
        for k in TABLE:
            print(f"{k:>18}: {result[k]}")
    return 0 if result["verified"] else 1
