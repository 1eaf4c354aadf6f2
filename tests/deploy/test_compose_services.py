"""deploy/docker-compose.yml, run as local processes wired like the containers: every
service starts from its own command and environment, passes its own health check, and a
request through the published router port streams an answer made by prefill and decode."""

from __future__ import annotations

import asyncio

from pdserve.client import Client


def test_every_service_starts_from_its_command_and_environment_and_turns_healthy(compose):
    assert set(compose.services) == set(compose.compose["services"])
    for name, service in compose.services.items():
        result = service.healthcheck()
        assert result.returncode == 0, f"{name}: {result.stdout}{result.stderr}"
        assert "SERVING" in result.stdout


def test_router_streams_an_answer_through_dns_discovered_prefill_and_decode(compose):
    router = compose.services["router"]
    container_ports = [int(p.rsplit(":", 1)[-1]) for p in router.spec["ports"]]
    assert container_ports == [compose.ports["router"][0]], "publish the port the router serves"

    async def ask():
        async with Client(router.address) as client:
            return [msg async for msg in client.stream("the quick brown fox", max_tokens=8,
                                                       temperature=0.0, ignore_eos=True,
                                                       timeout=60)]

    messages = asyncio.run(ask())
    tokens = [t for m in messages for t in m.token_ids]
    assert len(tokens) == 8
    assert len(messages) >= 2, "the answer should stream, not arrive in one message"
    assert [m.finish_reason for m in messages if m.finish_reason] == ["length"]
    final = messages[-1]
    assert final.HasField("usage"), "the stream ends with the usage message"
    route = final.usage.route
    assert route.prefill_endpoint == compose.services["prefill"].address
    assert route.decode_endpoint == compose.services["decode"].address
    assert not route.remote_send_skipped


def test_model_volume_is_the_mounted_directory(compose, tiny_model):
    for name, service in compose.services.items():
        assert service.env["PDSERVE_MODEL"] == tiny_model, name
