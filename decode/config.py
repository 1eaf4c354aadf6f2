"""Decode role configuration: one dataclass; its fields are the `pdserve decode` flags."""

from __future__ import annotations

from dataclasses import dataclass

from runtime.options import option


@dataclass
class DecodeConfig:
    lease_ms: int = option(
        30_000, "how long a reservation waits for StartGeneration or Abort when the router "
                "asks for no lease; then it is freed")
    max_lease_ms: int = option(600_000, "longest lease a PrepareReceive may ask for")
    notification_timeout_s: float = option(
        10.0, "how long StartGeneration waits for the prefill node's KV-ready notification")
    quarantine_grace_ms: int = option(
        5_000, "a reservation freed before its KV arrived keeps its pages until the prefill "
               "node's notification, or this long past its lease (decode/quarantine.py)")
    max_parked: int = option(
        256, "reservations waiting for StartGeneration at once; more get RESOURCE_EXHAUSTED")
