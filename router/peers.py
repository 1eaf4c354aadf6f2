"""The other routers of a cluster, asked for the stored responses this router lacks
(router/responses_http.py) and the conversations (router/conversations.py), so that a
client behind a load balancer continues, reads, cancels or deletes a response through any
router, whichever stored it, and uses a conversation through any router, whichever made
it. A continuation copies the response it continues to the router that serves it; a delete
reaches every router, copies too. A conversation has no copies: whatever names one this
router lacks (its routes, a response that adds to it) is relayed whole to the router that
has it, which answers.

- Peers are `--peer-router` targets: a router's HTTP `HOST:PORT`, or `dns:///NAME:PORT`
  for every address the name has (a Kubernetes headless Service of the routers, a compose
  service), resolved at each ask. This router's own address among them answers as a peer
  without the response does.
- A peer is asked with the caller's own key (`Authorization` or `x-api-key`), so it answers
  for the caller's tenant alone, and with `X-Pdserve-Peer` set, so it answers from its own
  store: no ask goes round.
- Peers are asked in turn; the first answer that is not a 404 is relayed as it comes (a
  background response's event stream too). A peer that cannot be reached is skipped, and
  logged: with no answer the client gets this router's 404.
- HTTPS when this router serves HTTPS (a `--tls-cert` without `--plain-http`): the peer's
  certificate checked against `--tls-ca`, this router's presented.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import aiohttp
from aiohttp import web

from pdserve.runtime import http_limits, tls

from .discovery import is_dns, resolve
from .openai_protocol import OpenAIError

log = logging.getLogger("pdserve.router")

PEER_HEADER = "X-Pdserve-Peer"
KEY_HEADERS = ("Authorization", "x-api-key")
PAGE = 100  # input items asked for at once


def asked_by_peer(request: web.Request) -> bool:
    return PEER_HEADER in request.headers


def or_peer(peers: "Peers | None", handler, params: tuple[str, ...] = ()):
    """`handler`, or the answer of a peer router where this one finds nothing: a 404 (one
    naming a field of `params`, when given)."""
    async def answer(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except OpenAIError as err:
            if err.status != 404 or (params and err.param not in params) or peers is None or \
                    asked_by_peer(request):
                raise
            relayed = await peers.relay(request)
            if relayed is None:
                raise
            return relayed
    return answer


class Peers:
    def __init__(self, targets: Sequence[str], timeout_s: float = 30.0) -> None:
        self.targets = list(targets)
        # A relayed event stream may be quiet for as long as its generation takes: only the
        # connection is bounded there; a whole answer is bounded by `timeout_s`.
        self.connect = aiohttp.ClientTimeout(total=None, sock_connect=timeout_s)
        self.whole = aiohttp.ClientTimeout(total=timeout_s)
        secure = tls.current().cert and not http_limits.current().plain_http
        self.scheme, self.ssl = ("https", tls.http_client_ssl_context()) if secure else ("http", None)

    async def _bases(self) -> list[str]:
        addresses = []
        for target in self.targets:
            try:
                addresses += await resolve(target) if is_dns(target) else [target]
            except (OSError, ValueError) as err:
                log.warning("cannot resolve peer router %s: %s", target, err)
        return [f"{self.scheme}://{a}" for a in dict.fromkeys(addresses)]

    def _session(self, request: web.Request) -> aiohttp.ClientSession:
        headers = {name: request.headers[name] for name in KEY_HEADERS if name in request.headers}
        return aiohttp.ClientSession(headers={**headers, PEER_HEADER: "1"}, timeout=self.connect,
                                     connector=aiohttp.TCPConnector(ssl=self.ssl or True))

    async def relay(self, request: web.Request) -> web.StreamResponse | None:
        """The first peer's answer to `request` (its method, path, query and body) that is
        not a 404, relayed to the client as it comes; None when none has it."""
        body = await request.read()  # read once already (aiohttp keeps it): to send again
        headers = {name: request.headers[name] for name in ("Content-Type", "X-Request-Id") if name in request.headers}
        async with self._session(request) as session:
            for base in await self._bases():
                try:
                    async with session.request(request.method, base + request.path_qs, data=body or None,
                                               headers=headers) as reply:
                        if reply.status == 404:
                            continue
                        out = web.StreamResponse(status=reply.status, headers={
                            "Content-Type": reply.headers.get("Content-Type", "application/json")})
                        await out.prepare(request)
                        try:
                            async for chunk in reply.content.iter_any():
                                await out.write(chunk)
                        except (aiohttp.ClientError, asyncio.TimeoutError) as err:  # begun: end it here
                            log.warning("peer router %s stopped relaying %s: %s", base, request.path, err)
                        await out.write_eof()
                        return out
                except (aiohttp.ClientError, asyncio.TimeoutError) as err:
                    log.warning("peer router %s did not answer %s %s: %s", base, request.method, request.path, err)
        return None

    async def everywhere(self, request: web.Request) -> bool:
        """`request` (its method, path and query, no body) sent to every peer: whether any
        answered 200."""
        async def one(session, base) -> bool:
            try:
                async with session.request(request.method, base + request.path_qs, timeout=self.whole) as reply:
                    return reply.status == 200
            except (aiohttp.ClientError, asyncio.TimeoutError) as err:
                log.warning("peer router %s did not answer %s %s: %s", base, request.method, request.path, err)
                return False

        async with self._session(request) as session:
            return any(await asyncio.gather(*(one(session, base) for base in await self._bases())))

    async def stored(self, request: web.Request, response_id: str) -> tuple[dict, list[dict]] | None:
        """(response, input items) of `response_id` from the first peer that stores it for
        the caller, or None."""
        path = f"/v1/responses/{response_id}"
        async with self._session(request) as session:
            for base in await self._bases():
                try:
                    async with session.get(base + path, timeout=self.whole) as reply:
                        if reply.status != 200:
                            continue
                        response = await reply.json()
                    items, query = [], {"order": "asc", "limit": str(PAGE)}
                    while True:
                        async with session.get(f"{base}{path}/input_items", params=query,
                                               timeout=self.whole) as reply:
                            reply.raise_for_status()
                            page = await reply.json()
                        items += page["data"]
                        if not page["has_more"]:
                            return response, items
                        query["after"] = page["last_id"]
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError) as err:
                    log.warning("peer router %s did not give response %s: %s", base, response_id, err)
        return None
