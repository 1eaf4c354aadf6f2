"""The world of the decode role's in-process tests: a real engine with a FakeAgent whose
notifications the tests post, and their helpers.

DecodeRole in one process: a real decode engine, a FakeAgent instead of NIXL, and a
second engine standing in for the prefill node (it computes the KV that a FakeAgent
write puts into the reserved slots, and that write posts the KV-ready tag).

Checked exactly: StartGeneration waits for the tag (the inbox pump polls the fake agent)
and then streams what a colocated engine generates; every refusal raises its error with
its status; and every way a reservation ends frees its pages at the right moment: at once
when no write can come, only after the notification or the no-write notice when one may
(quarantine). Lease expiry is driven by calling `leases.expire`, the quarantine deadline
by a `FakeClock`; only the KVNotArrived tests wait (briefly) for a timeout, since the
timeout is what they test. Every test leaves the pools full (checked by `node`).
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from pdserve.decode.config import DecodeConfig
from pdserve.decode.role import DecodeRole, PrepareReceive, StartGeneration
from pdserve.engine import AsyncEngine, EngineConfig, SamplingParams
from pdserve.kvtransfer.layout import KVLayout
from pdserve.kvtransfer.metadata import decode_append_metadata
from pdserve.kvtransfer.plan import plan_transfer
from pdserve.proto.tags import notification_tag
from tests.fake_agent import FakeFabric

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PAGE, PAGES = 8, 64
PROMPT_LEN, END = 29, 28
RESERVED_PAGES = -(-END // PAGE)  # pages one reservation of [0, END) holds
WAIT_S = 10.0  # bound on waits that a correct role ends at once; reached only on failure
SHORT_S = 0.05  # the KV notification bound of the tests that expect it to pass


def prompt_of(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (n,), generator=g).tolist()


PROMPT = prompt_of(PROMPT_LEN, seed=5)


async def within(awaitable, timeout_s: float = WAIT_S):
    return await asyncio.wait_for(awaitable, timeout_s)


async def free_pages(engine: AsyncEngine) -> int:
    return await engine.run(lambda e: e.num_free_pages())


async def collect(stream) -> list:
    return [out async for out in stream]


def tokens_of(outs) -> list[int]:
    assert outs and outs[-1].finished
    return outs[-1].token_ids


class Node:
    """One test's world: the decode engine and its FakeAgent, a source engine (the
    prefill node's) with its FakeAgent, and a colocated engine for reference tokens."""

    def __init__(self, model_dir: str) -> None:
        self.model_dir = model_dir
        self.fabric = FakeFabric()
        self.engines: list[AsyncEngine] = []
        self.roles: list[DecodeRole] = []
        self.decode = self.engine()
        self.source = self.engine()
        self.d_agent = self.fabric.agent("decode-agent", self.decode.engine.kv_cache)
        self.p_agent = self.fabric.agent("prefill-agent", self.source.engine.kv_cache)
        self.p_agent.add_remote(self.d_agent.metadata())
        self.d_layout = KVLayout.from_tensor(self.decode.engine.kv_cache, PAGE)
        self.p_layout = KVLayout.from_tensor(self.source.engine.kv_cache, PAGE)

    def engine(self) -> AsyncEngine:
        engine = AsyncEngine(EngineConfig(model_dir=self.model_dir, page_size=PAGE,
                                          num_pages=PAGES, num_threads=1))
        self.engines.append(engine)
        return engine

    def role(self, **config) -> DecodeRole:
        e = self.decode.engine
        role = DecodeRole(self.decode, self.d_agent, DecodeConfig(**config), e.vocab_size,
                          e.max_model_len, page_size=PAGE)
        self.roles.append(role)
        return role

    async def colocated(self, prompt: list[int] = PROMPT, params: SamplingParams = GREEDY):
        engine = self.engine()
        return tokens_of([out async for out in engine.generate("colocated", prompt, params)])

    async def write_kv(self, prepared, prompt: list[int] = PROMPT, tag: bytes | None = None):
        """What a prefill node does for a reservation: compute prompt[:end] on the source
        engine, write the window into the reserved slots, the tag coming with the write."""
        lease = prepared.lease
        pid = f"src-{lease.lease_id}"
        params = SamplingParams(max_tokens=1, temperature=0.0)
        async for _ in self.source.generate(pid, prompt[:lease.kv_window_end], params,
                                            prefill_only=True):
            pass
        try:
            src = await self.source.run(lambda e: e.slots_of(pid))
            plan = plan_transfer(self.p_layout, src[lease.prefix_matched_length:lease.kv_window_end],
                                 self.d_layout, decode_append_metadata(prepared.kv_append_metadata))
            assert plan.num_tokens == lease.kv_window_end - lease.prefix_matched_length
            await asyncio.to_thread(self.p_agent.write, self.d_agent.name, plan,
                                    tag or notification_tag(lease.request_id, lease.lease_id), WAIT_S)
        finally:
            await self.source.run(lambda e: e.release(pid))

    def post(self, tag: bytes) -> None:
        """A standalone notification from the prefill node (a no-write notice, or a
        KV-ready tag whose writes are not modelled)."""
        self.p_agent.send_notification(self.d_agent.name, tag)

    async def polled(self, times: int = 2) -> None:
        """The inbox pump took notifications `times` more times: whoever waits saw them."""
        assert await asyncio.to_thread(self.d_agent.wait_polled, self.d_agent.polls + times, WAIT_S)




