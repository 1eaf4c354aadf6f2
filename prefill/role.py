"""The prefill role: compute a prompt's KV and push the window [begin, end) to a decode node.

Preconditions checked before any work: 0 <= begin < end < len(prompt), and the append
metadata names exactly end - begin slots inside the decode node's pool. The engine never
samples here (prefill_only); the request's pages stay pinned until the write has
completed or failed, then are released (full pages stay in the prefix cache). The
notification is posted by the agent only after every write completed.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from engine import SamplingParams
from kvtransfer.metadata import decode_append_metadata, validate_append_metadata
from kvtransfer.plan import plan_transfer
from kvtransfer.window import resolve_kv_window
from prefill.config import PrefillConfig
from proto.tags import notification_tag


@dataclass
class SendResult:
    num_tokens_sent: int
    num_bytes: int
    num_descriptors: int
    prefill_cached_tokens: int
    prefill_s: float
    transfer_s: float


class PrefillRole:
    def __init__(self, engine, agent, layout, config: PrefillConfig) -> None:
        self.engine = engine  # AsyncEngine
        self.agent = agent    # TransferAgent
        self.layout = layout  # this node's KVLayout
        self.config = config
        self.in_flight: set[str] = set()
        self._writers = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kv-write")
        self.remote_sends_total = 0
        self.last_kv_window_begin = 0
        self.kv_bytes_sent_total = 0

    async def remote_send(self, request_id: str, prompt_token_ids: list[int], begin: int,
                          end: int, kv_append_metadata: list[int], lease_id: str,
                          peer) -> SendResult:
        begin, end = resolve_kv_window(begin, end, len(prompt_token_ids))
        validate_append_metadata(kv_append_metadata, end - begin, peer.layout.num_slots)
        dst_slots = decode_append_metadata(kv_append_metadata)
        if request_id in self.in_flight:
            raise ValueError(f"duplicate request_id {request_id!r}")
        self.in_flight.add(request_id)
        try:
            t0 = time.perf_counter()
            last = None
            params = SamplingParams(max_tokens=1, temperature=0.0)
            async for out in self.engine.generate(request_id, prompt_token_ids[:end], params,
                                                  prefill_only=True):
                last = out
            if last is None or last.finish_reason != "prefilled":
                raise RuntimeError(f"prefill of {request_id!r} ended with "
                                   f"{getattr(last, 'finish_reason', None)!r}")
            t1 = time.perf_counter()
            src_slots = await self.engine.run(lambda e: e.slots_of(request_id))
            plan = plan_transfer(self.layout, src_slots[begin:end], peer.layout, dst_slots)
            await asyncio.get_running_loop().run_in_executor(
                self._writers, self.agent.write, peer.agent_name, plan,
                notification_tag(request_id, lease_id), self.config.transfer_timeout_s)
            t2 = time.perf_counter()
        finally:
            self.in_flight.discard(request_id)
            await self.engine.run(lambda e: e.release(request_id))
        self.remote_sends_total += 1
        self.last_kv_window_begin = begin
        self.kv_bytes_sent_total += plan.total_bytes
        return SendResult(end - begin, plan.total_bytes, plan.num_descriptors,
                          last.num_cached_tokens, t1 - t0, t2 - t1)

    async def abort(self, request_id: str) -> bool:
        if request_id not in self.in_flight:
            return False
        await self.engine.abort(request_id)
        return True

    def stats(self) -> dict:
        return {"num_running": len(self.in_flight), "remote_sends_total": self.remote_sends_total,
                "last_kv_window_begin": self.last_kv_window_begin,
                "kv_bytes_sent_total": self.kv_bytes_sent_total}

    def close(self) -> None:
        self._writers.shutdown(wait=False, cancel_futures=True)
