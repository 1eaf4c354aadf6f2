"""A worker node: one engine and one NIXL agent serving the prefill role, the decode role,
or both (`pdserve prefill`, `decode`, `serve`). `app` builds and runs the node
(`run_worker`) and samples its gauges; `service` is its Worker gRPC service, assembled from
the roles' halves (prefill/service.py, decode/service.py) plus the node's own RPCs; `node`
is what one worker process holds; `colocated` is the Generation service of a `both` node;
`config` holds its flags. Imports the roles (and the router's tokenizer, for `colocated`);
no role imports it.
"""
