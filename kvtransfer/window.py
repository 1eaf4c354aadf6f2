"""KV window arithmetic: which prompt positions a transfer carries.

A window ``[begin, end)`` names the prompt positions whose KV moves from the prefill node
to the decode node. Values may be negative and then count from the end like Python
indices. Invariant of every resolved window: ``0 <= begin < end < length`` (at least one
token moves, and the last prompt token is always left for the decode node to compute).
"""

from __future__ import annotations


class KVWindowError(ValueError):
    """A KV window that does not fit the prompt; the message names the values."""


def _as_int(name: str, value: object) -> int:
    # bool is an int subclass; True as a position is always a caller bug.
    if isinstance(value, bool) or not isinstance(value, int):
        raise KVWindowError(f"{name} must be an int, got {value!r}")
    return value


def resolve_kv_window_end(end: int, length: int) -> int:
    """Resolve ``end`` (negative counts from the end) so that ``0 <= end < length``."""
    end = _as_int("kv_window_end", end)
    length = _as_int("prompt length", length)
    if length <= 0:
        raise KVWindowError(f"prompt length must be positive, got {length}")
    resolved = end + length if end < 0 else end
    if not 0 <= resolved < length:
        raise KVWindowError(
            f"kv_window_end={end} is outside the prompt of length {length}: "
            f"need 0 <= end < {length} after resolving (got {resolved})"
        )
    return resolved


def resolve_kv_window(begin: int, end: int, length: int) -> tuple[int, int]:
    """Resolve ``(begin, end)`` against ``length``; raise unless ``0 <= begin < end < length``."""
    begin = _as_int("kv_window_begin", begin)
    end = _as_int("kv_window_end", end)
    length = _as_int("prompt length", length)
    if length <= 0:
        raise KVWindowError(f"prompt length must be positive, got {length}")
    b = begin + length if begin < 0 else begin
    e = end + length if end < 0 else end
    if not 0 <= b < e < length:
        raise KVWindowError(
            f"kv window [{begin}, {end}) is invalid for a prompt of length {length}: "
            f"need 0 <= begin < end < length after resolving (got [{b}, {e}))"
        )
    return b, e
