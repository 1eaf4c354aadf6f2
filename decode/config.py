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
    # StartGeneration waits at most this long for the prefill node's KV-ready notification.
    notification_timeout_s: float = 10.0
