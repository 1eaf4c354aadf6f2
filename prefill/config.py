"""Prefill role configuration: one dataclass, built from `pdserve prefill` flags."""

from __future__ import annotations

from dataclasses import dataclass

from engine import EngineConfig


@dataclass
class PrefillConfig:
    engine: EngineConfig
    host: str = "0.0.0.0"
    port: int = 50061
    # Deadline of one request's NIXL writes to a decode node (a RemoteSend's own gRPC
    # deadline shortens it further).
    transfer_timeout_s: float = 30.0
    # RemoteSends worked on at once; past it RESOURCE_EXHAUSTED (the router then lets the
    # decode node prefill itself).
    max_in_flight: int = 64
    # On SIGTERM: how long in-flight work may take to finish before the node stops.
    drain_timeout_s: float = 30.0
    # Test-only delays (hidden flags, see prefill/role.py), applied to RemoteSends whose
    # request id starts with `debug_delay_prefix`.
    debug_delay_prefill_ms: int = 0
    debug_delay_kv_write_ms: int = 0
    debug_delay_prefix: str = ""
