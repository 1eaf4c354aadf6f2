"""OpenAI's Conversations API: a conversation's items kept by the router, which a
/v1/responses request names with `conversation` (its items go before the request's input,
and the input and the answer's output items are added after it ends).

- Routes (`routes`): POST /v1/conversations (`items`, `metadata`), GET, POST (new
  `metadata`) and DELETE /v1/conversations/{id}; GET and POST /v1/conversations/{id}/items
  (listed in OpenAI's pages, router/response_store.py's `page_of`), GET and DELETE
  /v1/conversations/{id}/items/{item_id}.
- Items are what a Responses `input` takes (message, function_call, function_call_output,
  reasoning), checked as an input is; each gets an id when added (`msg_…`, `item_…`).
- Kept as stored responses are: by the router that made them, in memory (and in
  `--responses-store-dir`, each change as made, router/store_file.py), each tenant's
  own, the least recently used going first past `--responses-store-mb` of their JSON text
  (a bound of their own, beside the responses'); 0 keeps none. Through another router
  that names this one a `--peer-router`, the conversation's routes, and a response that
  names it, are relayed here (router/peers.py).
"""

from __future__ import annotations

import json
import uuid
from collections import OrderedDict
from collections.abc import Callable

from aiohttp import web

from . import responses_api
from .openai_protocol import OpenAIError, now
from .peers import Peers, or_peer
from .response_store import page_of, with_ids

MAX_METADATA = 16  # OpenAI's: pairs of a key of at most 64 characters and a value of at most 512
MAX_ITEMS_ADDED = 20  # OpenAI's: items one create or add call takes


