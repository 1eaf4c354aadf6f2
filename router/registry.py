"""Worker registry: the prefill and decode endpoints the router may use.

Endpoints come from static lists or DNS names (`router.discovery`) and from etcd
(`router.etcd_discovery`); each source replaces its own part of a role's pool through
`set_addresses`, and the pool is their union. Health-driven exclusion updates
`Endpoint.routable`, and incompatible nodes are refused, so policies only ever see
endpoints they may use. One gRPC channel per endpoint is opened once and shared by every
request.

Compatibility: every node's `NodeIdentity` (model hash, dtype, KV geometry) comes with its
etcd record, or from `GetLoad` for a static endpoint (probed in the background; a
node that does not answer it yet stays usable). A node whose identity differs from that of
the nodes already admitted (the first admitted one sets the reference while any admitted
node remains) is refused: never routed to, and logged once with what differs, e.g.
"dtype: float32 vs bfloat16". KV written by one can never land in pages of the other.
A decode node whose `GetLoad` says it grants shorter leases (`--max-lease-ms`) than this
router asks for (`--lease-ms`) is refused the same way until it grants enough: every
reservation there would be refused INVALID_ARGUMENT.

Load: `Endpoint.queue` is this router's own requests on the node plus what the node's last
`GetLoad` report showed beyond them (router/load.py polls), so several routers see each
other's load without sharing any state.

Health: when a call fails in a way that may mean the node is gone, `report_failure` checks
the node's gRPC health service at once; while the check fails the endpoint is not
routable, and it is checked again every `health_interval_s` until it passes (then its
channel is reopened, so no reconnect backoff of the dead connection delays it; calls still
in flight on the old one run to their own end first). A node that is draining answers
NOT_SERVING and is left alone the same way.
"""

from __future__ import annotations

import asyncio
import time
import logging
from dataclasses import dataclass, field
from typing import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.runtime.errors import NodeError
from pdserve.runtime.identity import NodeIdentity
from pdserve.runtime.server import channel
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from pdserve.router.policies import Policy, keyed_endpoint
from pdserve.router.prefix_index import PrefixIndex

log = logging.getLogger("pdserve.router")
# A replaced channel waits this long for its calls in flight: past every deadline the router
# gives a call (70 s by default at most); only a stream with no deadline is cut then.
RETIRED_CHANNEL_GRACE_S = 3600.0


@dataclass(eq=False)
class Endpoint:
    """One Worker node as seen by the router."""

    address: str
    role: str  # "prefill" | "decode"
    routable: bool = True
    in_flight: int = 0  # this router's requests on the node now
    identity: NodeIdentity | None = None
    instance: str = ""  # unique per process start (from etcd), "" when unknown
    refused: str = ""  # why it may not be paired with the nodes in use; "" = admitted
    lease_refused: str = ""  # decode: why it cannot grant this router's leases; "" = it can
    # From the last GetLoad report: requests queued or running there, and KV pages.
    reported_queue: int = 0
    in_flight_at_report: int = 0
    free_pages: int = 0
    total_pages: int = 0
    send_latency_s: float = 0.0  # prefill: recent RemoteSends, arrival to reply (moving average)
    steps: object = None  # decode: its last report's step fields (LoadReport 18-22), or None
    _sends: dict = field(default_factory=dict, repr=False)  # RemoteSends in flight -> started
    prefixes: PrefixIndex = field(default_factory=PrefixIndex, repr=False)
    _channel: grpc.aio.Channel | None = field(default=None, repr=False)
    _monitor_channel: grpc.aio.Channel | None = field(default=None, repr=False)
    _stub: pdserve_pb2_grpc.WorkerStub | None = field(default=None, repr=False)
    _monitor_stub: pdserve_pb2_grpc.WorkerStub | None = field(default=None, repr=False)
    _watch: asyncio.Task | None = field(default=None, repr=False)  # health checks while down
    _probe: asyncio.Task | None = field(default=None, repr=False)  # identity of a static node
    _retiring: set = field(default_factory=set, repr=False)  # replaced channels' closes

    @property
    def queue(self) -> int:
        """Requests on the node: ours now, plus others' as last reported."""
        return self.in_flight + max(0, self.reported_queue - self.in_flight_at_report)

    def send_started(self) -> object:
        """A RemoteSend of this router's to this node begins; hand the token to
        `send_ended`."""
        token = object()
        self._sends[token] = time.monotonic()
        return token

    def send_ended(self, token: object, timed: bool = True) -> None:
        """It ended: with `timed`, its time from the call to P's reply (or to the lease's
        end, when that came first) joins the moving average."""
        started = self._sends.pop(token, None)
        if timed and started is not None:
            self.send_latency_s += 0.3 * (time.monotonic() - started - self.send_latency_s)

    @property
    def send_wait_s(self) -> float:
        """How slow this node's RemoteSends are now: the recent average, or the age of the
        oldest one still in flight if that is more (a queue that grows shows at once)."""
        oldest = min(self._sends.values(), default=None)
        return max(self.send_latency_s, 0.0 if oldest is None else time.monotonic() - oldest)

    @property
    def usable(self) -> bool:
        return self.routable and not self.refused and not self.lease_refused

    def set_identity(self, identity: NodeIdentity | None, instance: str = "") -> None:
        """A new process on this address (or its first identity): forget what we guessed."""
        if instance != self.instance or (identity is not None and identity != self.identity):
            if identity is not None:
                self.prefixes = PrefixIndex(block=identity.page_size)
            else:
                self.prefixes.clear()
            self.reported_queue = self.in_flight_at_report = 0
            if instance and instance != self.instance and self.instance:
                self.routable = True  # a restarted node: health was about the old one
        self.identity = identity if identity is not None else self.identity
        self.instance = instance or self.instance

    @property
    def stub(self) -> pdserve_pb2_grpc.WorkerStub:
        # One stub per channel: building one makes a callable per RPC, which costs more
        # than the router's own work on a request.
        if self._channel is None:
            self._channel = channel(self.address, own_connections=True)  # no old backoff
            self._stub = pdserve_pb2_grpc.WorkerStub(self._channel)
        return self._stub

    @property
    def monitor_stub(self) -> pdserve_pb2_grpc.WorkerStub:
        """For background calls (load polls, identity probes): their own channel, so a node
        not up yet never puts the request channel into reconnect backoff."""
        if self._monitor_channel is None:
            self._monitor_channel = channel(self.address, own_connections=True)
            self._monitor_stub = pdserve_pb2_grpc.WorkerStub(self._monitor_channel)
        return self._monitor_stub

    def reopen(self) -> None:
        """Fresh channels for the calls to come; the old ones close once their calls in
        flight end by their own deadlines. Closing cancels them, and a cancelled call ended
        its request's handler with no status: the client waited for its deadline."""
        for ch in (self._channel, self._monitor_channel):
            if ch is not None:
                closing = asyncio.ensure_future(ch.close(grace=RETIRED_CHANNEL_GRACE_S))
                self._retiring.add(closing)
                closing.add_done_callback(self._retiring.discard)
        self._channel = self._monitor_channel = None

    async def close(self) -> None:
        for ch in (self._channel, self._monitor_channel):
            if ch is not None:
                await ch.close()
        self._channel = self._monitor_channel = None


