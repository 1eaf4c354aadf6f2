"""Stored responses of /v1/responses: what `previous_response_id` continues, and what
`GET` and `DELETE /v1/responses/{id}` read and remove, and `GET
/v1/responses/{id}/input_items` lists (`input_page`).

- Kept by the router process that answered, in memory (and with `--responses-store-dir`
  on disk, each change as made, across restarts and kills, router/store_file.py). Another
  router of the same cluster asks for one it lacks from its `--peer-router`s
  (router/peers.py); without them, a client that spreads one conversation over several
  routers sends the whole conversation in `input` instead.
- Bounded by `--responses-store-mb` of their JSON text: the least recently used go first.
  0 keeps none, and a request that needs one is told so.
- Each is its tenant's: another tenant's id is not found, as an id never stored is not.
- An entry holds the response as answered and its input items: the earlier turns its
  `previous_response_id` continued, then the request's own input. So a chain of
  continuations never needs an older entry that may be gone, and its input items list the
  whole conversation the model was given. The instructions are not part of it: as OpenAI's,
  a continuation gives its own.
- An input item without an `id` gets one when stored (`msg_…` for a message, `item_…` for
  another kind), which it keeps in the continuations: the list's pages are cut at ids.
"""

from __future__ import annotations

import json
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping

from .openai_protocol import OpenAIError


class ResponseStore:
    def __init__(self, max_mb: float) -> None:
        self.max_chars = int(max_mb * 2**20)
        self._entries: OrderedDict[tuple[str, str], tuple[dict, list[dict], int]] = OrderedDict()
        self.chars = 0  # the JSON text the entries hold
        self.journal: Callable[[list], None] | None = None  # told each change (router/store_file.py)

    def put(self, tenant: str, response: dict, inputs: list[dict]) -> bool:
        """Keep `response` (whole, as answered) and the `inputs` items that led to it; False
        when it alone is over the bound (then nothing is kept)."""
        inputs = with_ids(inputs)
        size = len(json.dumps(response)) + len(json.dumps(inputs))
        if size > self.max_chars:
            return False
        self._drop(tenant, response["id"])
        self._entries[(tenant, response["id"])] = (response, inputs, size)
        self.chars += size
        while self.chars > self.max_chars:
            _, (_, _, gone) = self._entries.popitem(last=False)
            self.chars -= gone
        if self.journal is not None:
            self.journal(["response", tenant, response, inputs])
        return True

    def get(self, tenant: str, response_id, param: str = "response_id") -> tuple[dict, list[dict]]:
        """(response, conversation) of `tenant`'s stored response, the conversation being its
        input items then its output items; 404 naming `param` otherwise."""
        response, inputs = self._entry(tenant, response_id, param)
        return response, [*inputs, *response["output"]]

    def has(self, tenant: str, response_id: str) -> bool:
        return (tenant, response_id) in self._entries

    def input_page(self, tenant: str, response_id: str, query: Mapping[str, str]) -> dict:
        """A page of the stored response's input items (`page_of`)."""
        return page_of(self._entry(tenant, response_id)[1], query, "this response's input items")

    def _entry(self, tenant: str, response_id, param: str = "response_id") -> tuple[dict, list[dict]]:
        if not isinstance(response_id, str):
            raise OpenAIError(400, f"{param} must be a response's id, got {response_id!r:.80}", param,
                              "invalid_argument")
        key = (tenant, response_id)
        if key not in self._entries:
            why = "this server stores no responses (--responses-store-mb 0)" if not self.max_chars else \
                "it was never stored here (store: false, another router), or it was deleted or evicted"
            raise OpenAIError(404, f"Response with id {response_id!r:.80} not found: {why}. Send the whole "
                                   "conversation in input instead.", param, "not_found")
        self._entries.move_to_end(key)
        response, inputs, _ = self._entries[key]
        return response, inputs

    def delete(self, tenant: str, response_id: str) -> bool:
        found = self._drop(tenant, response_id)
        if found and self.journal is not None:
            self.journal(["response_deleted", tenant, response_id])
        return found

    def _drop(self, tenant: str, response_id: str) -> bool:
        entry = self._entries.pop((tenant, response_id), None)
        if entry is not None:
            self.chars -= entry[2]
        return entry is not None

    def snapshot(self) -> list[list]:
        """[tenant, response, inputs] of each entry, the least recently used first."""
        return [[tenant, response, inputs] for (tenant, _), (response, inputs, _) in self._entries.items()]

    def restore(self, entries: list[list]) -> None:
        """Keep a `snapshot`'s entries again, within this store's bound."""
        for tenant, response, inputs in entries:
            self.put(tenant, response, inputs)


def with_ids(items: list[dict]) -> list[dict]:
    """`items`, each with an id: its own, or a new one (`msg_…` for a message, `item_…` for
    another kind), which it keeps wherever it goes next."""
    return [item if "id" in item else
            {"id": f"{'msg' if item.get('type', 'message') == 'message' else 'item'}_{uuid.uuid4().hex}", **item}
            for item in items]


def page_of(items: list[dict], query: Mapping[str, str], what: str) -> dict:
    """A page of `items` (oldest first, each with an id), as OpenAI lists them: `order`
    "desc" (newest first, the default) or "asc", at most `limit` (1 to 100, 20 by default),
    after or before the item whose id `after` or `before` gives. `include` is accepted:
    pdserve's items are text, with nothing more to include. `what` names the items in errors."""
    unknown = sorted(set(query) - {"limit", "order", "after", "before", "include", "include[]"})
    if unknown:
        raise OpenAIError(400, f"unknown query parameter {unknown[0]!r:.80}: the list of {what} takes limit, "
                               "order, after, before and include", unknown[0])
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise OpenAIError(400, f"order must be 'asc' or 'desc', got {order!r:.80}", "order")
    limit = query.get("limit", "20")
    if not limit.isdigit() or not 1 <= int(limit) <= 100:
        raise OpenAIError(400, f"limit must be an integer from 1 to 100, got {limit!r:.80}", "limit")
    items = items if order == "asc" else items[::-1]
    ids = [item["id"] for item in items]
    for param in ("after", "before"):
        if param in query and query[param] not in ids:
            raise OpenAIError(400, f"{param} must be the id of one of {what}, got {query[param]!r:.80}", param)
    start = ids.index(query["after"]) + 1 if "after" in query else 0
    stop = ids.index(query["before"]) if "before" in query else len(ids)
    window = items[start:stop]
    # `before` alone pages backwards: the items just before it, as a previous page
    page = window[-int(limit):] if "before" in query and "after" not in query else window[:int(limit)]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(page) < len(window)}
