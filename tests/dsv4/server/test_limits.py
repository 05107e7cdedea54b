"""The bounds of dsv4.server.limits and the body's middleware (dsv4.server.body), in process: sizes
and their errors, the default body cap against the real vocabulary, and a body refused while it
is read (the app never called, nothing read past the cap)."""
import asyncio
import json

import pytest

from dsv4.errors import InputError
from dsv4.server.limits import (BODY_BYTES_PER_TOKEN, MIB, MIN_BODY_BYTES, Limits,
                                default_request_bytes, parse_size)

pytest.importorskip("starlette", reason="the server tests need starlette (pip install -e '.[dev]')")

from dsv4.server.body import BodyLimit  # noqa: E402


def test_sizes_and_their_errors():
    assert [parse_size(t, "--x") for t in ("4096", "512K", "64M", "1G", "2MiB", " 3 kb")] == \
        [4096, 512 * 1024, 64 * MIB, 2 ** 30, 2 * MIB, 3 * 1024]
    for bad in ("", "-1", "1.5M", "12T", "M"):
        with pytest.raises(InputError, match=r"--max-request-bytes .*e\.g\. 1048576, 512K"):
            parse_size(bad, "--max-request-bytes")
    with pytest.raises(InputError, match="--read-timeout 0: must be > 0"):
        Limits(MIB, read_timeout=0)
    with pytest.raises(InputError, match="--max-header-bytes 100: must be >= 1024"):
        Limits(MIB, max_header_bytes=100)
    with pytest.raises(InputError, match="--max-request-bytes 0: must be >= 1"):
        Limits(0)
    assert Limits.for_context(4096, read_timeout=None).max_request_bytes == MIN_BODY_BYTES
    assert Limits.for_context(65536, max_connections=8) == Limits(8 * MIB, max_connections=8)


def test_the_default_body_cap_holds_any_prompt_that_fits_the_context():
    """The cap is BODY_BYTES_PER_TOKEN a token of --max-seq-len: no token of the vocabulary takes
    more as JSON text (ASCII-escaped, as json.dumps writes it), so a prompt of the longest tokens
    that fills the context still fits."""
    from dsv4.cli.options import demo_checkpoint
    from dsv4.text.tokenizer import load_tokenizer
    tok = load_tokenizer(demo_checkpoint())
    special = tok.special_ids()
    longest = max(len(json.dumps(tok.decode([i]))) - 2 for i in range(tok.vocab_size)
                  if i not in special)
    assert longest <= BODY_BYTES_PER_TOKEN, longest
    assert default_request_bytes(1 << 20) == BODY_BYTES_PER_TOKEN << 20
    assert default_request_bytes(16) == MIN_BODY_BYTES


def _drive(mw, headers: dict, chunks: list[bytes]):
    """Run ASGI middleware `mw` over one request sent as `chunks` -> (status or None if the app
    answered, receive calls made, what the app got as body or None, the response body)."""
    calls, sent, got = [0], [], [None]
    msgs = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
            for i, c in enumerate(chunks)]

    async def receive():
        calls[0] += 1
        return msgs.pop(0) if msgs else {"type": "http.disconnect"}

    async def send(msg):
        sent.append(msg)

    async def app(scope, receive, send):
        got[0] = (await receive())["body"]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    scope = {"type": "http", "method": "POST", "path": "/v1/completions",
             "headers": [(k.encode(), v.encode()) for k, v in headers.items()]}
    asyncio.run(mw(app)(scope, receive, send))
    status = sent[0]["status"]
    return status, calls[0], got[0], b"".join(m.get("body", b"") for m in sent[1:])


def test_the_body_is_refused_while_it_is_read():
    refusals = []
    mw = lambda app: BodyLimit(app, 100, on_refuse=refusals.append)   # noqa: E731
    # declared too long: refused before one receive
    status, calls, got, body = _drive(mw, {"content-length": "101"}, [b"x" * 101])
    assert (status, calls, got) == (413, 0, None)
    err = json.loads(body)["error"]
    assert err["code"] == "request_too_large" and "is 101 bytes" in err["message"]
    assert "limit of 100 bytes (--max-request-bytes)" in err["message"]
    # chunked past the cap: reading stops at the piece that crosses it, the app never runs
    status, calls, got, body = _drive(mw, {}, [b"x" * 60, b"x" * 60, b"x" * 60, b"x" * 60])
    assert (status, calls, got) == (413, 2, None) and b"goes on" in body
    # exactly the cap, in pieces: the app gets the whole body at once
    status, calls, got, _ = _drive(mw, {}, [b"a" * 50, b"b" * 50])
    assert (status, got) == (200, b"a" * 50 + b"b" * 50)
    assert refusals == ["too_large", "too_large"]


def test_a_client_that_leaves_while_sending_gets_no_answer():
    async def receive():
        return {"type": "http.disconnect"}

    sent = []

    async def send(msg):
        sent.append(msg)

    async def app(scope, receive, send):
        raise AssertionError("the app ran for a request that never arrived")

    scope = {"type": "http", "method": "POST", "path": "/", "headers": []}
    asyncio.run(BodyLimit(app, 100)(scope, receive, send))
    assert sent == []
