"""What a client library user reads when the server cannot be reached: the address tried
and what to check, not gRPC's connection text alone."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.client import AsyncClient, PdserveError
from pdserve.procs import free_port


def test_an_unreachable_server_is_named_with_what_to_check():
    address = f"127.0.0.1:{free_port()}"  # nothing listens there

    async def go():
        async with AsyncClient(address, retries=0, timeout=30) as client:
            with pytest.raises(PdserveError) as err:
                await client.generate("hello")
        return err.value

    err = asyncio.run(asyncio.wait_for(go(), 60))
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert str(err).startswith(f"UNAVAILABLE: no pdserve server answers at {address}: is it "
                               f"running, and is that its host and port?"), str(err)
