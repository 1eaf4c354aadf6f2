"""The prefix-cache probe of issue 38, replayed on a real cluster, and refused.

A victim sends a known header, a secret block (one of ten values) and a tail. An attacker
sends the header with each guess and reads `usage.cached_prompt_tokens` and
`route.prefix_matched_length` (and the prefill node's `prefill_cached_tokens`): with one
shared cache the right guess shows the secret's pages as cached. Salted per tenant, or by a
different `cache_salt`, every guess reads the same. The cache still works for its owner:
the victim's own repeat is a hit. `--shared-prefix-cache` (a second router) is the control:
tenants share, and the same probe finds the secret, so the probe can tell.
"""

from __future__ import annotations

import json
import random
import urllib.error
import urllib.request

import pytest

from pdserve.client import AsyncClient
from pdserve.procs import free_port
from tests.cluster.nodes import WORKER_FLAGS, Cluster, run

KEYS = {"alice": "sk-alice-cache-salt-test", "bob": "sk-bob-cache-salt-test"}
HEADER, SECRET, TAIL = 32, 16, 16  # tokens; pages are 8 (WORKER_FLAGS)
GUESSES = 10


class SaltCluster(Cluster):
    """prefill + decode; router `main` (tenants alice and bob, OpenAI HTTP) and router
    `shared` (the same keys, --shared-prefix-cache) over the same two workers."""

    def build(self) -> None:
        (self.logs / "api.keys").write_text("".join(f"{t}:{k}\n" for t, k in KEYS.items()))
        common = ["--model", self.model, "--host", "127.0.0.1"]
        for role in ("prefill", "decode"):
            self.start(role, [role, *common, *WORKER_FLAGS], wait=False)
        self.wait("prefill", "decode")
        http_port = free_port()
        routed = [*common, "--api-key-file", str(self.logs / "api.keys"),
                  "--prefill", self.address("prefill"), "--decode", self.address("decode")]
        self.start("main", ["router", *routed, "--http-port", str(http_port)], wait=False)
        self.start("shared", ["router", *routed, "--shared-prefix-cache"], wait=False)
        self.wait("main", "shared")
        self.http = f"http://127.0.0.1:{http_port}"


@pytest.fixture(scope="module")
def salted(tiny_model, tmp_path_factory):
    cluster = SaltCluster(tmp_path_factory.mktemp("cache-salt-logs"), tiny_model)
    try:
        cluster.build()
        yield cluster
    finally:
        cluster.stop()


def blocks(seed: int):
    """(header, ten secret candidates, tail, which one is the victim's): fresh token ids per
    test, so no test sees another's cached pages."""
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(3, 500) for _ in range(n)]  # noqa: E731
    return ids(HEADER), [ids(SECRET) for _ in range(GUESSES)], ids(TAIL), rng.randrange(GUESSES)


async def seen(client: AsyncClient, prompt: list[int], **kwargs) -> tuple[int, int, int]:
    """What one request tells of the caches: (cached_prompt_tokens, prefix_matched_length,
    the prefill node's own hit)."""
    out = await client.generate(prompt, max_tokens=1, temperature=0.0, **kwargs)
    route = out.usage.route
    if route is None:  # a colocated node: no router, no route
        return out.usage.cached_prompt_tokens, -1, -1
    return out.usage.cached_prompt_tokens, route.prefix_matched_length, route.prefill_cached_tokens


async def probe(victim: AsyncClient, attacker: AsyncClient, seed: int, victim_salt: str = "",
                attacker_salt: str = "") -> tuple[list, tuple, tuple, int]:
    """The attack: the victim's request, the attacker's warm-up (its own header cached, so
    every guess starts alike), then every guess, each followed by a tail of its own (so a
    shared cache would show exactly the header and the secret). (what each guess saw, the
    victim's repeat, the victim's first, the secret's index)."""
    header, secrets, tail, which = blocks(seed)
    victims = header + secrets[which] + tail
    first = await seen(victim, victims, cache_salt=victim_salt)
    own_tail = [2] * TAIL
    await seen(attacker, header + [1] * SECRET + own_tail, cache_salt=attacker_salt)
    guesses = [await seen(attacker, header + guess + own_tail, cache_salt=attacker_salt)
               for guess in secrets]
    again = await seen(victim, victims, cache_salt=victim_salt)
    return guesses, again, first, which


