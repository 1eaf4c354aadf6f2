"""Local prefill, and every check before a reservation.

The set-up, and how a phase is reached without waiting for time: tests/decode/world.py.
"""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest

from pdserve.decode.role import LocalPrefill
from pdserve.engine import SamplingParams
from pdserve.runtime.errors import NodeDraining, NodeOverloaded, RequestAborted, status_of
from tests.decode.world import (
    BAD_SAMPLING,
    END,
    GREEDY,
    PAGES,
    PROMPT,
    PROMPT_LEN,
    RESERVED_PAGES,
    BlockedEngine,
    collect,
    free_pages,
    prepare,
    prompt_of,
    start,
    tokens_of,
    within,
)

# ---- local prefill ---------------------------------------------------------------------

def test_prepare_local_reserves_nothing_and_its_start_generates_colocated_tokens(node):
    async def go():
        role = node.role()
        expected = await node.colocated()
        prepared = await role.prepare_local(LocalPrefill("l", PROMPT, GREEDY))
        assert prepared.kv_append_metadata == [0] and prepared.lease.kv_window_end == 0
        assert await free_pages(node.decode) == PAGES and role.load().num_parked == 1
        outs = await within(collect(role.start_generation(start(prepared, expect_kv=False))))
        assert tokens_of(outs) == expected

        # generate_local, both in one call, and served from this node's prefix cache
        outs = await within(collect(role.generate_local(LocalPrefill("l2", PROMPT, GREEDY))))
        assert tokens_of(outs) == expected
        assert outs[-1].num_cached_tokens > 0
        assert role.load().requests_total == 2 and not role.busy()

    asyncio.run(go())


def test_prepare_local_of_an_empty_prompt_is_refused(node):
    async def go():
        role = node.role()
        with pytest.raises(ValueError, match="prompt is empty"):
            await role.prepare_local(LocalPrefill("l", [], GREEDY))
        assert len(role.leases) == 0

    asyncio.run(go())


@pytest.mark.parametrize(("bad", "message"), BAD_SAMPLING)
def test_sampling_values_outside_the_engine_rules_are_refused_before_anything_is_reserved(
        node, bad, message):
    async def go():
        role = node.role()
        params = SamplingParams(**{**dict(max_tokens=8, temperature=0.0), **bad})
        async with BlockedEngine(node.decode):  # reaching the engine would hang the call
            with pytest.raises(ValueError, match=message):
                await within(role.prepare_receive(prepare("r", params=params)), 2.0)
            with pytest.raises(ValueError, match=message):
                await within(role.prepare_local(LocalPrefill("l", PROMPT, params)), 2.0)
        assert len(role.leases) == 0 and role.preparing == {} and role.load().requests_total == 0
        assert await free_pages(node.decode) == PAGES

    asyncio.run(go())


@pytest.mark.parametrize(("kw", "message"), [
    pytest.param(dict(end=PROMPT_LEN), f"kv_window_end={PROMPT_LEN} is outside the prompt", id="end"),
    pytest.param(dict(lease_ms=700_000), r"lease_ms must be in \[0, 120000\].*got 700000", id="lease-long"),
    pytest.param(dict(lease_ms=-5), "got -5", id="lease-negative"),
])
def test_bad_window_end_or_lease_is_refused_before_anything_is_reserved(node, kw, message):
    async def go():
        role = node.role()
        async with BlockedEngine(node.decode):
            with pytest.raises(ValueError, match=message):
                await within(role.prepare_receive(prepare("r", **kw)), 2.0)
        assert len(role.leases) == 0 and role.preparing == {}
        assert await free_pages(node.decode) == PAGES

    asyncio.run(go())


def test_duplicate_request_id_is_refused_while_parked_or_reserving(node):
    async def go():
        role = node.role()
        await role.prepare_receive(prepare("r"))
        with pytest.raises(ValueError, match="duplicate request_id 'r'"):
            await role.prepare_receive(prepare("r"))
        with pytest.raises(ValueError, match="duplicate request_id 'r'"):
            await role.prepare_local(LocalPrefill("r", PROMPT, GREEDY))
        async with BlockedEngine(node.decode):
            reserving = asyncio.ensure_future(role.prepare_receive(prepare("s")))
            await asyncio.sleep(0)  # one pass of the loop (no time passes): it is reserving
            assert "s" in role.preparing
            with pytest.raises(ValueError, match="duplicate request_id 's'"):
                await role.prepare_receive(prepare("s"))
        await within(reserving)
        assert role.load().num_parked == 2
        assert await role.abort("r", settled=True) and await role.abort("s", settled=True)

    asyncio.run(go())


