"""`pdserve bench trust --attacks tenants`: issue 38's attacks of one tenant on another,
replayed against a real cluster (prefill + decode + a router whose `--api-key-file` names
the tenants alice and bob, `--max-concurrent-requests 2`), all on 127.0.0.1. Each attack is
a row, as in trust_transport.py: what was tried, against which configuration, what
happened, and whether it was refused.

- bob aborts alice's running request by its id (NOT_FOUND, her stream completes whole);
- bob takes an id first (alice's request with it is served; bob's own second use of it is
  refused, as ids are unique per tenant).
  In these two the decode node holds the streams after their first token (`--test-gates`),
  so they are running when the attacker acts, however fast the machine generates;
- the prefix-cache probe: alice sends header + one of ten secret blocks + tail, bob sends
  header + each guess and reads `cached_prompt_tokens` / `prefix_matched_length` (all
  alike). Its control, in the same row: a second router with `--shared-prefix-cache` (the
  operator's documented opt-in to sharing) over the same workers, where the right guess
  shows, so the probe can tell when there is something to tell;
- alice floods the 2 slots; each of bob's short requests waits at most one turn per
  active tenant (bound: 2 x her longest run), while at least half her flood is still
  unfinished after his last (so the bound is not met by an emptied queue).
The tests that assert the same: tests/cluster/test_tenants.py and test_cache_salt.py.
"""

from __future__ import annotations

import asyncio
import random
import secrets
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc

from pdserve.client import AsyncClient
from pdserve.procs import NodeProcess, free_port, stop_all
from pdserve.proto import pdserve_pb2, testing_pb2, testing_pb2_grpc
from pdserve.results import PdserveError
from pdserve.router.state import node_request_id
from pdserve.runtime.server import channel

HOST = "127.0.0.1"
TENANTS = ("alice", "bob")
SLOTS = 2  # the router's --max-concurrent-requests: few, so a flood queues
WORKER = ["--num-threads", "1", "--num-pages", "256", "--page-size", "8"]
GREEDY = dict(temperature=0.0, ignore_eos=True)
HELD, TOKENS = "held-", 8  # ids the decode node holds after their first token
HEADER, SECRET, TAIL, GUESSES = 32, 16, 16, 10  # tokens (pages of 8): the probe
FLOOD, FLOOD_TOKENS, SHORT = 40, 64, 3


class Target:
    """The cluster: prefill, decode, router `main` (the tenants, 2 slots, /metrics) and
    router `shared` (the same keys, --shared-prefix-cache) over the same two workers."""

    def __init__(self, model: str, d: Path, nodes: list[NodeProcess]) -> None:
        self.keys = {t: f"sk-{t}-{secrets.token_hex(8)}" for t in TENANTS}
        (d / "api.keys").write_text("".join(f"{t}:{k}\n" for t, k in self.keys.items()))
        common = ["--model", model, "--host", HOST, "--port", "0"]

        def start(name: str, args: list[str]) -> NodeProcess:
            node = NodeProcess([*args, *common], log=d / f"{name}.log")
            nodes.append(node)
            return node

        workers = [start("prefill", ["prefill", *WORKER, "--metrics-port", "0"]),
                   start("decode", ["decode", *WORKER, "--metrics-port", "0",
                                    "--test-gates", HELD])]
        for node in workers:
            node.wait_ready()
        self.decode = workers[1]
        routed = ["router", "--api-key-file", str(d / "api.keys"), "--prefill",
                  workers[0].address, "--decode", workers[1].address]
        self.http_port = free_port()
        self.main = start("router", [*routed, "--max-concurrent-requests", str(SLOTS),
                                     "--http-port", str(self.http_port)])
        self.shared = start("router-shared", [*routed, "--shared-prefix-cache"])
        self.main.wait_ready()
        self.shared.wait_ready()
        self.config = (f"router: --api-key-file (alice:KEY, bob:KEY) --max-concurrent-requests "
                       f"{SLOTS}; prefill + decode: --page-size 8, decode --test-gates {HELD} "
                       f"(holds streams with that id prefix after their first token); all on "
                       f"{HOST}")

    def client(self, tenant: str, shared: bool = False) -> AsyncClient:
        node = self.shared if shared else self.main
        return AsyncClient(node.address, api_key=self.keys[tenant])

    def in_router(self) -> float:
        """Requests the main router holds, running or queued (its /metrics)."""
        url = f"http://{HOST}:{self.http_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as reply:
            for line in reply.read().decode().splitlines():
                if line.startswith("pdserve_queue_depth{") and 'queue="in_flight"' in line:
                    return float(line.split()[-1])
        return 0.0


