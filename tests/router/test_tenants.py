"""Tenants at the router, in-process: key files name tenants; a key finds its tenant; turns
go round the tenants with requests waiting (weighted, timed out and cancelled waiters
included); per-tenant queue and token-rate limits; and over gRPC with fake workers, request
ids scoped per tenant (node-side ids apart, the client's own id in every answer) and Abort
reaching only the caller's own requests."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.client import AsyncClient
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from pdserve.router.admission import Admission
from pdserve.router.config import RouterConfig
from pdserve.router.state import DispatchError, node_request_id
from pdserve.router.token_rate import TokenRate
from pdserve.router.turns import TenantTurns, parse_weights
from pdserve.runtime import auth
from pdserve.runtime.bearer import bearer_metadata
from pdserve.runtime.errors import NodeError
from pdserve.runtime.tenants import KeyRing, parse_key_file
from tests.router.fake_worker import FakeWorker, reached, run, start_router


# ---- keys and tenants ------------------------------------------------------------------
def test_a_key_file_names_tenants_and_a_bare_key_is_default():
    text = "# team keys\n\nalice: sk-alice-1\nsk-bare-2\n  bob:sk:with:colons \n"
    assert parse_key_file(text, "f") == {"alice": "sk-alice-1", "default": "sk-bare-2",
                                         "bob": "sk:with:colons"}


@pytest.mark.parametrize("text, match", [
    ("alice:k1\nbob:k1\n", "f line 2: the same key as line 1"),
    ("alice:k1\nalice:k2\n", "f line 2: tenant 'alice' is named twice"),
    ("k1\ndefault:k2\n", "f line 2: tenant 'default' is named twice"),
    ("al ice:k1\n", "f line 1: tenant name 'al ice' must be"),
    ("a/b:k1\n", "f line 1: tenant name 'a/b'"),
    ("alice:\n", "f line 1: tenant 'alice' has an empty key"),
    ("# only a comment\n\n", "f is empty"),
])
def test_a_bad_key_file_is_refused_naming_the_line_never_the_key(text, match):
    with pytest.raises(ValueError, match=match) as err:
        parse_key_file(text, "f")
    assert "k1" not in str(err.value) and "k2" not in str(err.value)


def test_a_presented_key_finds_its_tenant_or_none():
    ring = KeyRing({"alice": "sk-a", "bob": "sk-b", "default": "sk-d"})
    assert [ring.tenant_of(k) for k in ("sk-a", "sk-b", "sk-d", "sk-", "sk-a ", "", None)] == \
        ["alice", "bob", "default", None, None, None, None]
    assert "sk-a" not in repr(ring)


def test_a_client_sends_the_key_part_of_its_one_line(tmp_path):
    (tmp_path / "mine").write_text("alice:sk-alice\n")
    (tmp_path / "server").write_text("alice:sk-alice\nbob:sk-bob\n")
    assert auth.APIKeyConfig(api_key_file=str(tmp_path / "mine")).load() == "sk-alice"
    assert auth.APIKeyConfig(api_key="sk-flag").tenants() == {"default": "sk-flag"}
    with pytest.raises(ValueError, match="keys of 2 tenants; a client sends one"):
        auth.APIKeyConfig(api_key_file=str(tmp_path / "server")).load()


def test_the_grpc_tenant_comes_from_the_key(monkeypatch):
    monkeypatch.setattr(auth, "_settings", auth.Settings())
    assert auth.tenant_of(bearer_metadata("anything")) == "default"  # open: all are default
    auth.configure(None, {"alice": "sk-a", "default": "sk-d"})
    assert auth.tenant_of(bearer_metadata("sk-a")) == "alice"
    assert auth.tenant_of(bearer_metadata("sk-d")) == "default"
    with pytest.raises(NodeError, match="not this server's"):
        auth.tenant_of(bearer_metadata("sk-x"))


def test_node_side_ids_never_collide_across_tenants():
    ids = [node_request_id(t, r) for t, r in (("default", "x"), ("alice", "x"), ("bob", "x"),
                                              ("default", "x@alice"), ("alice", "x@bob"))]
    assert ids == ["x", "x@alice", "x@bob", "x@alice@default", "x@bob@alice"]
    assert len(set(ids)) == len(ids)
    with pytest.raises(ValueError, match="too long for tenant 'alice': at most 250"):
        node_request_id("alice", "r" * 251)


# ---- turns -----------------------------------------------------------------------------
async def settled(condition, max_yields: int = 10_000) -> None:
    """Let the loop run the tasks until `condition()` holds (no clock: only yields to the
    loop); fails, rather than hangs, if the tasks stop making it true."""
    for _ in range(max_yields):
        if condition():
            return
        await asyncio.sleep(0)  # a yield to the ready tasks, not a wait for time
    raise AssertionError(f"condition never held in {max_yields} turns of the loop")


async def _order(turns: TenantTurns, arrivals: list[str], priority: dict | None = None) -> list[str]:
    """Who got each turn, with `arrivals` all waiting behind one running request."""
    order: list[str] = []
    await turns.acquire("first", None)

    async def one(name: str) -> None:
        await turns.acquire(name.split("-")[0], None, (priority or {}).get(name, 0))
        order.append(name)

    tasks = []
    for name in arrivals:
        tasks.append(asyncio.ensure_future(one(name)))
        await settled(lambda: turns.waiting() == len(tasks))  # queued in this order
    for granted in range(1, len(arrivals) + 2):
        turns.release()  # the running one ends: the next turn, one at a time
        await settled(lambda: len(order) == min(granted, len(arrivals)))
    await asyncio.gather(*tasks)
    return order


def test_turns_go_round_the_tenants_not_first_come_first_served():
    flood = [f"a-{i}" for i in range(6)]
    order = run(_order(TenantTurns(1), [*flood, "b-0", "b-1", "c-0"]))
    assert order == ["a-0", "b-0", "c-0", "a-1", "b-1", "a-2", "a-3", "a-4", "a-5"]
    weighted = run(_order(TenantTurns(1, parse_weights("a=2")), [*flood, "b-0", "b-1"]))
    assert weighted == ["a-0", "a-1", "b-0", "a-2", "a-3", "b-1", "a-4", "a-5"]


def test_priority_orders_a_tenants_own_line_and_never_another_tenants_turn():
    order = run(_order(TenantTurns(1), ["a-0", "a-1", "a-2", "a-3", "b-0"],
                       {"a-1": 5, "a-2": -1, "b-0": 9}))
    assert order == ["a-2", "b-0", "a-0", "a-3", "a-1"]


def test_a_waiter_that_times_out_or_is_cancelled_takes_no_turn_and_loses_no_slot():
    async def go():
        turns = TenantTurns(1)
        await turns.acquire("a", None)
        with pytest.raises(TimeoutError):
            await turns.acquire("b", 0.01)
        cancelled = asyncio.ensure_future(turns.acquire("c", None))
        waiting = asyncio.ensure_future(turns.acquire("d", None))
        await settled(lambda: turns.waiting() == 2)
        turns.release()  # granted to c ...
        cancelled.cancel()  # ... which goes away before it runs: d takes the slot
        await asyncio.wait_for(waiting, 5)
        assert turns.running == 1 and turns.waiting() == 0
        turns.release()
        await turns.acquire("e", 0)  # a free slot is taken at once
        return turns.running

    assert run(go()) == 1


def test_bad_tenant_weights_are_refused():
    assert parse_weights("") == {} and parse_weights("a=3, b=1") == {"a": 3, "b": 1}
    for bad in ("a", "a=0", "a=x", "=2"):
        with pytest.raises(ValueError, match="TENANT=W"):
            parse_weights(bad)


# ---- admission limits ------------------------------------------------------------------
def _admission(**cfg) -> Admission:
    return Admission(RouterConfig(model="m", decode=["d:1"], **cfg))


def test_ids_are_unique_per_tenant_and_a_tenants_queue_is_bounded_alone():
    async def go():
        admission = _admission(max_concurrent_requests=1, max_queued_requests_per_tenant=2)
        running = admission.admit("r", None, "alice")
        async with admission.turn(running):
            with pytest.raises(DispatchError, match="duplicate request_id 'r'"):
                admission.admit("r", None, "alice")
            other = admission.admit("r", None, "bob")  # the same id, another tenant
            assert (other.request_id, running.request_id) == ("r@bob", "r@alice")
            waiting = [admission.admit(f"q{i}", None, "alice") for i in range(2)]
            turns = [asyncio.ensure_future(admission.turn(s).__aenter__()) for s in waiting]
            await settled(lambda: admission.turns.waiting("alice") == 2)
            with pytest.raises(DispatchError) as err:
                admission.admit("q2", None, "alice")
            admission.admit("q2", None, "bob")  # bob's line is his own
            for t in turns:
                t.cancel()
        return err.value

    err = run(go())
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.message == ("tenant 'alice' has 2 requests waiting for a turn (limit 2, "
                           "--max-queued-requests-per-tenant)")


def test_a_token_bucket_refills_at_its_rate_and_lets_a_large_request_through_once_full():
    now = [0.0]
    rate = TokenRate(10, burst_s=10, clock=lambda: now[0])  # 100 tokens a burst
    assert rate.take("a", 60) is None and rate.take("a", 40) is None
    assert rate.take("a", 5) == pytest.approx(0.5)
    assert rate.take("b", 100) is None  # each tenant its own bucket
    now[0] = 10.0
    assert rate.take("a", 500) is None  # a full bucket passes more than a burst, in debt
    now[0] = 20.0
    assert rate.take("a", 1) == pytest.approx(30.1)  # a debt of 400, 100 refilled: 301 / 10


def test_past_its_token_rate_a_tenant_is_told_when_to_retry():
    admission = _admission(tenant_token_rate=10.0)
    admission.admit("a", None, "alice", tokens=100)
    with pytest.raises(DispatchError) as err:
        admission.admit("b", None, "alice", tokens=30)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "tenant 'alice' is past its token rate (10 tokens/s" in err.value.message
    assert err.value.retry_after_s in (3, 4)  # 30 tokens at 10/s (less what refilled meanwhile)
    admission.admit("b", None, "bob", tokens=30)


# ---- over gRPC -------------------------------------------------------------------------
KEYS = {"alice": "sk-alice", "bob": "sk-bob", "default": "sk-default"}


async def _stream(addr: str, key: str, request_id: str) -> list[pdserve_pb2.GenerateResponse]:
    async with grpc.aio.insecure_channel(addr) as ch:
        call = pdserve_pb2_grpc.GenerationStub(ch).Generate(
            pdserve_pb2.GenerateRequest(request_id=request_id, prompt="hi"),
            metadata=bearer_metadata(key))
        return [m async for m in call]


async def _raw_abort(addr: str, key: str, request_id: str) -> grpc.aio.AioRpcError:
    async with grpc.aio.insecure_channel(addr) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pdserve_pb2_grpc.GenerationStub(ch).Abort(
                pdserve_pb2.AbortRequest(request_id=request_id), metadata=bearer_metadata(key))
    return err.value


def test_equal_ids_of_tenants_run_apart_and_abort_reaches_only_its_own(monkeypatch):
    monkeypatch.setattr(auth, "_settings", auth.Settings())
    auth.configure(None, KEYS)

    async def go():
        d = FakeWorker("d", matched=100)
        d.stream_gate = asyncio.Event()  # every stream waits: all are in flight at once
        addr, dispatcher, stop = await start_router([], [d])
        try:
            runs = [asyncio.ensure_future(_stream(addr, key, "same")) for key in KEYS.values()]
            victim = asyncio.ensure_future(_stream(addr, "sk-alice", "alice-only"))
            await reached(lambda: len(dispatcher.active) == 4, "four requests held")
            async with AsyncClient(addr, api_key="sk-bob") as bob:
                refused = [await bob.abort("alice-only"), await bob.abort("never-sent")]
            raw = [await _raw_abort(addr, "sk-bob", rid) for rid in ("alice-only", "never-sent")]
            d.stream_gate.set()
            outs = await asyncio.gather(*runs, victim)
            held = dict(dispatcher.active)
            d.stream_gate.clear()
            own = asyncio.ensure_future(_stream(addr, "sk-alice", "mine"))
            await reached(lambda: ("alice", "mine") in dispatcher.active, "alice's own held")
            async with AsyncClient(addr, api_key="sk-alice") as alice:
                aborted = await alice.abort("mine")
            d.stream_gate.set()  # (a fake node: its stream goes on; a real one ends it)
            await own
        finally:
            await stop()
        return refused, raw, outs, held, aborted, d

    refused, raw, outs, held, aborted, d = run(go())
    assert refused == [False, False]
    assert [e.code() for e in raw] == [grpc.StatusCode.NOT_FOUND] * 2
    assert raw[0].details().replace("alice-only", "X") == raw[1].details().replace("never-sent", "X")
    for out, rid in zip(outs, ["same"] * 3 + ["alice-only"]):  # each whole, named by its own id
        assert [t for m in out for t in m.token_ids] == [5, 6, 7]
        assert {m.request_id for m in out} == {rid}
    started = sorted(r.request_id for name, r in d.calls if name == "StartGeneration")
    assert started == ["alice-only@alice", "mine@alice", "same", "same@alice", "same@bob"]
    assert held == {}
    assert aborted is True
    assert d.aborted == ["mine@alice"]  # alice's own Abort reached it; bob's reached no node


async def _http(dispatcher, key: str, body: dict, request_id: str = "") -> tuple[int, dict, dict]:
    """POST /v1/completions to an OpenAI front over `dispatcher` keyed with KEYS."""
    import aiohttp

    from pdserve.router.openai_http import OpenAIFrontend
    from pdserve.runtime.http import start_http
    from tests.router.fake_worker import CharTokenizer

    frontend = OpenAIFrontend(dispatcher, CharTokenizer(), "fake", api_keys=KeyRing(KEYS))
    runner = await start_http(frontend.app(), "127.0.0.1", 0, "test")
    try:
        port = runner.addresses[0][1]
        headers = {"Authorization": f"Bearer {key}", "X-Request-Id": request_id}
        async with aiohttp.ClientSession() as session:
            async with session.post(f"http://127.0.0.1:{port}/v1/completions", headers=headers,
                                    json={"model": "fake", "prompt": "hi", **body}) as reply:
                return reply.status, dict(reply.headers), await reply.json()
    finally:
        await runner.cleanup()


def test_http_callers_are_their_keys_tenant_for_ids_and_token_rate():
    async def go():
        d = FakeWorker("d", matched=100)
        d.stream_gate = asyncio.Event()
        addr, dispatcher, stop = await start_router([], [d], tenant_token_rate=1.0)
        try:  # a burst is 10 tokens; "hi" + 16 max_tokens passes once, on a full bucket
            alice = asyncio.ensure_future(_http(dispatcher, "sk-alice", {}, "same"))
            await reached(lambda: ("alice", "same") in dispatcher.active, "alice's request")
            duplicate = await _http(dispatcher, "sk-alice", {"max_tokens": 1}, "same")
            wrong_key = await _http(dispatcher, "sk-nobody", {}, "same")
            bob = asyncio.ensure_future(_http(dispatcher, "sk-bob", {}, "same"))
            await reached(lambda: ("bob", "same") in dispatcher.active, "bob's request")
            d.stream_gate.set()
            served = [await alice, await bob]
            over_rate = await _http(dispatcher, "sk-bob", {"max_tokens": 1}, "again")
        finally:
            await stop()
        return duplicate, wrong_key, served, over_rate, d

    duplicate, wrong_key, served, over_rate, d = run(go())
    assert duplicate[0] == 400 and "duplicate request_id 'same'" in duplicate[2]["error"]["message"]
    assert wrong_key[0] == 401
    assert [(s[0], s[2]["id"]) for s in served] == [(200, "cmpl-same")] * 2  # the own id
    started = sorted(r.request_id for name, r in d.calls if name == "StartGeneration")
    assert started == ["same@alice", "same@bob"]
    status, headers, body = over_rate
    assert status == 429 and "tenant 'bob' is past its token rate" in body["error"]["message"]
    assert 5 <= int(headers["Retry-After"]) <= 15  # bob's bucket: 10 - 18 tokens, +1/s