def test_abort_while_reserving_fails_the_prepare_and_frees_the_reservation(node):
    async def go():
        role = node.role()
        async with BlockedEngine(node.decode):
            reserving = asyncio.ensure_future(role.prepare_receive(prepare("r")))
            await asyncio.sleep(0)  # one pass of the loop (no time passes): it is reserving
            assert "r" in role.preparing
            assert await role.abort("r") is True
        with pytest.raises(RequestAborted, match="aborted while reserving"):
            await within(reserving)
        assert await free_pages(node.decode) == PAGES
        assert role.load().num_quarantined == 0 and not role.busy()

    asyncio.run(go())


def test_max_parked_gives_node_overloaded_until_a_reservation_ends(node):
    async def go():
        role = node.role(max_parked=2)
        await role.prepare_receive(prepare("a"))
        await role.prepare_local(LocalPrefill("b", PROMPT, GREEDY))
        with pytest.raises(NodeOverloaded, match="limit of 2 parked") as err:
            await role.prepare_receive(prepare("c"))
        assert status_of(err.value) == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(NodeOverloaded):
            await role.prepare_local(LocalPrefill("c", PROMPT, GREEDY))
        assert await free_pages(node.decode) == PAGES - RESERVED_PAGES
        assert await role.abort("a", settled=True)
        third = await role.prepare_receive(prepare("c"))
        assert third.lease.kv_window_end == END
        assert await role.abort("b", settled=True) and await role.abort("c", settled=True)

    asyncio.run(go())


LONG = 299  # a window of 38 of the 64 pages: two never fit at once


async def _in_line(role, n: int) -> None:
    await within(role.line.until_waiting(n))


def test_reservations_short_of_pages_wait_in_line_and_are_served_in_order(node):
    """A reservation that finds too few pages waits instead of being refused; one that
    comes later waits behind it even though it would fit now (first come, first served)."""
    async def go():
        role = node.role(max_parked_fraction_per_caller=1)  # the pool's bound, not the caller's
        await role.prepare_receive(prepare("a", prompt_of(300, seed=9), end=LONG))
        b = asyncio.ensure_future(role.prepare_receive(prepare("b", prompt_of(300, seed=10), end=LONG)))
        await _in_line(role, 1)
        c = asyncio.ensure_future(role.prepare_receive(prepare("c")))  # 4 pages: free now
        await _in_line(role, 2)
        assert not b.done() and not c.done()
        assert await role.abort("a", settled=True)  # frees 38 pages: b, then c
        served_c = await within(c)
        assert b.done()
        served_b = await b
        assert served_b.lease.queued_s > 0 and served_c.lease.queued_s > 0
        assert len(role.line) == 0 and role.load().num_parked == 2
        for request_id in ("b", "c"):
            assert await role.abort(request_id, settled=True)
        assert await free_pages(node.decode) == PAGES

    asyncio.run(go())


def test_a_lower_priority_number_goes_ahead_in_line_and_tries_at_once_when_better_than_all(node):
    async def go():
        role = node.role(max_parked_fraction_per_caller=1)
        await role.prepare_receive(prepare("a", prompt_of(300, seed=9), end=LONG))
        served, waiting = [], []
        # b, the head, waits for 38 pages; c would fit now but its priority is no better than
        # b's: it waits behind it, as do d and f, by priority, ties as they came
        for name, priority, prompt in [("b", 5, prompt_of(300, seed=10)), ("c", 5, PROMPT), ("d", 7, PROMPT),
                                       ("f", 6, prompt_of(30, seed=12))]:
            asked = dataclasses.replace(prepare(name, prompt, end=LONG if name == "b" else END), priority=priority)
            waiting.append(asyncio.ensure_future(role.prepare_receive(asked)))
            waiting[-1].add_done_callback(lambda _, name=name: served.append(name))
            await _in_line(role, len(waiting))
        # e's priority is better than every waiting one's: it takes the free pages at once
        await within(role.prepare_receive(dataclasses.replace(prepare("e", prompt_of(31, seed=13)), priority=0)))
        served.append("e")
        assert await role.abort("a", settled=True)  # frees 38 pages: the line is served, one at a time
        await within(asyncio.gather(*waiting))
        assert served == ["e", "b", "c", "f", "d"]
        for request_id in served:
            assert await role.abort(request_id, settled=True)
        assert await free_pages(node.decode) == PAGES

    asyncio.run(go())


