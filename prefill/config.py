"""Prefill role configuration: one dataclass, built from `pdserve prefill` flags."""

from __future__ import annotations

from dataclasses import dataclass

from engine import EngineConfig


@dataclass
class PrefillConfig:
    engine: EngineConfig
    host: str = "0.0.0.0"
    port: int = 50061
    # Deadline of one request's NIXL writes to a decode node.
    transfer_timeout_s: float = 30.0
