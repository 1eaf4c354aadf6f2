"""A /v1/responses request's conversation: the stored turns its `previous_response_id`
names (router/response_store.py), or the items of the `conversation` it names
(router/conversations.py), go before its input (`prepared`, `continued`), and with
`truncation: "auto"` its oldest turns are left out until it fits the context (`fitted`),
as OpenAI's truncation drops the conversation's earlier items.
"""

from __future__ import annotations

import json

from .openai_protocol import OpenAIError
from .responses_api import refused


def fitted(body: dict, render, max_model_len: int, max_chars: int) -> list[int]:
    """The prompt ids (`render(chat body)`) of a request with `truncation: "auto"`: while
    the prompt and the output limit overflow the context (or its text is longer than the
    context could hold, `max_chars`), the oldest whole turn (a user message and what
    followed it up to the next) is left out, never a system message nor the last turn.
    What still overflows is refused as any request is, by the context check."""
    messages, need = body["messages"], body.get("max_completion_tokens") or 1

    def overflows(ids) -> bool:
        return ids is None or len(ids) + need > max_model_len

    ids = None
    while overflows(ids):
        chars = sum(len(m.get("content") or "") + len(json.dumps(m.get("tool_calls") or "")) for m in messages)
        if chars <= max_chars:
            ids = render({**body, "messages": messages})
            if not overflows(ids):
                break
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        if len(users) < 2:  # only the last turn is left: the checks say what is too long
            return render({**body, "messages": messages})
        first = next(i for i, m in enumerate(messages) if m["role"] != "system")
        messages = messages[:first] + messages[users[1]:]
    return ids


def input_items(body: dict) -> list:
    """The request's `input` as a list of items (a text is one user message)."""
    given = body.get("input")
    return [{"type": "message", "role": "user", "content": given}] if isinstance(given, str) else given


def continued(body: dict, conversation: list[dict]) -> dict:
    """`body` with the stored `conversation` of its previous response before its input."""
    given = input_items(body)
    if not isinstance(given, list) or not given:
        raise refused(f"input must be a text or a non-empty list of items, got {body.get('input')!r:.80}", "input")
    return {**body, "input": [*conversation, *given]}


def prepared(body: dict, tenant: str, store, conversations):
    """(`body` with what came before its input, `ended`): its previous response's
    conversation or its conversation's items go first, and `ended(response)`, once the
    response completed or was cut short, keeps it (unless `store: false`) and adds its
    input and output items to its conversation."""
    if body.get("background") is True and not store.max_chars:
        raise OpenAIError(400, "a background response is read back from the store, and this server stores "
                               "none (--responses-store-mb 0): send it without background", "background")
    if body.get("conversation") is not None and body.get("previous_response_id") is not None:
        raise refused("conversation and previous_response_id both say what came before: send one", "conversation")
    own, conversation_id, full = input_items(body), None, body
    if body.get("conversation") is not None:
        conversation_id, before = conversations.items(tenant, body["conversation"])
        full = continued(body, before)
    elif body.get("previous_response_id") is not None:
        full = continued(body, store.get(tenant, body["previous_response_id"], "previous_response_id")[1])
    keep = body.get("store") is not False and store.max_chars > 0

    def ended(response: dict) -> None:
        if keep:
            store.put(tenant, response, input_items(full))
        if conversation_id is not None:
            conversations.extend(tenant, conversation_id, [*own, *response["output"]])
    return full, ended