async def _abort(client: AsyncClient, request_id: str) -> tuple[str, str]:
    """(status, details) of a raw Abort: the client's own `abort` hides the words."""
    try:
        await client.stub.Abort(pdserve_pb2.AbortRequest(request_id=request_id),
                                metadata=client.metadata, timeout=30)
        return "OK", ""
    except grpc.aio.AioRpcError as err:
        return err.code().name, err.details() or ""


async def _gate(t: Target, tenant: str, rid: str, opened: bool) -> None:
    """Wait until the decode node holds `rid` of `tenant` after its first token, or let it
    go on (runtime/gates.py)."""
    gate = testing_pb2.Gate(phase="stream", request_id=node_request_id(tenant, rid))
    async with channel(t.decode.address) as ch:
        stub = testing_pb2_grpc.GatesStub(ch)
        await (stub.Open(gate, timeout=30) if opened else stub.Reached(gate, timeout=60))


class Stream:
    """A greedy stream consumed in the background, held by the decode node after its first
    token until `release` (so it is running, whatever the machine's speed)."""

    def __init__(self, t: Target, client: AsyncClient, tenant: str, rid: str,
                 max_tokens: int) -> None:
        self.t, self.tenant, self.rid = t, tenant, rid
        self.tokens: list[int] = []
        self.finish = ""
        self.task = asyncio.ensure_future(self._run(client, max_tokens))

    async def _run(self, client: AsyncClient, max_tokens: int) -> None:
        async for msg in client.responses(f"a job of {self.tenant}'s", request_id=self.rid,
                                          max_tokens=max_tokens, timeout=120, **GREEDY):
            self.tokens.extend(msg.token_ids)
            self.finish = self.finish or msg.finish_reason

    async def running(self) -> "Stream":
        await _gate(self.t, self.tenant, self.rid, opened=False)
        return self

    async def release(self) -> "Stream":
        await _gate(self.t, self.tenant, self.rid, opened=True)
        await self.task
        return self


async def cross_tenant_abort(t: Target) -> dict:
    rid = f"{HELD}alice-job"
    async with t.client("alice") as alice, t.client("bob") as bob:
        victim = await Stream(t, alice, "alice", rid, TOKENS).running()
        attack, never = await _abort(bob, rid), await _abort(bob, "never-sent")
        held = await asyncio.to_thread(t.in_router)  # hers, still in the router after it
        await victim.release()
    same_words = attack[1].replace(rid, "ID") == never[1].replace("never-sent", "ID")
    refused = (attack[0] == never[0] == "NOT_FOUND" and same_words and held == 1
               and len(victim.tokens) == TOKENS and victim.finish == "length")
    return {"attack": "bob aborts alice's running request by its id", "refused": refused,
            "outcome": f"{attack[0]}, in the same words as for an id never sent"
                       f"{'' if same_words else ' (NOT: the words differ)'}; the router held "
                       f"{held:.0f} request (hers) after it; alice's stream completed with "
                       f"{len(victim.tokens)} of {TOKENS} tokens (finish {victim.finish!r})"}


async def id_squatting(t: Target) -> dict:
    rid = f"{HELD}job-1"
    async with t.client("alice") as alice, t.client("bob") as bob:
        squat = await Stream(t, bob, "bob", rid, TOKENS).running()
        hers = await Stream(t, alice, "alice", rid, TOKENS).running()  # admitted: it runs
        try:
            await bob.generate("bob again", request_id=rid, max_tokens=8, timeout=120)
            bobs = "served"
        except PdserveError as err:
            bobs = str(err)
        for stream in (hers, squat):
            await stream.release()
    refused = (len(hers.tokens) == TOKENS and hers.finish == "length"
               and len(squat.tokens) == TOKENS and "duplicate request_id" in bobs)
    return {"attack": "bob takes a request id first, then alice sends hers with it",
            "refused": refused,
            "outcome": f"alice's request ran beside bob's under the same id and completed "
                       f"({len(hers.tokens)} of {TOKENS} tokens, finish {hers.finish!r}; his "
                       f"{len(squat.tokens)}); bob's own second use of the id, refused as "
                       f"expected (ids are unique per tenant): {bobs}"}


def _blocks(seed: int):
    """(header, ten secret candidates, tail, the victim's index): fresh token ids per
    probe, so one probe never sees another's cached pages."""
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(3, 500) for _ in range(n)]  # noqa: E731
    return ids(HEADER), [ids(SECRET) for _ in range(GUESSES)], ids(TAIL), rng.randrange(GUESSES)


