"""Decode role configuration: one dataclass; its fields are the `pdserve decode` flags."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.runtime.options import option


@dataclass
class DecodeConfig:
    lease_ms: int = option(
        30_000, "how long a reservation waits for StartGeneration or Abort when the router "
                "asks for no lease; then it is freed")
    max_lease_ms: int = option(120_000, "longest lease a PrepareReceive may ask for")
    max_parked_fraction_per_caller: float = option(
        0.75, "share of the KV pages one caller (its TLS name, else its host) may hold in "
              "reservations not yet started; past it RESOURCE_EXHAUSTED (1: no bound)")
    notification_timeout_s: float = option(
        10.0, "how long StartGeneration waits for the prefill node's KV-ready notification")
    quarantine_grace_ms: int = option(
        5_000, "a reservation freed before its KV arrived keeps its pages until the prefill "
               "node's notification, or this long past its lease (decode/quarantine.py)")
    max_queue_wait_s: float = option(
        60.0, "how long a reservation that finds too few free KV pages waits for them, first "
              "come first served (never past its caller's deadline); then RESOURCE_EXHAUSTED")
    max_queued_reservations: int = option(
        1024, "reservations waiting for KV pages at once; more get RESOURCE_EXHAUSTED")
    max_parked: int = option(
        256, "reservations waiting for StartGeneration at once; more get RESOURCE_EXHAUSTED")

    def __post_init__(self) -> None:
        if not 0 < self.max_parked_fraction_per_caller <= 1:
            raise ValueError("max_parked_fraction_per_caller must be in (0, 1], got "
                             f"{self.max_parked_fraction_per_caller}")
