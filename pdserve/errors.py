"""Errors a role raises that mean one gRPC status at the edge, whatever the role.

Servicers map them: `NodeDraining` -> UNAVAILABLE (the node is shutting down: try another),
`NodeOverloaded` -> RESOURCE_EXHAUSTED (a bounded queue or table is full: retry later or
elsewhere), `RequestAborted` -> CANCELLED (an Abort reached the request first).
"""

from __future__ import annotations


class NodeDraining(Exception):
    """The node is draining after SIGTERM and takes no new work."""


class NodeOverloaded(Exception):
    """Taking this request would exceed a bound; the message names the bound."""


class RequestAborted(Exception):
    """The request was aborted while this call was working on it."""
