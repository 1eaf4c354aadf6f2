"""DNS discovery: a `dns:///NAME:PORT` target is one endpoint per address of NAME, kept
up to date; static targets stay as given; a failed lookup keeps the last addresses."""

from __future__ import annotations

import asyncio

from pdserve.router.discovery import DnsDiscovery, resolve
from pdserve.router.policies import RoundRobin
from pdserve.router.registry import WorkerRegistry


def _registry() -> WorkerRegistry:
    return WorkerRegistry([], [], RoundRobin(), RoundRobin())


def test_a_name_resolves_to_one_endpoint_per_address():
    assert asyncio.run(resolve("dns:///127.0.0.1:50062")) == ["127.0.0.1:50062"]
    assert asyncio.run(resolve("dns:///::1:7")) == ["[::1]:7"]


def test_refresh_adds_and_removes_replicas_and_keeps_the_ones_that_stay(monkeypatch):
    answers = {"dns:///decode:50062": ["10.0.0.1:50062", "10.0.0.2:50062"]}

    async def fake_resolve(target):
        if target not in answers:
            raise OSError("Name or service not known")
        return answers[target]

    monkeypatch.setattr("pdserve.router.discovery.resolve", fake_resolve)
    registry = _registry()
    discovery = DnsDiscovery(registry, ["static:50061"], ["dns:///decode:50062"])

    async def scenario():
        assert discovery.needed
        await discovery.refresh()
        assert [e.address for e in registry.prefill] == ["static:50061"]
        assert [e.address for e in registry.decode] == ["10.0.0.1:50062", "10.0.0.2:50062"]
        kept = registry.decode[1]
        kept.routable = False  # state set by health checks survives a refresh

        answers["dns:///decode:50062"] = ["10.0.0.2:50062", "10.0.0.3:50062"]  # scaled
        await discovery.refresh()
        assert [e.address for e in registry.decode] == ["10.0.0.2:50062", "10.0.0.3:50062"]
        assert registry.decode[0] is kept and not kept.routable

        del answers["dns:///decode:50062"]  # DNS hiccup: keep what we had
        await discovery.refresh()
        assert [e.address for e in registry.decode] == ["10.0.0.2:50062", "10.0.0.3:50062"]
        await registry.close()

    asyncio.run(scenario())


def test_static_targets_need_no_discovery():
    assert not DnsDiscovery(_registry(), ["p:1"], ["d:2"]).needed
