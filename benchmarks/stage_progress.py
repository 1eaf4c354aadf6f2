"""The figures a GPU-check stage has so far, sent to the check as they come, so that a
stage stopped at its time limit, or dying, still gives what it measured: a device machine
is lent for minutes, and a figure lost to a later step is a session's work lost."""

from __future__ import annotations

_conn = None  # the pipe to the check, in a stage's process (benchmarks/gpu.py `_child`)


def attach(conn) -> None:
    global _conn
    _conn = conn


def report(figures: dict) -> None:
    """Everything measured so far (each call replaces the last); nothing outside a stage."""
    if _conn is not None:
        _conn.send({"partial": figures})
