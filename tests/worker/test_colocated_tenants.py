"""A `serve` node's Generation Abort keeps tenants apart as a router does: it reaches only
the caller's own request (by its node-side id, `id@tenant`), and any other id answers
NOT_FOUND in the same words. The decode role is a stand-in recording what it was asked."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.proto import pdserve_pb2
from pdserve.runtime import auth
from pdserve.runtime.bearer import bearer_metadata
from pdserve.worker.colocated import ColocatedService


class Aborted(Exception):
    def __init__(self, code, details):
        super().__init__(details)
        self.code, self.details = code, details


class Context:
    def __init__(self, key: str) -> None:
        self.metadata = bearer_metadata(key)

    def invocation_metadata(self):
        return self.metadata

    async def abort(self, code, details):
        raise Aborted(code, details)


class Role:
    def __init__(self, running: set[str]) -> None:
        self.running, self.asked = running, []

    async def abort(self, request_id: str, settled: bool) -> bool:
        self.asked.append(request_id)
        return request_id in self.running


def test_a_serve_nodes_abort_reaches_only_the_callers_own_request(monkeypatch):
    monkeypatch.setattr(auth, "_settings", auth.Settings())
    auth.configure(None, {"alice": "sk-a", "bob": "sk-b"})
    service = ColocatedService.__new__(ColocatedService)  # no model: Abort needs the role only
    service.role = Role({"r@alice"})

    async def abort(key: str, request_id: str):
        try:
            return await service.Abort(pdserve_pb2.AbortRequest(request_id=request_id),
                                       Context(key))
        except Aborted as err:
            return err

    async def go():
        return [await abort("sk-b", "r"), await abort("sk-b", "never"),
                await abort("sk-a", "r")]

    theirs, never, own = asyncio.run(go())
    assert theirs.code == never.code == grpc.StatusCode.NOT_FOUND
    assert theirs.details.replace("'r'", "X") == never.details.replace("'never'", "X")
    assert own.found is True
    assert service.role.asked == ["r@bob", "never@bob", "r@alice"]


def test_an_id_too_long_for_the_tenant_is_not_found(monkeypatch):
    key = "sk-a"
    monkeypatch.setattr(auth, "_settings", auth.Settings())
    auth.configure(None, {"alice": key})
    service = ColocatedService.__new__(ColocatedService)
    service.role = Role(set())
    with pytest.raises(Aborted) as err:
        asyncio.run(service.Abort(pdserve_pb2.AbortRequest(request_id="r" * 256), Context(key)))
    assert err.value.code == grpc.StatusCode.NOT_FOUND and service.role.asked == []
