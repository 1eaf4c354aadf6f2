"""The world of the prefill role's in-process tests: a real prefill engine with a FakeAgent, a
real receiving engine whose reserved slots the role writes into, and their helpers.

PrefillRole in one process: a real prefill engine, a FakeAgent instead of NIXL, and a
real receiving engine whose reserved slots the role writes into (no gRPC, no subprocess).

Checked exactly: the bytes that land (every layer, K and V) and the bytes that must not
change, the notification each outcome posts, when the source pages are pinned and
released, and the error every refusal raises. A write is held "in flight" by the fake
agent, a phase is reached through `runtime.gates.Gates`, an engine hook or a wrapper of
the engine, and a lease or deadline passes on a `FakeClock`: nothing waits for time.
Every test leaves both pools full (checked by the `nodes` fixture).
"""

from __future__ import annotations

import asyncio
import threading
import time

import torch

from pdserve.engine import AsyncEngine, EngineConfig, SamplingParams
from pdserve.kvtransfer.layout import KVLayout
from pdserve.kvtransfer.metadata import encode_append_metadata
from pdserve.prefill.config import PrefillConfig
from pdserve.prefill.peers import PeerInfo, PeerRef
from pdserve.prefill.requests import Window
from pdserve.prefill.role import PrefillRole
from pdserve.proto.tags import no_write_tag
from pdserve.runtime.gates import Gates
from pdserve.runtime.identity import host_id
from tests.fake_agent import FakeFabric

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
LEASE = "lease-1"
P_PAGE, P_PAGES = 8, 64    # the prefill engine's pool: 512 slots
D_PAGE, D_PAGES = 4, 128   # the receiving engine's pool: 512 slots in smaller pages
PROMPT_LEN, END = 29, 28   # window [matched, 28): the decode side computes the last token
WAIT_S = 10.0  # bound on waits that a correct role ends at once; reached only on failure
GATED = "g-"   # request ids starting with this stop at the role's gates


def prompt_of(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (n,), generator=g).tolist()


PROMPT = prompt_of(PROMPT_LEN, seed=7)


