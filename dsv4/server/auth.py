"""The API key: with one set (--api-key, DSV4_API_KEY), every route but /health and /metrics (and
those too with --api-key-all-routes) answers 401 with the OpenAI error object unless the request
carries `Authorization: Bearer <key>`. Checked before the body is read; compared in constant time.
"""
from __future__ import annotations

import hashlib
import hmac

from starlette.responses import JSONResponse

from ..errors import InputError
from .schemas import ApiError

OPEN_ROUTES = ("/health", "/metrics")          # load balancers and Prometheus scrapers


def check_key(key: str, source: str) -> str:
    """The key as given, or InputError naming `source` (a flag or a variable) and the fix: a key
    travels in an HTTP header, so it is printable ASCII without spaces."""
    if not key:
        raise InputError(f"{source} is empty: give a key (e.g. the output of `openssl rand -hex "
                         f"32`), or leave it unset to serve without one")
    if not all(33 <= ord(c) <= 126 for c in key):
        raise InputError(f"{source}: the key has a space, a control or a non-ASCII character; "
                         f"an API key travels in an HTTP header: use printable ASCII only")
    return key


def _digest(value: bytes) -> bytes:
    # compared as digests: equal lengths, so neither a key's content nor its length shows in time
    return hashlib.sha256(value).digest()


class ApiKeyAuth:
    """ASGI middleware: 401 (`WWW-Authenticate: Bearer`) for a guarded route without the key.
    `on_refuse(reason)` counts each refusal."""

    def __init__(self, app, key: str, all_routes: bool = False, on_refuse=lambda reason: None):
        self.app, self._want, self.all_routes = app, _digest(key.encode()), all_routes
        self.on_refuse = on_refuse

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and (self.all_routes or scope["path"] not in OPEN_ROUTES):
            err = self._check(dict(scope["headers"]).get(b"authorization"))
            if err is not None:
                self.on_refuse("api_key")
                return await JSONResponse(err.body(), status_code=err.status,
                                          headers={"WWW-Authenticate": "Bearer"})(
                    scope, receive, send)
        await self.app(scope, receive, send)

    def _check(self, header: bytes | None) -> ApiError | None:
        scheme, _, given = (header or b"").strip().partition(b" ")
        if header is None or scheme.lower() != b"bearer" or not given.strip():
            return ApiError(401, "this server needs an API key: send the header "
                                 "`Authorization: Bearer <key>` (with the openai client: "
                                 "OpenAI(api_key=<key>))", code="invalid_api_key")
        if not hmac.compare_digest(_digest(given.strip()), self._want):
            return ApiError(401, "the API key in the Authorization header is not this server's: "
                                 "send the key the server was started with (--api-key or "
                                 "DSV4_API_KEY)", code="invalid_api_key")
        return None
