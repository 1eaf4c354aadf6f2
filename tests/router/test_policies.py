"""Routing policies, the prefix index and the selective-disaggregation rule, on plain
endpoints (no network)."""

from __future__ import annotations

from pdserve.runtime.identity import NodeIdentity
from pdserve.router import selective
from pdserve.router.policies import LeastLoaded, PrefixAware, RoundRobin, keyed_endpoint, make_policy
from pdserve.router.prefix_index import PrefixIndex
from pdserve.router.registry import Endpoint


def _eps(*queues, role="decode"):
    out = []
    for i, q in enumerate(queues):
        e = Endpoint(f"n{i}:1", role)
        e.reported_queue = q
        e.prefixes = PrefixIndex(block=4)
        out.append(e)
    return out


def test_round_robin_takes_each_in_turn():
    eps = _eps(0, 0, 0)
    rr = RoundRobin()
    assert [rr.pick(eps, [1]).address for _ in range(4)] == ["n0:1", "n1:1", "n2:1", "n0:1"]


def test_least_loaded_counts_reports_and_own_requests_and_breaks_ties_by_free_pages():
    eps = _eps(3, 1, 1)
    eps[1].in_flight = 1            # our own request, not yet in n1's report: queue 2
    eps[2].free_pages = 10          # n2: queue 1
    assert LeastLoaded().pick(eps, [1]).address == "n2:1"
    eps[2].in_flight_at_report = 1  # n2's report already counted our request: still 1
    eps[2].in_flight = 1
    assert eps[2].queue == 1


def test_prefix_index_matches_whole_blocks_of_the_longest_recorded_prefix():
    index = PrefixIndex(block=4, capacity=3)
    index.insert(list(range(10)))  # blocks [0..3], [4..7]
    assert index.match(list(range(12))) == 8
    assert index.match([0, 1, 2, 3, 9, 9, 9, 9]) == 4
    assert index.match([1, 2, 3, 4]) == 0  # hashes chain: a block stands for its whole prefix
    index.insert([7] * 8)
    assert len(index) == 3  # bounded: the oldest block went
    assert index.match(list(range(8))) == 0  # its first block was the oldest


def test_prefix_aware_weighs_the_cached_prefix_against_load():
    prompt = list(range(64))
    eps = _eps(0, 0)
    eps[1].prefixes.insert(prompt[:32])
    policy = PrefixAware(load_tokens=16)
    assert policy.pick(eps, prompt).address == "n1:1"   # 32 cached tokens win
    eps[1].reported_queue = 1
    assert policy.pick(eps, prompt).address == "n1:1"   # 32 - 16 still better
    eps[1].reported_queue = 3
    assert policy.pick(eps, prompt).address == "n0:1"   # 48 tokens of queue outweigh 32
    eps[0].reported_queue, eps[1].reported_queue = 0, 20
    assert PrefixAware(load_tokens=0).pick(eps, prompt).address == "n0:1"  # imbalanced


def test_make_policy_names_the_choices():
    assert isinstance(make_policy("prefix_aware", load_tokens=4), PrefixAware)
    try:
        make_policy("random")
    except ValueError as err:
        assert "least_loaded" in str(err)
    else:
        raise AssertionError("unknown policy accepted")


def test_selective_plan_skips_remote_send_when_decode_lacks_little_or_prefill_is_saturated():
    prompt = list(range(40))
    d, p = _eps(0)[0], _eps(0, role="prefill")
    assert selective.plan(prompt, -1, d, p, [d]) == selective.Plan(-1, 39)
    assert selective.plan(prompt, -1, d, [], [d]).reason == "no_prefill"
    assert selective.plan(prompt, 0, d, p, [d]).reason == "requested"
    d.prefixes.insert(prompt[:32])  # D holds 32: lacks 7 of the window [0, 39)
    assert selective.plan(prompt, -1, d, p, [d], min_remote_prefill_tokens=8).reason == "short_window"
    assert not selective.plan(prompt, -1, d, p, [d], min_remote_prefill_tokens=6).local
    p[0].reported_queue = 5
    plan = selective.plan(prompt, -1, d, p, [d], prefill_saturated_queue=5)
    assert plan.local and plan.reason == "prefill_saturated"


def test_a_prefill_node_whose_sends_take_half_the_lease_is_saturated_while_work_waits():
    prompt = list(range(40))
    d, p = _eps(0)[0], _eps(0, role="prefill")
    p[0].send_latency_s = 16.0  # recent sends took about 16 s
    p[0].reported_queue = 1
    plan = selective.plan(prompt, -1, d, p, [d], saturated_s=15.0)
    assert plan.local and plan.reason == "prefill_saturated"
    assert not selective.plan(prompt, -1, d, p, [d], saturated_s=0).local  # off
    p[0].reported_queue = 0  # its queue drained: it gets work again, and fresh figures
    assert not selective.plan(prompt, -1, d, p, [d], saturated_s=15.0).local


def _steps(backlog=0, decodes=4, decode_ms=50.0, token_ms=5.0, target_ms=125.0):
    from pdserve.proto import pdserve_pb2
    return pdserve_pb2.LoadReport(num_decoding=decodes, prompt_backlog_tokens=backlog,
                                  decode_step_ms=decode_ms, prompt_token_ms=token_ms,
                                  itl_target_ms=target_ms)


