"""The request body's bound: an ASGI middleware that reads the body, refusing it with 413 (the
OpenAI error object) as soon as it is over --max-request-bytes, before anything parses it.
"""
from __future__ import annotations

from starlette.responses import JSONResponse

from .schemas import ApiError


def too_large(declared: int | None, limit: int) -> ApiError:
    """413 for a body of `declared` bytes (None: a body that went on past the limit)."""
    size = f"is {declared} bytes" if declared is not None else "goes on"
    return ApiError(413, f"the request body {size}, over this server's limit of {limit} bytes "
                         f"(--max-request-bytes): send a shorter request (its prompt must fit "
                         f"--max-seq-len tokens anyway), or restart the server with a larger "
                         f"--max-request-bytes", code="request_too_large")


class BodyLimit:
    """ASGI middleware: read the whole body, refusing it with 413 as soon as it is over
    `max_bytes` (at once for a larger Content-Length: nothing is read), then hand the app the
    body and, after it, the connection's own messages (a disconnect). Holds at most `max_bytes`
    a request. `on_refuse(reason)` counts each refusal."""

    def __init__(self, app, max_bytes: int, on_refuse=lambda reason: None):
        self.app, self.max_bytes, self.on_refuse = app, max_bytes, on_refuse

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")   # digits: h11 checked it
        if declared is not None and int(declared) > self.max_bytes:
            return await self._refuse(scope, receive, send, int(declared))
        chunks, n = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":      # the client left: nobody to answer
                return
            chunk = msg.get("body", b"")
            n += len(chunk)
            if n > self.max_bytes:                    # chunked, or more than it declared
                return await self._refuse(scope, receive, send, None)
            chunks.append(chunk)
            if not msg.get("more_body", False):
                break
        body: bytes | None = b"".join(chunks)
        del chunks

        async def replay():
            nonlocal body
            if body is None:
                return await receive()                # after the body: the disconnect, if any
            # handed over once: a request that waits in the queue holds its parse, not its bytes
            msg, body = {"type": "http.request", "body": body, "more_body": False}, None
            return msg

        await self.app(scope, replay, send)

    async def _refuse(self, scope, receive, send, declared: int | None):
        self.on_refuse("too_large")
        err = too_large(declared, self.max_bytes)
        await JSONResponse(err.body(), status_code=err.status)(scope, receive, send)
