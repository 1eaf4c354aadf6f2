"""Decode role configuration: one dataclass, built from `pdserve decode` flags."""

from __future__ import annotations

from dataclasses import dataclass

from engine import EngineConfig


@dataclass
class DecodeConfig:
    engine: EngineConfig
    host: str = "0.0.0.0"
    port: int = 50062
    # A reservation is freed if neither StartGeneration nor Abort comes within its lease;
    # this is the lease when PrepareReceive asks for none.
    lease_ms: int = 30_000
    # The longest lease a PrepareReceive may ask for (longer ones are refused).
    max_lease_ms: int = 600_000
    # StartGeneration waits at most this long for the prefill node's KV-ready notification.
    notification_timeout_s: float = 10.0
    # A reservation freed before its KV arrived keeps its pages until the prefill node's
    # notification, or until this long after its lease's end (see decode/quarantine.py).
    quarantine_grace_ms: int = 5_000
    # Reservations parked at once (waiting for StartGeneration); past it RESOURCE_EXHAUSTED.
    max_parked: int = 256
    # On SIGTERM: how long in-flight work may take to finish before the node stops.
    drain_timeout_s: float = 30.0
