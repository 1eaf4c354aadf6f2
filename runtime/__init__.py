"""The node runtime: what every pdserve process that serves stands on, router and workers
alike, with no knowledge of any role.

- `server`: the grpc.aio server on uvloop, health, reflection, drain on SIGTERM, channels.
- `tls`: optional TLS and mutual TLS for every endpoint and channel.
- `auth`, `bearer`, `cluster_key`: who may call what (client API key, Worker RPCs per
  caller role by cluster token or certificate name), the bearer tokens every channel
  presents, and the cluster's shared secret.
- `http`: the aiohttp side of a node (/metrics, /health; the router adds its OpenAI API).
- `metrics`, `logs`, `observe`: Prometheus metrics, one log line per request, and the
  explicit calls services make to record what they saw.
- `errors`: errors that mean one gRPC status, and the one mapping to statuses.
- `checks`: wire-value checks every edge makes (request ids).
- `identity`, `membership`: a node's model identity (and pdserve's version), and etcd
  registration.
- `options`: command-line flags written once, on configuration dataclass fields.
- `gates`: test-only pause points.
Imports `proto` only, below it; the roles import it.
"""
