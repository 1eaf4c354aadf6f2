"""A /v1/responses request's conversation: the stored turns its `previous_response_id`
names go before its input (`continued`, router/response_store.py), and with `truncation:
"auto"` its oldest turns are left out until it fits the context (`fitted`), as OpenAI's
truncation drops the conversation's earlier items.
"""

from __future__ import annotations

import json

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
