"""Checks of wire values that every node's edge makes before a role sees a request.

Each raises `ValueError` naming the field and the value (the edge answers
INVALID_ARGUMENT). What a value means to a role (a KV window, sampling) is checked by the
role's own rules (`kvtransfer.window`, `engine.SamplingParams.validate`), not here.
"""

from __future__ import annotations

MAX_REQUEST_ID_CHARS = 256


def check_request_id(request_id: str, *, required: bool = True) -> None:
    """A printable id of at most `MAX_REQUEST_ID_CHARS` characters (empty when not
    `required`: the node then assigns one)."""
    if required and not request_id:
        raise ValueError(f"request_id must be non-empty, got {request_id!r}")
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise ValueError(f"request_id must be at most {MAX_REQUEST_ID_CHARS} characters, got "
                         f"{request_id[:40] + '...'!r}")
    if any(not c.isprintable() for c in request_id):
        raise ValueError(f"request_id must be printable, got {request_id!r}")