def test_a_reservation_of_a_better_priority_takes_the_pages_of_a_worse_running_request(node):
    async def go():
        role = node.role(max_parked_fraction_per_caller=1)
        params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        running = prompt_of(300, seed=9)
        expected = await node.colocated(running, params)
        stream = role.generate_local(LocalPrefill("l", running, params))  # priority 0
        outs = [await within(anext(stream))]  # "l" runs, on 38 of the 64 pages
        asked = dataclasses.replace(prepare("r", prompt_of(300, seed=10), end=LONG), priority=-1)
        await within(role.prepare_receive(asked))  # no wait for "l" to end: it was preempted
        assert await node.decode.run(lambda e: e.scheduler.num_preemptions) == 1
        assert await role.abort("r", settled=True)
        outs += await within(collect(stream), 60)  # recomputed once "r" left, then on
        assert tokens_of(outs) == expected
        assert await free_pages(node.decode) == PAGES

    asyncio.run(go())


def test_the_line_is_bounded_by_its_wait_its_length_and_aborts_and_holds_nothing(node):
    async def go():
        role = node.role(max_parked_fraction_per_caller=1, max_queue_wait_s=0.3,
                         max_queued_reservations=1)
        await role.prepare_receive(prepare("a", prompt_of(300, seed=9), end=LONG))
        with pytest.raises(NodeOverloaded, match=r"waited 0\.\d s for KV pages at the head of "
                                                 r"the line \(need 38 pages, 26 free of 64\)"):
            await within(role.prepare_receive(prepare("b", prompt_of(300, seed=10), end=LONG)))
        b = asyncio.ensure_future(role.prepare_receive(prepare("b", prompt_of(300, seed=10),
                                                               end=LONG, timeout_s=30)))
        await _in_line(role, 1)
        with pytest.raises(NodeOverloaded, match="1 reservations already wait for KV pages "
                                                 r"\(limit max_queued_reservations 1\)"):
            await role.prepare_receive(prepare("c", prompt_of(300, seed=11), end=LONG))
        assert await role.abort("b")  # leaves the line at once
        with pytest.raises(RequestAborted, match="'b' was aborted while waiting for KV pages"):
            await within(b)
        assert role.preparing == {} and len(role.line) == 0 and role.load().num_parked == 1
        assert await free_pages(node.decode) == PAGES - 38
        assert await role.abort("a", settled=True)

    asyncio.run(go())


def test_draining_node_refuses_new_reservations_and_still_serves_parked_ones(node):
    async def go():
        role = node.role()
        expected = await node.colocated()
        prepared = await role.prepare_receive(prepare("r"))
        role.draining = True
        for call in (role.prepare_receive(prepare("x")),
                     role.prepare_local(LocalPrefill("y", PROMPT, GREEDY)),
                     collect(role.generate_local(LocalPrefill("z", PROMPT, GREEDY)))):
            with pytest.raises(NodeDraining, match="draining") as err:
                await call
            assert status_of(err.value) == grpc.StatusCode.UNAVAILABLE
        assert role.busy()
        await node.write_kv(prepared)
        assert tokens_of(await within(collect(role.start_generation(start(prepared))))) == expected
        assert not role.busy()

    asyncio.run(go())