class Conversations:
    def __init__(self, max_mb: float, tenant_of: Callable[[web.Request], str], peers: Peers | None = None) -> None:
        self.max_chars = int(max_mb * 2**20)
        self.tenant_of, self.peers = tenant_of, peers
        self._entries: OrderedDict[tuple[str, str], dict] = OrderedDict()  # {"conversation", "items", "size"}
        self.chars = 0
        self.journal: Callable[[list], None] | None = None  # told each change (router/store_file.py)

    def routes(self) -> list[web.RouteDef]:
        """Each route of a conversation another router made is that router's (router/peers.py)."""
        def theirs(handler):
            return or_peer(self.peers, handler, ("conversation_id",))

        return [web.post("/v1/conversations", self._create),
                web.get("/v1/conversations/{id}", theirs(self._get)),
                web.post("/v1/conversations/{id}", theirs(self._update)),
                web.delete("/v1/conversations/{id}", theirs(self._delete)),
                web.get("/v1/conversations/{id}/items", theirs(self._list)),
                web.post("/v1/conversations/{id}/items", theirs(self._add)),
                web.get("/v1/conversations/{id}/items/{item}", theirs(self._item)),
                web.delete("/v1/conversations/{id}/items/{item}", theirs(self._delete_item))]

    # ---- what /v1/responses uses ------------------------------------------------------
    def items(self, tenant: str, named) -> tuple[str, list[dict]]:
        """(id, items) of the conversation a Responses request's `conversation` names (its
        id, or {"id": ...}); 404 naming `conversation` when it is not here."""
        conversation_id = named.get("id") if isinstance(named, dict) else named
        return conversation_id, self._entry(tenant, conversation_id, "conversation")["items"]

    def extend(self, tenant: str, conversation_id: str, items: list[dict]) -> None:
        """Add a response's input and output items; a conversation deleted meanwhile stays so."""
        if (tenant, conversation_id) in self._entries:
            entry = self._entry(tenant, conversation_id)
            try:
                self._resize(tenant, conversation_id, entry["conversation"], [*entry["items"], *with_ids(items)])
            except OpenAIError:  # alone over the bound now: it goes, as the least recently used would
                self.forget(tenant, conversation_id)

    # ---- the routes ---------------------------------------------------------------------
    async def _create(self, request: web.Request) -> web.Response:
        body = await _object(request)
        unknown = sorted(set(body) - {"items", "metadata"})
        if unknown:
            raise _bad(f"unknown parameter {unknown[0]!r:.80}: a conversation takes items and metadata", unknown[0])
        conversation = {"id": f"conv_{uuid.uuid4().hex}", "object": "conversation", "created_at": now(),
                        "metadata": _metadata(body.get("metadata"))}
        self._resize(self.tenant_of(request), conversation["id"], conversation,
                     with_ids(_checked_items(body.get("items") or [])))
        return web.json_response(conversation)

    async def _get(self, request: web.Request) -> web.Response:
        return web.json_response(self._entry(self.tenant_of(request), request.match_info["id"])["conversation"])

    async def _update(self, request: web.Request) -> web.Response:
        body = await _object(request)
        if set(body) != {"metadata"}:
            raise _bad("a conversation's update takes metadata alone", "metadata")
        entry = self._entry(self.tenant_of(request), request.match_info["id"])
        entry["conversation"]["metadata"] = _metadata(body["metadata"])
        self._changed(self.tenant_of(request), entry)
        return web.json_response(entry["conversation"])

    async def _delete(self, request: web.Request) -> web.Response:
        tenant, conversation_id = self.tenant_of(request), request.match_info["id"]
        self._entry(tenant, conversation_id)  # 404 when it is not here
        self.forget(tenant, conversation_id)
        return web.json_response({"id": conversation_id, "object": "conversation.deleted", "deleted": True})

    async def _list(self, request: web.Request) -> web.Response:
        entry = self._entry(self.tenant_of(request), request.match_info["id"])
        return web.json_response(page_of(entry["items"], request.query, "this conversation's items"))

    async def _add(self, request: web.Request) -> web.Response:
        tenant, conversation_id = self.tenant_of(request), request.match_info["id"]
        body = await _object(request)
        added = with_ids(_checked_items(body.get("items")))
        entry = self._entry(tenant, conversation_id)
        self._resize(tenant, conversation_id, entry["conversation"], [*entry["items"], *added])
        return web.json_response({"object": "list", "data": added, "first_id": added[0]["id"],
                                  "last_id": added[-1]["id"], "has_more": False})

    async def _item(self, request: web.Request) -> web.Response:
        entry = self._entry(self.tenant_of(request), request.match_info["id"])
        return web.json_response(entry["items"][self._at(entry, request.match_info["item"])])

    async def _delete_item(self, request: web.Request) -> web.Response:
        tenant, conversation_id = self.tenant_of(request), request.match_info["id"]
        entry = self._entry(tenant, conversation_id)
        at = self._at(entry, request.match_info["item"])
        self._resize(tenant, conversation_id, entry["conversation"], entry["items"][:at] + entry["items"][at + 1:])
        return web.json_response(entry["conversation"])

    # ---- keeping ----------------------------------------------------------------------------
    def _entry(self, tenant: str, conversation_id, param: str = "conversation_id") -> dict:
        if not isinstance(conversation_id, str):
            raise _bad(f"{param} must be a conversation's id, got {conversation_id!r:.80}", param)
        key = (tenant, conversation_id)
        if key not in self._entries:
            why = "this server keeps no conversations (--responses-store-mb 0)" if not self.max_chars else \
                "it was never made here (another router), or it was deleted or evicted"
            raise OpenAIError(404, f"Conversation with id {conversation_id!r:.80} not found: {why}.", param,
                              "not_found")
        self._entries.move_to_end(key)
        return self._entries[key]

    def _resize(self, tenant: str, conversation_id: str, conversation: dict, items: list[dict]) -> None:
        """Keep the conversation with `items` (its newest use), the oldest others going past the bound."""
        size = len(json.dumps(conversation)) + len(json.dumps(items))
        if size > self.max_chars:
            raise OpenAIError(400 if self.max_chars else 404,
                              f"the conversation's {size} characters of JSON are more than this server keeps "
                              f"(--responses-store-mb, {self.max_chars} characters)", "items", "invalid_argument")
        old = self._entries.pop((tenant, conversation_id), None)
        self.chars += size - (old["size"] if old else 0)
        self._entries[(tenant, conversation_id)] = entry = {"conversation": conversation, "items": items, "size": size}
        while self.chars > self.max_chars:
            _, gone = self._entries.popitem(last=False)
            self.chars -= gone["size"]
        self._changed(tenant, entry)

    def _changed(self, tenant: str, entry: dict) -> None:
        if self.journal is not None:
            self.journal(["conversation", tenant, entry["conversation"], entry["items"]])

    def forget(self, tenant: str, conversation_id: str) -> None:
        """Remove the conversation, if here."""
        entry = self._entries.pop((tenant, conversation_id), None)
        if entry is not None:
            self.chars -= entry["size"]
            if self.journal is not None:
                self.journal(["conversation_deleted", tenant, conversation_id])

    def snapshot(self) -> list[list]:
        """[tenant, conversation, items] of each, the least recently used first."""
        return [[tenant, e["conversation"], e["items"]] for (tenant, _), e in self._entries.items()]

    def restore(self, entries: list[list]) -> None:
        """Keep a `snapshot`'s conversations again, within this store's bound."""
        for tenant, conversation, items in entries:
            size = len(json.dumps(conversation)) + len(json.dumps(items))
            if size <= self.max_chars:
                self._resize(tenant, conversation["id"], conversation, items)

    @staticmethod
    def _at(entry: dict, item_id: str) -> int:
        at = next((i for i, item in enumerate(entry["items"]) if item["id"] == item_id), None)
        if at is None:
            raise OpenAIError(404, f"Item with id {item_id!r:.80} is not in conversation "
                                   f"{entry['conversation']['id']!r}.", "item_id", "not_found")
        return at


async def _object(request: web.Request) -> dict:
    try:
        body = await request.json()
    except ValueError as err:
        raise _bad(f"request body is not valid JSON: {err}", None) from None
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object", None)
    return body


def _checked_items(items) -> list[dict]:
    """Items a Responses input may hold, at most MAX_ITEMS_ADDED; a 400 naming `items`."""
    if not isinstance(items, list) or len(items) > MAX_ITEMS_ADDED:
        raise _bad(f"items must be a list of at most {MAX_ITEMS_ADDED} items, got {items!r:.80}", "items")
    if items:
        try:
            responses_api.chat_body({"input": items})
        except OpenAIError as err:
            raise _bad(err.message.replace("input", "items"), "items") from None
    return items


def _metadata(metadata) -> dict:
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in metadata.items()):
        raise _bad(f"metadata must be at most {MAX_METADATA} pairs of a text key (64 characters at most) and a "
                   f"text value (512 at most), got {metadata!r:.80}", "metadata")
    return metadata


def _bad(message: str, param: str | None) -> OpenAIError:
    return OpenAIError(400, message, param, "invalid_argument")
