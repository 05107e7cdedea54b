"""One HTTP/1.1 connection of the server: uvicorn's h11 protocol with the per-connection bounds of
limits.Limits. A request must arrive whole (head and body) within `read_timeout` of the connection
opening or of the previous reply (else 408: a client that stalls mid-request holds a connection);
a head over `max_header_bytes` gets 431, a malformed one 400; a connection beyond
`max_connections` open gets 503 with Retry-After. Each answer is the OpenAI error object, written
before the connection closes; the connection then lingers a moment, reading and dropping what the
client still sends, so that a client still writing reads the answer instead of a reset.

Built on uvicorn's H11Protocol (uvicorn >= 0.29: `conn`, `cycle`, `transport`, `connections`,
`timeout_keep_alive_task` and the hooks overridden below; tested with uvicorn 0.54, h11 0.16);
tests/dsv4/server/test_exposed.py drives each bound through a socket.
"""
from __future__ import annotations

import http
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .limits import Limits
from .schemas import ApiError

LINGER_S = 2.0          # after an answer on a closing connection: read (and drop) this long
RETRY_AFTER_S = 1       # the Retry-After of a 503 for too many connections


def bounded_protocol(limits: Limits, on_refuse=lambda reason: None) -> type:
    """The protocol class to give uvicorn (`uvicorn.Config(http=...)`), bound to `limits`;
    `on_refuse(reason)` counts each refusal: "timeout", "header", "connections"."""
    return type("BoundedH11Protocol", (BoundedH11Protocol,),
                {"limits": limits, "on_refuse": staticmethod(on_refuse)})


class BoundedH11Protocol(H11Protocol):
    """See the module docstring; `limits` and `on_refuse` are set by bounded_protocol."""
    limits: Limits
    on_refuse = staticmethod(lambda reason: None)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._deadline = None            # asyncio.TimerHandle: read_timeout, or the linger
        self._lingering = False          # answered and closing: incoming bytes are dropped
        self._served = 0                 # requests answered on this connection

    # ---- the asyncio.Protocol hooks ------------------------------------------------------------
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        n = len(self.connections)        # this one included
        if n > self.limits.max_connections:
            self.on_refuse("connections")
            self._answer(ApiError(503, f"the server has {n - 1} connections open, its limit "
                                       f"(--max-connections {self.limits.max_connections}); "
                                       f"retry after {RETRY_AFTER_S} s", kind="server_error",
                                  code="too_many_connections",
                                  headers={"Retry-After": str(RETRY_AFTER_S)}))
            return
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return
        super().data_received(data)
        self._settle()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    # ---- uvicorn's hooks ----------------------------------------------------------------------
    def on_response_complete(self) -> None:
        self._served += 1
        super().on_response_complete()   # may start a pipelined request (and answer it)
        if not self._lingering and not self.transport.is_closing():
            self._arm()                  # the next request, or the rest of this one's body
            self._settle()

    def send_400_response(self, msg: str) -> None:
        """h11 refused the request head: too large (431) or not HTTP (400)."""
        buffered = len(self.conn.trailing_data[0])
        if buffered > self.limits.max_header_bytes:
            self.on_refuse("header")
            err = ApiError(431, f"the request head (request line and headers) is over "
                                f"{self.limits.max_header_bytes} bytes (--max-header-bytes): send "
                                f"fewer or shorter headers", code="header_too_large")
        else:
            err = ApiError(400, f"the request is not valid HTTP/1.1 ({msg.rstrip('.')}): check "
                                f"the client, or the proxy in front of the server",
                           code="invalid_http")
        self._answer(err)

    def shutdown(self) -> None:
        """Server shutdown: a request still arriving gets 503 (the client may retry elsewhere)
        instead of holding the shutdown up to read_timeout; the rest as uvicorn does."""
        if self._lingering or self._replied_early():
            self.transport.close()
        elif self._arriving():
            self._answer(ApiError(503, "the server is shutting down", kind="server_error",
                                  code="shutting_down"))
        else:
            super().shutdown()

    # ---- the read deadline --------------------------------------------------------------------
    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.limits.read_timeout, self._timed_out)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _settle(self) -> None:
        """The request is whole: its reply may take as long as decoding takes."""
        if self.conn.their_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.ERROR):
            self._disarm()

    def _arriving(self) -> bool:
        """A request has begun (some bytes of its head, or its body) and is not whole yet."""
        state = self.conn.their_state
        return state is h11.SEND_BODY or (state is h11.IDLE and bool(self.conn.trailing_data[0]))

    def _replied_early(self) -> bool:
        """Answered (a 401, a 413) while the body still comes: uvicorn reads and drops it."""
        return (self.conn.their_state is h11.SEND_BODY and self.cycle is not None
                and self.cycle.response_started)

    def _timed_out(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self._replied_early():
            self.transport.close()       # the rest of the body never came
        elif self._arriving():
            self.on_refuse("timeout")
            self._answer(ApiError(408, f"the request did not arrive whole within "
                                       f"{self.limits.read_timeout:g} s (--read-timeout): send "
                                       f"it at once; a request that stalls holds a connection",
                                  code="request_timeout"))
        elif self._served and self.timeout_keep_alive_task is not None:
            # idle between requests: uvicorn's keep-alive timeout closes it. Closing it here too
            # (a --read-timeout below that timeout) races a client reusing the connection: its
            # request meets the close (a pooled httpx client then fails the request)
            return
        else:                            # nothing of a request: close quietly
            if not self._served:
                self.on_refuse("timeout")
            self.transport.close()

    # ---- answering outside the app ------------------------------------------------------------
    def _answer(self, err: ApiError) -> None:
        """Write `err` as a complete response, then linger and close."""
        body = json.dumps(err.body()).encode()
        head = [f"HTTP/1.1 {err.status} {http.HTTPStatus(err.status).phrase}",
                "content-type: application/json", f"content-length: {len(body)}",
                "connection: close", *(f"{k}: {v}" for k, v in err.headers.items())]
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True    # the app, waiting for the body, sees a disconnect
            self.cycle.message_event.set()
        self.transport.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        self._lingering = True
        self._disarm()
        self.transport.resume_reading()       # keep reading: drop what comes, no reset
        if self.transport.can_write_eof():
            self.transport.write_eof()        # the client reads the answer, then the end
        self._deadline = self.loop.call_later(LINGER_S, self.transport.close)