def at_slots(kv: torch.Tensor, slots: list[int], page_size: int) -> torch.Tensor:
    """[len(slots), layers, 2, Hkv, D]: every layer's K and V of `slots` in a page-major pool."""
    s = torch.tensor(slots, dtype=torch.int64)
    return kv[s // page_size, :, :, s % page_size]


def with_slots(kv: torch.Tensor, slots: list[int], page_size: int, values) -> torch.Tensor:
    out = kv.clone()
    s = torch.tensor(slots, dtype=torch.int64)
    out[s // page_size, :, :, s % page_size] = values
    return out


async def within(awaitable, timeout_s: float = WAIT_S):
    return await asyncio.wait_for(awaitable, timeout_s)


async def kv_of(engine: AsyncEngine) -> torch.Tensor:
    return await engine.run(lambda e: e.kv_cache.clone())


async def free_pages(engine: AsyncEngine) -> tuple[int, int]:
    return await engine.run(lambda e: (e.num_free_pages(), e.num_total_pages()))


async def engine_requests(engine: AsyncEngine) -> list[str]:
    return await engine.run(lambda e: list(e.requests))


async def generate_tokens(engine: AsyncEngine, request_id: str, prompt: list[int]) -> list[int]:
    last = None
    async for out in engine.generate(request_id, prompt, GREEDY):
        last = out
    assert last.finished and last.finish_reason == "length"
    return last.token_ids


async def started_tokens(engine: AsyncEngine, key: str) -> list[int]:
    last = None
    async for out in engine.start_generation(key):
        last = out
    assert last.finished and last.finish_reason == "length"
    return last.token_ids


async def drained(role: PrefillRole) -> None:
    """Every no-write notice the role queued has been sent (its sender pool is done)."""
    await asyncio.to_thread(role._writers.shutdown, True)


class Nodes:
    """One test's world: a prefill engine + FakeAgent, a receiving engine + FakeAgent on
    the same fabric, and the roles the test builds."""

    def __init__(self, model_dir: str) -> None:
        self.model_dir = model_dir
        self.fabric = FakeFabric()
        self.engines: list[AsyncEngine] = []
        self.roles: list[PrefillRole] = []
        self.prefill, self.p_agent, self.p_layout = self.prefill_node("prefill-agent")
        self.decode = self.engine(D_PAGE, D_PAGES)
        self.d_agent = self.fabric.agent("decode-agent", self.decode.engine.kv_cache)
        self.d_layout = KVLayout.from_tensor(self.decode.engine.kv_cache, D_PAGE)

    def engine(self, page_size: int = P_PAGE, num_pages: int = P_PAGES, **kw) -> AsyncEngine:
        engine = AsyncEngine(EngineConfig(model_dir=self.model_dir, page_size=page_size,
                                          num_pages=num_pages, num_threads=1, **kw))
        self.engines.append(engine)
        return engine

    def prefill_node(self, agent_name: str, **kw):
        engine = self.engine(P_PAGE, P_PAGES, **kw)
        agent = self.fabric.agent(agent_name, engine.engine.kv_cache)
        return engine, agent, KVLayout.from_tensor(engine.engine.kv_cache, P_PAGE)

    def role(self, gates: Gates | None = None, node=None, **config) -> PrefillRole:
        engine, agent, layout = node or (self.prefill, self.p_agent, self.p_layout)
        role = PrefillRole(engine, agent, layout, PrefillConfig(**config), gates=gates)
        self.roles.append(role)
        return role

    def peer(self) -> PeerRef:
        # On this host: `--kv-send auto` writes whole windows to it (tests ask for layerwise).
        info = PeerInfo(self.d_agent.name, self.d_agent.metadata(), self.d_layout, host_id())
        return PeerRef(self.d_agent.name, "decode.invalid:50051", info)

    async def reserve(self, key: str, prompt: list[int] = PROMPT, end: int = END):
        return await self.decode.run(lambda e: e.prepare_receive(key, prompt, GREEDY, end))

    async def unreserve(self, key: str) -> None:
        assert await self.decode.abort(key)

    def window(self, res, lease_id: str = LEASE, expires_in_s: float = 60.0,
               clock=time) -> Window:
        return Window(res.prefix_matched_length, encode_append_metadata(res.slots), lease_id,
                      self.peer(), clock.monotonic() + expires_in_s)

    async def no_write_notice(self, request_id: str, lease_id: str = LEASE) -> bool:
        return await asyncio.to_thread(self.d_agent.wait_notification,
                                       no_write_tag(request_id, lease_id), WAIT_S)

    async def sent_kv_while_held(self, hold, request_id: str, begin: int, end: int = END,
                                 engine: AsyncEngine | None = None) -> torch.Tensor:
        """The sender's KV of positions [begin, end), read while the write is held (the
        request's pages are then pinned, so its slots are still its own)."""
        engine = engine or self.prefill
        assert await asyncio.to_thread(hold.started.wait, WAIT_S), "no write started"
        src = await engine.run(lambda e: e.slots_of(request_id))
        assert len(src) == end
        return at_slots(await kv_of(engine), src[begin:end], P_PAGE)




async def fill_pools(nodes: Nodes) -> None:
    """Sentinels: a byte copied from an unused source slot, or written outside the window,
    shows up in the exact comparisons."""
    await nodes.prefill.run(lambda e: e.kv_cache.fill_(-3.0))
    await nodes.decode.run(lambda e: e.kv_cache.fill_(7.0))


# ---- the overlapped kind ---------------------------------------------------------------

class PrefillWatch:
    """The prefill engine as the role sees it, telling the test when a request's prefill
    stream has ended and optionally holding the role there (pages prefilled and pinned,
    nothing written yet)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self.prefilled: dict[str, asyncio.Event] = {}
        self.resume: dict[str, asyncio.Event] = {}

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def event(self, request_id: str) -> asyncio.Event:
        return self.prefilled.setdefault(request_id, asyncio.Event())

    async def generate(self, request_id, prompt, params, **options):
        async for out in self._engine.generate(request_id, prompt, params, **options):
            yield out
        self.event(request_id).set()
        if request_id in self.resume:
            await self.resume[request_id].wait()


def hold_in_forward(request_id: str):
    """An engine layer hook that stops the engine thread in the middle of `request_id`'s
    forward pass (layer 0) until `proceed` is set; `reached` says it got there."""
    reached, proceed = threading.Event(), threading.Event()

    def hook(layer: int, ranges) -> None:
        if layer == 0 and any(r[0] == request_id for r in ranges) and not reached.is_set():
            reached.set()
            proceed.wait(WAIT_S)

    return hook, reached, proceed
