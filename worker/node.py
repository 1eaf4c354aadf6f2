"""What one worker process holds: its engine, its NIXL agent and KV layout, its model
identity and the roles it serves (a `both` node holds both). The roles share the engine
and the agent; the node's `stop` event ends the process (drain first, then exit)."""

from __future__ import annotations

import asyncio


class Node:
    def __init__(self, role: str, engine, agent, layout, identity, prefill=None,
                 decode=None) -> None:
        self.role, self.engine, self.agent, self.layout = role, engine, agent, layout
        self.identity = identity  # runtime.identity.NodeIdentity
        self.prefill, self.decode = prefill, decode  # PrefillRole / DecodeRole or None
        self.roles = [r for r in (prefill, decode) if r is not None]
        self.kernels = None  # engine.native.KernelStatus of a CPU node, else None
        self.stop = asyncio.Event()  # set by the Drain RPC (or a signal): drain, then exit
