"""A process's credentials, set up once at start from its parsed flags: TLS, and the keys of
runtime/auth.py.

- `configure_tls`: every command that serves or calls (`--tls-*`).
- `configure_http`: a server's HTTP port settings (`--http-*`, `--plain-http`).
- `configure_server_keys`: a server's cluster key, with the caller role its channels
  present (router or worker), and the API keys it requires when it serves Generation
  (one per tenant: `tenant:key` lines). A
  server without a cluster key says so in one warning line: its Worker calls are open.
- `client_api_key`: the API key `generate` and `chat` send (of a `tenant:key` line, the key).
A bad value (a key file missing, empty or too short; TLS flags that do not fit together)
stops the command with a message naming it, before anything starts.
"""

from __future__ import annotations

import logging

from pdserve.runtime import auth, cluster_key, http_limits, tls
from pdserve.runtime.options import from_args

OPEN_CLUSTER = "open cluster: Worker calls are not authenticated; set --cluster-key-file"


def _or_exit(args, make):
    try:
        return make()
    except ValueError as err:
        raise SystemExit(f"pdserve {args.command}: {err}") from None


def configure_tls(args) -> None:
    config = from_args(tls.TLSConfig, args)
    if config != tls.TLSConfig():
        _or_exit(args, lambda: tls.configure(config))


def configure_http(args) -> None:
    """The HTTP port's timeouts, connection limit and `--plain-http` (runtime/http.py)."""
    _or_exit(args, lambda: http_limits.configure(from_args(http_limits.HTTPConfig, args)))


def configure_server_keys(args, role: str) -> None:
    key = _or_exit(args, lambda: cluster_key.configure(from_args(cluster_key.ClusterKeyConfig,
                                                                 args)))
    api_keys = _or_exit(args, lambda: from_args(auth.APIKeyConfig, args).tenants()) \
        if hasattr(args, "api_key") else None
    auth.configure(role, api_keys)
    if not key.enabled:
        logging.getLogger("pdserve").warning(OPEN_CLUSTER)


def client_api_key(args) -> str | None:
    """The API key of the flags (`--api-key`, `--api-key-file`, $PDSERVE_API_KEY), or None."""
    return _or_exit(args, lambda: from_args(auth.APIKeyConfig, args).load())
