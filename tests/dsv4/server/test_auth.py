"""The API key in process: which routes it guards, the 401 and its error object (the body never
read), the key's checks, and the command's side: --api-key over DSV4_API_KEY, the bounds' flags,
and the warning for a server bound beyond loopback without a key (the key never printed); every
flag in docs/SERVING.md."""
import asyncio
import json

import pytest

pytest.importorskip("starlette", reason="the server tests need starlette (pip install -e '.[dev]')")

from dsv4.cli.serve import build_parser, exposure_warning, limits_of, loopback, \
    server_env  # noqa: E402
from dsv4.errors import InputError  # noqa: E402
from dsv4.server.auth import ApiKeyAuth, check_key  # noqa: E402

KEY = "k-3f9a1c"


def _call(mw, path: str, authorization: str | None = None):
    """-> (status, headers, body, whether the app ran, receive calls)."""
    ran, calls, sent = [False], [0], []

    async def receive():
        calls[0] += 1
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(msg):
        sent.append(msg)

    async def app(scope, receive, send):
        ran[0] = True
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    headers = [] if authorization is None else [(b"authorization", authorization.encode())]
    asyncio.run(mw(app)({"type": "http", "method": "POST", "path": path, "headers": headers},
                        receive, send))
    return (sent[0]["status"], dict(sent[0]["headers"]), sent[1]["body"], ran[0], calls[0])


def test_the_key_guards_all_but_health_and_metrics():
    refusals = []
    mw = lambda app: ApiKeyAuth(app, KEY, on_refuse=refusals.append)   # noqa: E731
    for path in ("/v1/chat/completions", "/v1/models", "/v1/nowhere", "/nowhere"):
        for auth in (None, "Bearer", f"Basic {KEY}", f"Bearer {KEY}0", f"Bearer {KEY[:-1]}",
                     f"bearer  {KEY.upper()}"):
            status, headers, body, ran, calls = _call(mw, path, auth)
            assert (status, ran, calls) == (401, False, 0), (path, auth)
            assert headers[b"www-authenticate"] == b"Bearer"
            err = json.loads(body)["error"]
            assert err["code"] == "invalid_api_key" and KEY not in err["message"]
            assert "Authorization: Bearer <key>" in err["message"] or "--api-key" in err["message"]
        assert _call(mw, path, f"Bearer {KEY}")[:1] == (200,)
        assert _call(mw, path, f"bearer  {KEY} ")[:1] == (200,)    # the scheme in any case
    for path in ("/health", "/metrics"):
        assert _call(mw, path)[:1] == (200,)
        everywhere = lambda app: ApiKeyAuth(app, KEY, all_routes=True)   # noqa: E731
        assert _call(everywhere, path)[:1] == (401,)
        assert _call(everywhere, path, f"Bearer {KEY}")[:1] == (200,)
    assert len(refusals) == 4 * 6


def test_a_key_that_cannot_travel_in_a_header_is_refused_at_startup():
    assert check_key(KEY, "--api-key") == KEY
    with pytest.raises(InputError, match="DSV4_API_KEY is empty: give a key"):
        check_key("", "DSV4_API_KEY")
    for bad in ("has space", "tab\there", "ключ", "new\nline"):
        with pytest.raises(InputError, match="--api-key: .*printable ASCII") as e:
            check_key(bad, "--api-key")
        assert bad not in str(e.value)


def test_the_flag_wins_over_the_environment_and_neither_is_printed():
    p = build_parser()
    assert server_env(p.parse_args([]), env={}) is None
    assert server_env(p.parse_args([]), env={"DSV4_API_KEY": KEY}) == KEY
    assert server_env(p.parse_args(["--api-key", "other"]), env={"DSV4_API_KEY": KEY}) == "other"
    with pytest.raises(InputError, match="DSV4_API_KEY is empty"):
        server_env(p.parse_args([]), env={"DSV4_API_KEY": ""})
    assert KEY not in p.format_help()


def test_the_bounds_flags():
    p = build_parser()
    lim = limits_of(p.parse_args(["--max-seq-len", "65536"]))
    assert (lim.max_request_bytes, lim.max_header_bytes, lim.read_timeout, lim.max_connections) \
        == (8 * 2 ** 20, 16384, 30.0, 64)
    lim = limits_of(p.parse_args(["--max-request-bytes", "2M", "--max-header-bytes", "8K",
                                  "--read-timeout", "5", "--max-connections", "20"]))
    assert (lim.max_request_bytes, lim.max_header_bytes, lim.read_timeout, lim.max_connections) \
        == (2 * 2 ** 20, 8192, 5.0, 20)
    with pytest.raises(InputError, match=r"--max-connections 10: must be >= --max-queue \+ 2 = 18"):
        limits_of(p.parse_args(["--max-connections", "10"]))
    with pytest.raises(InputError, match="--max-request-bytes lots: expected a size"):
        limits_of(p.parse_args(["--max-request-bytes", "lots"]))


def test_a_server_beyond_loopback_without_a_key_warns():
    assert loopback("127.0.0.1") and loopback("::1") and loopback("localhost")
    assert not loopback("0.0.0.0") and not loopback("::")
    assert exposure_warning("127.0.0.1", 8000, None) is None
    assert exposure_warning("0.0.0.0", 8000, KEY) is None
    w = exposure_warning("0.0.0.0", 8000, None)
    assert all(s in w for s in ("--host 0.0.0.0", "port 8000", "/v1/chat/completions",
                                "DSV4_API_KEY", "TLS"))


def test_serving_md_names_every_flag_of_serve():
    from pathlib import Path
    doc = (Path(__file__).resolve().parents[3] / "docs" / "SERVING.md").read_text()
    for action in build_parser()._actions:
        for flag in action.option_strings:
            if flag.startswith("--") and flag not in ("--help", "--allow-force-ids"):
                assert f"`{flag}" in doc, flag