def test_steady_sends_a_prompt_to_an_idle_decode_node_that_finishes_no_later_than_prefill():
    prompt = list(range(1000))
    d, p = _eps(0)[0], _eps(0, role="prefill")
    p[0].send_latency_s, p[0].reported_queue = 16.0, 3  # saturated: sends take 16 s
    # D prefills 1000 tokens at 5 ms each in the 75 ms its 125 ms target leaves per 50 ms
    # decode step: 5 s * 125/75 = 8.3 s, sooner than the prefill node's 16 s; but it has
    # streams running, which its chunks would slow: the request waits.
    d.steps = _steps(backlog=0)
    assert selective.local_prefill_s(d.steps, 1000) == 5.0 * 125 / 75
    assert selective.plan(prompt, -1, d, p, [d], saturated_s=15.0, steady=True).wait
    d.steps = _steps(backlog=0, decodes=0)  # no stream: 5 s, it takes the prompt
    plan = selective.plan(prompt, -1, d, p, [d], saturated_s=15.0, steady=True)
    assert plan.local and plan.reason == "prefill_saturated"
    d.steps = _steps(backlog=3000, decodes=0)  # 20 s with what it already has: it waits
    plan = selective.plan(prompt, -1, d, p, [d], saturated_s=15.0, steady=True)
    assert plan.wait and not plan.local
    # Throughput sends it to D regardless; an unmeasured D is tried, so it learns.
    assert selective.plan(prompt, -1, d, p, [d], saturated_s=15.0).local
    d.steps = None
    assert selective.plan(prompt, -1, d, p, [d], saturated_s=15.0, steady=True).local
    d.steps = _steps(backlog=10**6)  # a prefill node with room takes it, as always
    p[0].reported_queue = 0
    assert selective.plan(prompt, -1, d, p, [d], saturated_s=15.0, steady=True) == \
        selective.Plan(-1, 999)


def test_a_send_still_in_flight_counts_as_slow_as_it_is_old(monkeypatch):
    """A queue that grows shows before any of its sends ends."""
    import pdserve.router.registry

    now = [100.0]
    monkeypatch.setattr(pdserve.router.registry.time, "monotonic", lambda: now[0])
    p = _eps(0, role="prefill")[0]
    token = p.send_started()
    now[0] = 120.0
    assert p.send_wait_s == 20.0 and p.send_latency_s == 0.0
    p.send_ended(token)
    assert p.send_latency_s == 0.3 * 20.0 and p.send_wait_s == 6.0
    untimed = p.send_started()
    p.send_ended(untimed, timed=False)  # cancelled: not a measure of the node
    assert p.send_latency_s == 6.0


def test_auto_window_lets_decode_prefill_more_of_the_tail_when_prefill_queues_are_longer():
    assert selective.auto_tail(101, 0, 0) == 1        # idle prefill: the usual split
    assert selective.auto_tail(101, 4, 0) == 1 + 40   # 100 * 0.5 * 4/5
    assert selective.auto_tail(101, 4, 4) == 1 + 22
    d, p = _eps(2)[0], _eps(8, role="prefill")
    plan = selective.plan(list(range(101)), "auto", d, p, [d])
    assert plan.kv_window_end == -selective.auto_tail(101, 8, 2) and plan.end == 101 + plan.kv_window_end


def test_identity_differences_name_each_field():
    a = NodeIdentity("m", "h1", "float32", 2, 2, 16, 8)
    b = NodeIdentity("m2", "h2", "bfloat16", 2, 4, 16, 16)
    diffs = a.differences(b)
    assert diffs == ["model (m vs m2): h1 vs h2", "dtype: float32 vs bfloat16", "num_kv_heads: 2 vs 4"]
    assert a.differences(NodeIdentity("m", "", "float32", 2, 2, 16, 32)) == []  # page size may differ
    # The same checkpoint (the hash before "+"), other LoRA adapters: said so, with what to do.
    lora = NodeIdentity("m", "h1+a1", "float32", 2, 2, 16, 8)
    assert lora.differences(NodeIdentity("m", "h1+b2", "float32", 2, 2, 16, 8))[0].startswith("LoRA adapters: ")
    assert lora.differences(a)[0].startswith("LoRA adapters: h1+a1 vs h1 (the same checkpoint, other adapters): "
                                             "start both nodes with the same --lora-modules")


def test_a_key_names_one_endpoint_in_any_order_and_only_its_own_keys_move_when_it_leaves():
    eps = _eps(0, 0, 0, 0)
    chosen = {k: keyed_endpoint(eps, f"key-{k}").address for k in range(64)}
    assert {k: keyed_endpoint(eps[::-1], f"key-{k}").address for k in range(64)} == chosen  # no order, no state
    assert len(set(chosen.values())) == 4  # keys spread over the pool
    gone = eps[1]
    after = {k: keyed_endpoint([e for e in eps if e is not gone], f"key-{k}").address for k in range(64)}
    assert {k for k in chosen if after[k] != chosen[k]} == {k for k in chosen if chosen[k] == gone.address}
    assert keyed_endpoint(eps, "key-0", salt="tenant-b") is not None  # the salt is part of the key
    salted = {k: keyed_endpoint(eps, f"key-{k}", salt="tenant-b").address for k in range(64)}
    assert salted != chosen


def test_a_keys_endpoint_badly_overloaded_is_passed_over():
    eps = _eps(0, 0)
    name = keyed_endpoint(eps, "k").address
    busy = next(e for e in eps if e.address == name)
    busy.reported_queue = 8  # busier by 8: not past the rule (more than 8, and 1.5 times)
    assert keyed_endpoint(eps, "k") is busy
    busy.reported_queue = 9
    assert keyed_endpoint(eps, "k") is None
    next(e for e in eps if e is not busy).reported_queue = 7  # 9 is not 1.5 times 7
    assert keyed_endpoint(eps, "k") is busy