def prepare(request_id: str = "r", prompt: list[int] = PROMPT, end: int = END,
            params: SamplingParams = GREEDY, lease_ms: int = 0,
            writer_address: str = "", timeout_s: float | None = None) -> PrepareReceive:
    return PrepareReceive(request_id, prompt, params, end, lease_ms, writer_address,
                          timeout_s=timeout_s)


def start(prepared, expect_kv: bool = True, timeout_s: float | None = None,
          begin: int | None = None) -> StartGeneration:
    lease = prepared.lease
    return StartGeneration(lease.request_id, lease.lease_id,
                           lease.kv_window_end if begin is None else begin, expect_kv, timeout_s)


async def quarantine_ended(role: DecodeRole) -> None:
    """Every quarantine watch has ended (each frees its reservation as it ends); a watch
    that already ended on its own, when the late write landed first, counts too."""
    await within(asyncio.gather(*list(role.quarantine._tasks)))
    assert role.load().num_quarantined == 0


async def expired(role: DecodeRole, lease) -> None:
    """Expire `lease` now, as its timer would, and wait for the expiry handler."""
    role.leases.expire(lease)
    await within(asyncio.gather(*list(role.leases._expiring)))


# ---- admission -----------------------------------------------------------------------------

class BlockedEngine:
    """Holds the decode engine's thread in a command: a call that reaches the engine
    cannot finish until `release`, a call refused before it is unaffected."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.entered, self.released = threading.Event(), threading.Event()
        self.task = None

    async def __aenter__(self):
        def hold(_):
            self.entered.set()
            self.released.wait(WAIT_S)
        self.task = asyncio.ensure_future(self.engine.run(hold))
        assert await asyncio.to_thread(self.entered.wait, WAIT_S)
        return self

    async def __aexit__(self, *exc):
        self.released.set()
        await within(self.task)


BAD_SAMPLING = [
    pytest.param(dict(temperature=-1.0), "temperature must be >= 0", id="temperature"),
    pytest.param(dict(top_p=0.0), r"top_p must be in \(0, 1\]", id="top_p"),
    pytest.param(dict(top_k=-2), "top_k must be", id="top_k"),
    pytest.param(dict(min_p=1.5), r"min_p must be in \[0, 1\]", id="min_p"),
    pytest.param(dict(max_tokens=0), "max_tokens must be an integer >= 1", id="max_tokens"),
    pytest.param(dict(max_tokens=513), r"max_tokens must be in \[1, 512\]", id="max_tokens-context"),
    pytest.param(dict(n=17), r"n must be an integer in \[1, 16\]", id="n"),
    pytest.param(dict(stop_token_ids=[512]), r"token ids in \[0, 512\), got 512", id="stop_token_ids"),
    pytest.param(dict(logprobs=21), r"logprobs must be None or an integer in \[0, 20\]", id="logprobs"),
    pytest.param(dict(seed=-1), "seed must be", id="seed"),
]
