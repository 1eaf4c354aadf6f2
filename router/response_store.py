"""Stored responses of /v1/responses: what `previous_response_id` continues, and what
`GET` and `DELETE /v1/responses/{id}` read and remove.

- Kept by the router process that answered, in memory, so a restart forgets them and
  another router of the same cluster does not have them (a client that spreads one
  conversation over several routers sends the whole conversation in `input` instead).
- Bounded by `--responses-store-mb` of their JSON text: the least recently used go first.
  0 keeps none, and a request that needs one is told so.
- Each is its tenant's: another tenant's id is not found, as an id never stored is not.
- An entry holds the response as answered and the conversation that led to it, as input
  items (the earlier turns, the request's input, then its output items), so a chain of
  continuations never needs an older entry that may be gone. The instructions are not part
  of it: as OpenAI's, a continuation gives its own.
"""

from __future__ import annotations

import json
from collections import OrderedDict

from .openai_protocol import OpenAIError


class ResponseStore:
    def __init__(self, max_mb: float) -> None:
        self.max_chars = int(max_mb * 2**20)
        self._entries: OrderedDict[tuple[str, str], tuple[dict, list[dict], int]] = OrderedDict()
        self.chars = 0  # the JSON text the entries hold

    def put(self, tenant: str, response: dict, conversation: list[dict]) -> bool:
        """Keep `response` (whole, as answered) and the `conversation` items that led to it
        and it gave; False when it alone is over the bound (then nothing is kept)."""
        size = len(json.dumps(response)) + len(json.dumps(conversation))
        if size > self.max_chars:
            return False
        self.delete(tenant, response["id"])
        self._entries[(tenant, response["id"])] = (response, conversation, size)
        self.chars += size
        while self.chars > self.max_chars:
            _, (_, _, gone) = self._entries.popitem(last=False)
            self.chars -= gone
        return True

    def get(self, tenant: str, response_id, param: str = "response_id") -> tuple[dict, list[dict]]:
        """(response, conversation) of `tenant`'s stored response; 404 naming `param` otherwise."""
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
        response, conversation, _ = self._entries[key]
        return response, conversation

    def delete(self, tenant: str, response_id: str) -> bool:
        entry = self._entries.pop((tenant, response_id), None)
        if entry is not None:
            self.chars -= entry[2]
        return entry is not None