def assert_nothing_learned(guesses, which):
    cached = [g[0] for g in guesses]
    matched = [g[1] for g in guesses]
    # The attacker sees its own header, the same for the right guess and every wrong one.
    assert set(cached) == {HEADER} and set(matched) == {HEADER}, (which, guesses)
    # The prefill node's hit: the header, or 0 where D prefilled the request itself (a
    # loaded machine may skip the prefill node, router/selective.py).
    assert {g[2] for g in guesses} <= {0, HEADER}, (which, guesses)


def assert_cache_still_works(again, first):
    assert first[0] == 0
    full_pages = (HEADER + SECRET + TAIL - 1) // 8 * 8  # all but the last token's page
    assert again[0] == full_pages and again[1] == full_pages, again


def test_another_tenant_learns_nothing_from_the_prefix_cache(salted):
    async def go():
        async with AsyncClient(salted.address("main"), api_key=KEYS["alice"]) as alice, \
                AsyncClient(salted.address("main"), api_key=KEYS["bob"]) as bob:
            return await probe(alice, bob, seed=1)

    guesses, again, first, which = run(go())
    assert_nothing_learned(guesses, which)
    assert_cache_still_works(again, first)


def test_another_cache_salt_of_the_same_tenant_learns_nothing(salted):
    async def go():
        async with AsyncClient(salted.address("main"), api_key=KEYS["alice"]) as alice:
            return await probe(alice, alice, seed=2, victim_salt="victim", attacker_salt="probe")

    guesses, again, first, which = run(go())
    assert_nothing_learned(guesses, which)
    assert_cache_still_works(again, first)


def test_a_shared_prefix_cache_is_shared_so_the_probe_can_tell(salted):
    async def go():
        async with AsyncClient(salted.address("shared"), api_key=KEYS["alice"]) as alice, \
                AsyncClient(salted.address("shared"), api_key=KEYS["bob"]) as bob:
            return await probe(alice, bob, seed=3)

    guesses, again, first, which = run(go())
    cached = [g[0] for g in guesses]
    # The operator chose to share: the right guess shows the secret's pages as cached.
    assert cached[which] == HEADER + SECRET and \
        all(c == HEADER for i, c in enumerate(cached) if i != which), (which, guesses)
    assert guesses[which][1] == HEADER + SECRET
    assert_cache_still_works(again, first)


def test_the_colocated_node_salts_by_the_requests_cache_salt(colocated):
    async def go():
        async with AsyncClient(colocated.address) as client:
            return await probe(client, client, seed=4, attacker_salt="probe")

    guesses, again, first, which = run(go())
    assert [g[0] for g in guesses] == [HEADER] * GUESSES, (which, guesses)
    assert first[0] == 0 and again[0] == (HEADER + SECRET + TAIL - 1) // 8 * 8


def post(cluster, body: dict, key: str) -> tuple[int, dict]:
    request = urllib.request.Request(
        cluster.http + "/v1/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_openai_cache_salt_splits_the_cache_and_a_bad_one_is_400(salted):
    header, secrets, tail, _ = blocks(5)
    prompt = header + secrets[0] + tail
    body = {"model": "ignored", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    cached = []
    for salt in ("a", "b", "a"):
        status, reply = post(salted, {**body, "model": models(salted), "cache_salt": salt},
                             KEYS["alice"])
        assert status == 200, reply
        cached.append(reply["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert cached == [0, 0, (len(prompt) - 1) // 8 * 8]
    for bad in ("", 7):
        status, reply = post(salted, {**body, "model": models(salted), "cache_salt": bad},
                             KEYS["alice"])
        assert status == 400 and reply["error"]["param"] == "cache_salt", reply


def models(cluster) -> str:
    request = urllib.request.Request(cluster.http + "/v1/models",
                                     headers={"Authorization": f"Bearer {KEYS['alice']}"})
    with urllib.request.urlopen(request, timeout=30) as reply:
        return json.loads(reply.read())["data"][0]["id"]
