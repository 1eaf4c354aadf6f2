"""Errors that mean one gRPC status whatever raises them, and the one place that maps an
exception to a status.

Roles raise these (or subclasses naming their own case) with a message that names the
value that broke the rule. `status_of` is the whole mapping:
- a `NodeError`: its `code` (class attribute, or set per instance);
- a `ValueError`: INVALID_ARGUMENT (bad input, found where it is used);
- anything else: None, a bug: servicers let it propagate (gRPC answers UNKNOWN).
"""

from __future__ import annotations

import grpc


class NodeError(Exception):
    """An error with the gRPC status it ends a call with."""

    code = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class NodeDraining(NodeError):
    """The node is draining after SIGTERM and takes no new work: try another."""

    code = grpc.StatusCode.UNAVAILABLE


class NodeOverloaded(NodeError):
    """Taking this request would exceed a bound (the message names it): retry later or
    elsewhere."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class RequestAborted(NodeError):
    """An Abort (or the caller going away) reached the request first."""

    code = grpc.StatusCode.CANCELLED


class PeerUnavailable(NodeError):
    """Another node this call needed could not be reached, or a KV write to it failed."""

    code = grpc.StatusCode.UNAVAILABLE


class Refused(NodeError):
    """The request is well-formed but the node's state does not allow it (a peer that
    cannot take this node's KV, a lease that ended)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class TimedOut(NodeError):
    """Something the call waited for did not happen within its bound."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


def status_of(err: BaseException) -> grpc.StatusCode | None:
    """The status `err` ends a call with, or None for an error that is a bug."""
    if isinstance(err, NodeError):
        return err.code
    if isinstance(err, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    return None


RETRY_AFTER_S = 1  # a caller refused for load waits this long (s) before trying again


def retry_after_of(err: BaseException) -> int:
    """Whole seconds a caller refused by `err` should wait: its own `retry_after_s` where
    it knows (a token rate refills at a known pace), else RETRY_AFTER_S."""
    return getattr(err, "retry_after_s", None) or RETRY_AFTER_S


async def abort_with(context: grpc.aio.ServicerContext, err: BaseException) -> None:
    """End the call with `err`'s status and message; re-raise an error that has none. A
    refusal for load (RESOURCE_EXHAUSTED) says when to try again, as HTTP's Retry-After
    does: `retry-after` (seconds) and gRPC's own `grpc-retry-pushback-ms` trailers."""
    code = status_of(err)
    if code is None:
        raise err
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        wait_s = retry_after_of(err)
        context.set_trailing_metadata((("retry-after", str(wait_s)),
                                       ("grpc-retry-pushback-ms", str(wait_s * 1000))))
    await context.abort(code, str(err))
