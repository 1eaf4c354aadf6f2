"""The wire protocol: `pdserve.proto` (package `pdserve.v1`: the client-facing Generation
service and the Worker service between router and workers), `testing.proto` (test-only
gates), their generated stubs (`python -m pdserve.proto.generate`; a test keeps them in sync) and
the names both worker roles put on the wire (`tags`). The bottom layer: imports nothing of
pdserve's.
"""
