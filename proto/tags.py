"""Wire-level names shared by prefill and decode nodes (they may not import each other).

The KV-ready notification a prefill node posts after its NIXL writes carries
`notification_tag(request_id, lease_id)`: the lease id makes a late or stale notification
unable to release any other reservation of the same request id.

`no_write_tag(request_id, lease_id)` is the prefill node's promise that it did not and
will not write that reservation's KV (its RemoteSend ended before any write began), so
the decode node may reuse the pages at once instead of quarantining them.
"""


def notification_tag(request_id: str, lease_id: str) -> bytes:
    return f"pdserve:{request_id}:{lease_id}".encode()


def no_write_tag(request_id: str, lease_id: str) -> bytes:
    return f"pdserve-nowrite:{request_id}:{lease_id}".encode()