async def _seen(client: AsyncClient, prompt: list[int]) -> tuple[int, int]:
    out = await client.generate(prompt, max_tokens=1, timeout=120, temperature=0.0)
    return out.usage.cached_prompt_tokens, out.usage.route.prefix_matched_length


async def _probe(t: Target, shared: bool, seed: int) -> tuple[list[tuple[int, int]], int]:
    """The issue's probe: alice's request, bob's warm-up (his own header cached, so every
    guess starts alike), then each guess with a tail of bob's. (what each guess saw, the
    right guess's index)."""
    header, guesses, tail, which = _blocks(seed)
    async with t.client("alice", shared) as alice, t.client("bob", shared) as bob:
        await _seen(alice, header + guesses[which] + tail)
        own_tail = [2] * TAIL
        await _seen(bob, header + [1] * SECRET + own_tail)
        return [await _seen(bob, header + g + own_tail) for g in guesses], which


def _told(seen: list[tuple[int, int]], which: int) -> str:
    right, wrong = seen[which], sorted(set(s for i, s in enumerate(seen) if i != which))
    return f"right guess {right}, wrong guesses {wrong} (cached_prompt_tokens, prefix_matched)"


async def prefix_probe(t: Target) -> dict:
    salted, which = await _probe(t, shared=False, seed=1)
    control, shared_which = await _probe(t, shared=True, seed=2)
    others = [c for i, c in enumerate(control) if i != shared_which]
    can_tell = all(control[shared_which][0] > c[0] for c in others)
    refused = len(set(salted)) == 1 and can_tell
    return {"attack": f"bob probes the prefix cache for alice's secret block (1 of {GUESSES})",
            "refused": refused,
            "outcome": f"{_told(salted, which)}: "
                       f"{'no guess is' if len(set(salted)) == 1 else 'the right guess is'} "
                       f"distinguishable. Control, the "
                       f"documented opt-in --shared-prefix-cache (a second router, same "
                       f"workers): {_told(control, shared_which)}"}


async def flood(t: Target) -> dict:
    loop = asyncio.get_running_loop()

    async def timed(client: AsyncClient, prompt: str, max_tokens: int):
        sent = loop.time()
        out = await client.generate(prompt, max_tokens=max_tokens, timeout=300, **GREEDY)
        return sent, loop.time(), out

    async with t.client("alice") as alice, t.client("bob") as bob:
        floods = [asyncio.ensure_future(timed(alice, f"flood {i}", FLOOD_TOKENS))
                  for i in range(FLOOD)]
        deadline = time.monotonic() + 60
        while await asyncio.to_thread(t.in_router) < FLOOD // 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)  # most of the flood in the router before bob comes
        bobs = [await timed(bob, f"short {i}", 2) for i in range(SHORT)]
        alices = await asyncio.gather(*floods)
    runs = sorted(done - sent - out.usage.queue_time_s for sent, done, out in alices)
    turn = runs[-1]  # one request's turn: alice's longest run once dispatched
    bound = len(TENANTS) * turn
    waits = [out.usage.queue_time_s for _, _, out in bobs]
    last_bob = max(done for _, done, _ in bobs)
    after = sum(1 for _, done, _ in alices if done > last_bob)  # still queued: fairness shown
    fcfs = FLOOD / SLOTS * runs[len(runs) // 2]
    refused = max(waits) <= bound and after >= FLOOD // 2
    return {"attack": f"alice queues {FLOOD} requests of {FLOOD_TOKENS} tokens behind "
                      f"{SLOTS} slots; bob sends {SHORT} of 2 tokens",
            "refused": refused,
            "outcome": f"bob's queue waits {', '.join(f'{w:.2f}' for w in waits)} s, bound "
                       f"{bound:.2f} s ({len(TENANTS)} tenants x alice's longest run "
                       f"{turn:.2f} s; median run {runs[len(runs) // 2]:.2f} s); {after} of "
                       f"alice's still unfinished after bob's last (first come, first served "
                       f"would have made him wait ~{fcfs:.1f} s)"}


def run_attacks(model_dir: str) -> list[dict]:
    """Start the cluster, run every attack, stop the nodes whatever happened."""
    nodes: list[NodeProcess] = []
    with tempfile.TemporaryDirectory(prefix="pdserve-trust-tenants-") as d:
        try:
            t = Target(model_dir, Path(d), nodes)
            rows = [asyncio.run(attack(t)) for attack in
                    (cross_tenant_abort, id_squatting, prefix_probe, flood)]
            return [{**row, "configuration": t.config} for row in rows]
        finally:
            stop_all(nodes)