def test_one_caller_holds_at_most_its_share_of_pages_in_reservations_not_started(node):
    """A caller that reserves and never starts (a hog, or a router gone wrong) is refused
    past its share, naming the bound; another caller still reserves, and the hog's freed
    share is its own again."""
    hog, other = "ipv4:10.0.0.9", "tls:router-a"

    def asked(request_id, caller, seed):
        return dataclasses.replace(prepare(request_id, prompt_of(PROMPT_LEN, seed)), caller=caller)

    async def go():
        role = node.role(max_parked_fraction_per_caller=0.25,  # 16 of 64 pages: 4 of these
                         max_queue_wait_s=0.3)
        for i in range(4):
            await role.prepare_receive(asked(f"hog-{i}", hog, seed=100 + i))
        with pytest.raises(NodeOverloaded, match=rf"caller '{hog}' holds 16 KV pages in "
                                                 r"reservations not yet started; 4 more would "
                                                 r"pass its bound of 16") as err:
            await within(role.prepare_receive(asked("hog-4", hog, seed=104)))  # waits, then no
        assert status_of(err.value) == grpc.StatusCode.RESOURCE_EXHAUSTED
        await within(role.prepare_receive(asked("fine", other, seed=200)), 0.2)  # not behind it
        waiting = asyncio.ensure_future(role.prepare_receive(asked("hog-4", hog, seed=104)))
        assert await role.abort("hog-0", settled=True)  # its own share frees: it goes on
        await within(waiting)
        for request_id in ("hog-1", "hog-2", "hog-3", "hog-4", "fine"):
            assert await role.abort(request_id, settled=True)
        assert await free_pages(node.decode) == PAGES

    asyncio.run(go())


def test_a_callers_reservations_over_its_bound_pass_in_order_and_a_lone_one_is_never_held(node):
    async def go():
        role = node.role(max_parked_fraction_per_caller=0.25, max_queue_wait_s=30)  # 16 of 64 pages
        for i in range(4):
            await role.prepare_receive(prepare(f"hog-{i}", prompt_of(PROMPT_LEN, 100 + i)))
        waiting = {}
        for name, priority in [("w1", 5), ("w2", 5), ("w3", 0), ("w4", 3)]:  # 4 pages each
            asked = dataclasses.replace(prepare(name, prompt_of(PROMPT_LEN, 200 + len(waiting))), priority=priority)
            waiting[asyncio.ensure_future(role.prepare_receive(asked))] = name
            await within(role.quota.until_waiting(len(waiting)))
        served, pending = [], set(waiting)
        for i in range(4):  # each abort makes room for one more, in order
            assert await role.abort(f"hog-{i}", settled=True)
            done, pending = await within(asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED))
            served += [waiting[f] for f in done]
        assert served == ["w3", "w4", "w1", "w2"]  # by priority, then as they came
        for request_id in served:
            assert await role.abort(request_id, settled=True)
        # a caller that holds nothing may reserve more than its share (50 pages here): the pool bounds it
        big = await within(role.prepare_receive(prepare("big", prompt_of(401, seed=7), end=400)))
        assert big.lease.kv_window_end == 400 and role.leases.parked_pages("") == 50
        assert await role.abort("big", settled=True)
        assert await free_pages(node.decode) == PAGES

    asyncio.run(go())


def test_start_without_kv_of_a_window_still_to_receive_is_refused(node):
    """Its pages were never written: generating from them (and caching them as a prefix)
    would read whatever they last held."""
    async def go():
        role = node.role()
        prepared = await role.prepare_receive(prepare("r"))
        with pytest.raises(ValueError, match=rf"positions \[0, {END}\) of request 'r' are "
                                             "reserved to be received"):
            await collect(role.start_generation(start(prepared, expect_kv=False)))
        assert role.load().num_parked == 1  # still its caller's, to start or abort
        assert await role.abort("r", settled=True)
        assert await free_pages(node.decode) == PAGES

    asyncio.run(go())


def test_a_granted_reservation_keeps_the_agent_polling_busily_for_its_lease(node):
    """The prefill node writes into a reservation at any time within its lease: the
    agent's poll must not have dropped to its idle interval meanwhile (kvtransfer/poller.py)."""
    async def go():
        role = node.role(lease_ms=12_000)
        assert node.d_agent.kept_active == []
        with pytest.raises(ValueError):
            await role.prepare_receive(dataclasses.replace(prepare("bad"), kv_window_end=10**6))
        assert node.d_agent.kept_active == [], "nothing granted, nothing expected"
        prepared = await role.prepare_receive(prepare("r"))
        assert node.d_agent.kept_active == [pytest.approx(prepared.lease_ms / 1000, rel=0.01)]
        assert await role.abort("r", settled=True) is True
        assert await free_pages(node.decode) == PAGES

    asyncio.run(go())
