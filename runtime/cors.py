"""Browser pages from other origins calling the HTTP port (CORS), for `--allowed-origins`.

Off by default: a page on another site has no business spending this server's model, and
a browser keeps it from reading the answers unless the server says otherwise. With
origins listed (or `*`, any):
- A request whose `Origin` is allowed gets `Access-Control-Allow-Origin` naming it (and
  `Vary: Origin`), on every answer, streamed ones too (set as the answer's headers go
  out), with `X-Request-Id` and `Retry-After` readable by the page.
- A preflight (`OPTIONS` with `Access-Control-Request-Method`) from an allowed origin is
  answered 204 before any other middleware: browsers send it without the API key, which
  the request that follows carries. From another origin it is a 403 naming the flag.
No credentials (cookies) are allowed: the API key travels in the `Authorization` header.

aiohttp-cors would need each route registered and answers preflights from a handler, after
the app's middlewares, which refuse a request without the API key.
"""

from __future__ import annotations

from aiohttp import web

EXPOSED = "X-Request-Id, Retry-After"
METHODS = "GET, POST, OPTIONS"
DEFAULT_HEADERS = "Authorization, Content-Type, X-Request-Id"
MAX_AGE_S = "600"


def install(app: web.Application, origins: frozenset[str]) -> None:
    """Answer `origins`' browser calls on `app` (nothing when there are none)."""
    if not origins:
        return

    def allowed(request: web.Request) -> str | None:
        origin = request.headers.get("Origin")
        return origin if origin and ("*" in origins or origin in origins) else None

    @web.middleware
    async def preflight(request: web.Request, handler):
        if request.method != "OPTIONS" or "Access-Control-Request-Method" not in request.headers:
            return await handler(request)
        origin = allowed(request)
        if origin is None:
            return web.json_response({"error": {
                "message": f"origin {request.headers.get('Origin')!r:.100} may not call this server: "
                           "start it with --allowed-origins naming it", "type": "invalid_request_error",
                "param": None, "code": "origin_not_allowed"}}, status=403)
        return web.Response(status=204, headers={
            "Access-Control-Allow-Methods": METHODS, "Access-Control-Max-Age": MAX_AGE_S,
            "Access-Control-Allow-Headers": request.headers.get("Access-Control-Request-Headers",
                                                                DEFAULT_HEADERS)})

    async def mark(request: web.Request, response: web.StreamResponse) -> None:
        origin = allowed(request)
        if origin is not None:
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Access-Control-Expose-Headers"] = EXPOSED
            response.headers.add("Vary", "Origin")

    app.middlewares.insert(0, preflight)  # outermost: before the API key is asked for
    app.on_response_prepare.append(mark)
