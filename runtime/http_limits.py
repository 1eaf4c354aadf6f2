"""The HTTP port's limits and TLS choice (`HTTPConfig`, the `--http-*` flags and
`--plain-http`), set once per process at start and read by runtime/http.py when it serves.

Apart from runtime/http.py so the command line builds its flags without aiohttp, which
only a server install has (the light client parses the same `pdserve` commands).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pdserve.runtime.options import option

ORIGIN = re.compile(r"https?://[^/\s:]+(:\d+)?")  # a page's origin: scheme, host and port, no path


@dataclass(frozen=True)
class HTTPConfig:
    http_header_timeout_s: float = option(
        10.0, "HTTP port: seconds a connection has to send a request's headers, and may stay "
              "idle between requests, before it is closed")
    http_body_timeout_s: float = option(
        30.0, "HTTP port: seconds a request's body may take to arrive; then 408")
    http_max_connections: int = option(
        1024, "HTTP port: open connections at most; a new one beyond it is closed at once")
    plain_http: bool = option(
        False, "serve the HTTP port (OpenAI API, /metrics) as plain HTTP even with --tls-cert "
               "(default: HTTPS whenever --tls-cert is set, so the API key never crosses in "
               "clear)")
    responses_store_mb: float = option(
        64.0, "/v1/responses: MiB of answered responses this server keeps in memory for "
              "previous_response_id and GET/DELETE /v1/responses/ID, and apart as much of "
              "/v1/conversations, least recently used first out (0: none kept)")
    responses_store_dir: str | None = option(
        None, "keep the stored responses and conversations in this directory as well: read "
              "when the server starts, each change journaled as made, so a restart or a kill "
              "keeps them (one server per directory; router/store_file.py)", type=str, metavar="DIR")
    sse_keepalive_s: float = option(
        15.0, "HTTP port: a streamed answer with nothing to send for this long sends a "
              "keep-alive (an SSE comment; Anthropic's ping event), so proxies with a read "
              "timeout keep it open while it waits for a token; 0: none")
    allowed_origins: list[str] = option(
        help="browser pages from this origin (https://host[:port]; * for any) may call the HTTP "
             "port (CORS; repeat or comma-separate for several; default: none)",
        metavar="ORIGIN", default_factory=list)

    @property
    def origins(self) -> frozenset[str]:
        return frozenset(o.strip().rstrip("/") for given in self.allowed_origins for o in given.split(",")
                         if o.strip())

    def validate(self) -> None:
        for origin in self.origins:
            if origin != "*" and not ORIGIN.fullmatch(origin):
                raise ValueError(f"--allowed-origins {origin!r} is not an origin: give scheme://host[:port] "
                                 "(e.g. https://app.example.com) or *")
        for name in ("http_header_timeout_s", "http_body_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got "
                                 f"{getattr(self, name)}")
        if self.sse_keepalive_s < 0:
            raise ValueError(f"--sse-keepalive-s must be >= 0 (0: no keep-alives), got {self.sse_keepalive_s}")
        if self.responses_store_mb < 0:
            raise ValueError(f"--responses-store-mb must be >= 0, got {self.responses_store_mb}")
        if self.http_max_connections < 1:
            raise ValueError(f"--http-max-connections must be >= 1, got "
                             f"{self.http_max_connections}")


_config = HTTPConfig()


def configure(config: HTTPConfig) -> None:
    global _config
    config.validate()
    _config = config


def current() -> HTTPConfig:
    return _config
