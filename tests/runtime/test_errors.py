"""One mapping from errors to gRPC statuses, whichever role raises them."""

from __future__ import annotations

import grpc
import pytest

from pdserve.runtime.errors import (NodeDraining, NodeError, NodeOverloaded, PeerUnavailable, Refused,
                            RequestAborted, TimedOut, status_of)


@pytest.mark.parametrize("err,code", [
    (NodeDraining("x"), grpc.StatusCode.UNAVAILABLE),
    (NodeOverloaded("x"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (RequestAborted("x"), grpc.StatusCode.CANCELLED),
    (PeerUnavailable("x"), grpc.StatusCode.UNAVAILABLE),
    (Refused("x"), grpc.StatusCode.FAILED_PRECONDITION),
    (TimedOut("x"), grpc.StatusCode.DEADLINE_EXCEEDED),
    (NodeError("x", grpc.StatusCode.NOT_FOUND), grpc.StatusCode.NOT_FOUND),
    (ValueError("x"), grpc.StatusCode.INVALID_ARGUMENT),
])
def test_each_error_kind_is_one_status(err, code):
    assert status_of(err) == code


def test_an_error_of_no_kind_is_a_bug_not_a_status():
    assert status_of(RuntimeError("boom")) is None
    assert status_of(KeyError("k")) is None