class NoEndpointError(NodeError):
    """No routable endpoint of the requested role."""

    code = grpc.StatusCode.UNAVAILABLE


class WorkerRegistry:
    def __init__(
        self,
        prefill: Sequence[str],
        decode: Sequence[str],
        prefill_policy: Policy,
        decode_policy: Policy,
        health_interval_s: float = 1.0,
        health_timeout_s: float = 2.0,
    ) -> None:
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.prefill = [Endpoint(a, "prefill") for a in prefill]
        self.decode = [Endpoint(a, "decode") for a in decode]
        self._policies = {"prefill": prefill_policy, "decode": decode_policy}
        self._retired: list[Endpoint] = []
        # (role, source) -> addresses; a role's pool is the union over sources.
        self._sources: dict[tuple[str, str], list[str]] = {
            ("prefill", "static"): list(prefill), ("decode", "static"): list(decode)}
        self.probe_identity = True  # ask static nodes for their identity (GetTransferInfo)
        self.lease_ms = 0  # this router's --lease-ms: decode nodes granting less are refused

    async def set_addresses(self, role: str, addresses: Sequence[str], source: str = "static",
                            identities: dict | None = None) -> None:
        """Make `source`'s part of `role`'s pool exactly `addresses` (discovery);
        `identities`: address -> (NodeIdentity, instance) where the source knows them.
        Endpoints that stay keep their state; a removed one is closed once no request still
        uses it."""
        self._sources[(role, source)] = list(addresses)
        wanted = list(dict.fromkeys(a for (r, _), addrs in self._sources.items() if r == role
                                    for a in addrs))
        current = {e.address: e for e in getattr(self, role)}
        pool = [current.pop(a, None) or Endpoint(a, role) for a in wanted]
        setattr(self, role, pool)
        for endpoint in current.values():
            self._forget(endpoint)
        for endpoint in pool:
            if identities and endpoint.address in identities:
                endpoint.set_identity(*identities[endpoint.address])
            elif endpoint.identity is None and self.probe_identity and endpoint._probe is None:
                endpoint._probe = asyncio.ensure_future(self._probe_identity(endpoint))
        self._admit_all()
        self._retired += current.values()
        idle = [e for e in self._retired if e.in_flight == 0]
        self._retired = [e for e in self._retired if e.in_flight > 0]
        for endpoint in idle:
            await endpoint.close()

    def _forget(self, endpoint: Endpoint) -> None:
        for task in (endpoint._watch, endpoint._probe):
            if task is not None:
                task.cancel()
        if endpoint.refused:
            log.info("refused %s node %s left", endpoint.role, endpoint.address)

    def endpoints(self) -> list[Endpoint]:
        return [*self.prefill, *self.decode]

    def _admit_all(self) -> None:
        """Refuse every node whose identity cannot be paired with the reference."""
        reference = None
        for endpoint in self.endpoints():
            if endpoint.identity is not None and not endpoint.refused:
                reference = endpoint
                break
        for endpoint in self.endpoints():
            if endpoint.identity is None or reference is None or endpoint is reference:
                continue
            diffs = reference.identity.differences(endpoint.identity)
            reason = "" if not diffs else (
                f"refusing {endpoint.role} node {endpoint.address}: it cannot be paired with "
                f"the nodes in use (reference: {reference.role} node {reference.address}); "
                + "; ".join(f"{d} (reference vs this node)" for d in diffs))
            if reason and reason != endpoint.refused:
                log.error("%s", reason)
            elif not reason and endpoint.refused:
                log.warning("%s node %s is compatible again; admitted", endpoint.role,
                            endpoint.address)
            endpoint.refused = reason

    def refused(self) -> dict[str, str]:
        return {e.address: e.refused or e.lease_refused for e in self.endpoints()
                if e.refused or e.lease_refused}

    def check_lease(self, endpoint: Endpoint, max_lease_ms: int) -> None:
        """A node's report of the longest lease it grants (0: not told): a decode node that
        grants less than this router asks for is refused, since every PrepareReceive there
        would fail INVALID_ARGUMENT; admitted again once it grants enough."""
        reason = ""
        if endpoint.role == "decode" and 0 < max_lease_ms < self.lease_ms:
            reason = (f"refusing decode node {endpoint.address}: it grants leases of at most "
                      f"{max_lease_ms} ms (its --max-lease-ms) and this router asks for "
                      f"{self.lease_ms} ms (--lease-ms); lower the router's --lease-ms or raise "
                      f"the node's --max-lease-ms")
        if reason and reason != endpoint.lease_refused:
            log.error("%s", reason)
        elif not reason and endpoint.lease_refused:
            log.warning("decode node %s grants this router's leases now; admitted", endpoint.address)
        endpoint.lease_refused = reason

    async def _probe_identity(self, endpoint: Endpoint) -> None:
        """GetLoad until the node answers once (it may still be starting): its identity.
        (GetLoad, not GetTransferInfo: routers may call it in a keyed cluster too.)"""
        delay = self.health_interval_s
        while endpoint in self.prefill or endpoint in self.decode:
            try:
                report = await endpoint.monitor_stub.GetLoad(pdserve_pb2.LoadRequest(),
                                                             timeout=self.health_timeout_s)
            except grpc.aio.AioRpcError as err:
                if err.code() in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.PERMISSION_DENIED,
                                  grpc.StatusCode.UNAUTHENTICATED):
                    log.warning("%s node %s does not tell its identity (%s): routed to "
                                "without the compatibility check", endpoint.role,
                                endpoint.address, err.code().name)
                    return
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)
                continue
            self.check_lease(endpoint, report.max_lease_ms)
            if report.HasField("identity"):
                endpoint.set_identity(NodeIdentity.from_transfer_info(report.identity))
                self._admit_all()
            return

    def pick(self, role: str, prompt_token_ids: Sequence[int], exclude=(),
             cache_salt: str = "", cache_key: str = "") -> Endpoint:
        """A usable endpoint of `role`: the one `cache_key` names (router/policies.py),
        unless it is too busy, else the role's policy's choice."""
        pool = [e for e in (self.prefill if role == "prefill" else self.decode)
                if e.usable and e not in exclude]
        if not pool:
            raise NoEndpointError(f"no {role} node can take this request now ("
                                  + ("every one tried failed" if exclude else
                                     "none is up and healthy") + "); retry shortly")
        keyed = keyed_endpoint(pool, cache_key, cache_salt) if cache_key else None
        return keyed or self._policies[role].pick(pool, prompt_token_ids, cache_salt)

    def report_failure(self, endpoint: Endpoint, reason: str) -> None:
        """A call to `endpoint` failed as if the node were gone: check its health now."""
        if endpoint._watch is None or endpoint._watch.done():
            endpoint._watch = asyncio.ensure_future(self._watch_health(endpoint, reason))

    async def _watch_health(self, endpoint: Endpoint, reason: str) -> None:
        while endpoint in self.prefill or endpoint in self.decode:
            if await self._serving(endpoint):
                if not endpoint.routable:
                    log.warning("%s node %s passes its health check again", endpoint.role,
                                endpoint.address)
                    endpoint.reopen()  # a fresh channel, without the dead one's backoff
                    endpoint.prefixes.clear()  # it may have restarted with an empty cache
                    endpoint.routable = True
                return
            if endpoint.routable:
                log.warning("%s node %s is down (%s); not routing to it until its health "
                            "check passes", endpoint.role, endpoint.address, reason)
                endpoint.routable = False
            await asyncio.sleep(self.health_interval_s)

    async def _serving(self, endpoint: Endpoint) -> bool:
        try:
            async with channel(endpoint.address, own_connections=True) as ch:  # no shared backoff
                reply = await health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=self.health_timeout_s)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def has_prefill(self) -> bool:
        return any(e.usable for e in self.prefill)

    def usable(self, role: str) -> list[Endpoint]:
        return [e for e in getattr(self, role) if e.usable]

    async def close(self) -> None:
        for endpoint in [*self.prefill, *self.decode, *self._retired]:
            self._forget(endpoint)
            await endpoint.close()
