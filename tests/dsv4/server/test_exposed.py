"""The server run as if exposed, on 127.0.0.1 only: a real server process (scripts/serve.py, the
tiny demo checkpoint) with an API key from DSV4_API_KEY and tight bounds, driven through the
openai client, httpx and raw sockets.

The key guards every route but /health and /metrics (401 with the OpenAI error object, before the
body is read); a body over --max-request-bytes is refused (413) before it is read (a larger
Content-Length) or as soon as it goes past the cap (chunked); a client that stalls mid-request
gets 408 and loses its connection after --read-timeout; a head over --max-header-bytes gets 431;
a connection beyond --max-connections gets 503. Last, a soak (dsv4.bench.soak, every kind of
request at once from 8 clients): no 5xx, each request the answer of its kind, the queue drained,
resident memory after a warm-up growing by less than RSS_GROWTH (read as two steps: a leak
raises both); then SIGTERM, with a request half sent, exits
0 with nothing left running.
"""
import json
import socket
import time
from pathlib import Path

import pytest

from serving import ServerProcess, openai_client, require_serve_packages

require_serve_packages()

import httpx  # noqa: E402
import openai  # noqa: E402

from dsv4.bench.soak import KINDS, Soak, soak_in_phases  # noqa: E402
from dsv4.cli.options import demo_checkpoint  # noqa: E402

KEY = "test-key-5c0f1e"
BODY_CAP = 64 * 1024
READ_TIMEOUT = 1.0
MAX_CONNECTIONS = 32
# a leak's bound: the soak's peak resident memory grows by less than this over the 140 requests
# after its warm-up. Read as two steps (the first half's peak over the warm-up's, the second
# half's over the first's), each within half of it: a leak raises both; what does not repeat
# does not. Not the idle figures, which move by up to ~65 MiB with the blocks the last request
# left (glibc keeps or returns them), and not one step: the server's memory can step up once by
# ~50-65 MiB at a moment that depends on the order of requests and the machine's load (glibc
# keeping blocks of a size in its heap from some free on; two runs of test_server.py here idled
# at 466 and 530 MiB), which failed one CI run (2026-11-28: the peak 439 -> 479 MiB, idle 415 ->
# 464, where ~20 repeats grew 0.2-9 MiB). A leak of RSS_GROWTH over the phase puts ~half of it
# in each step. The peaks otherwise hold still (1,500 requests: 458.8 MiB in the warm-up, 458.9
# after it).
RSS_GROWTH = 32 * 2 ** 20
MESSAGES = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("exposed") / "server.log"
    srv = ServerProcess(["--ckpt", demo_checkpoint(), "--max-seq-len", 512, "--max-queue", 8,
                         "--max-request-bytes", "64K", "--read-timeout", READ_TIMEOUT,
                         "--max-connections", MAX_CONNECTIONS, "--log-level", "warning"],
                        log=log, env={"DSV4_API_KEY": KEY})
    yield srv
    srv.stop()


def _refused(server) -> dict:
    text = httpx.get(server.url + "/metrics").text
    return {ln.split('"')[1]: int(float(ln.rsplit(" ", 1)[1])) for ln in text.splitlines()
            if ln.startswith("dsv4_refused_total{")}


def _raw(server, data: bytes, wait: float = 30) -> tuple[bytes, float]:
    """Send `data` on a fresh connection, read until the server closes it: (bytes, seconds)."""
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.settimeout(wait)
        t0 = time.monotonic()
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out, time.monotonic() - t0


def _one_response(s: socket.socket) -> bytes:
    """One whole response from `s` (its head, then Content-Length bytes of body)."""
    out = b""
    while b"\r\n\r\n" not in out:
        out += s.recv(65536) or b"<closed>"
        assert not out.endswith(b"<closed>"), out
    head, _, body = out.partition(b"\r\n\r\n")
    length = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n")
                      if ln.lower().startswith(b"content-length:")))
    while len(body) < length:
        body += s.recv(65536)
    return head + b"\r\n\r\n" + body


def _status_and_error(response: bytes) -> tuple[int, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)["error"]


def test_the_key_guards_every_route_but_health_and_metrics(server):
    right = openai_client(server, api_key=KEY)
    assert right.chat.completions.create(model="demo-tiny-v1", messages=MESSAGES,
                                         max_tokens=1).choices
    with pytest.raises(openai.AuthenticationError) as e:
        openai_client(server, api_key="wrong").models.list()
    assert e.value.status_code == 401
    for headers in ({}, {"Authorization": "Bearer"}, {"Authorization": f"Basic {KEY}"},
                    {"Authorization": f"Bearer {KEY}x"}, {"Authorization": f"Bearer {KEY[:-1]}"}):
        r = httpx.get(server.url + "/v1/models", headers=headers)
        err = r.json()["error"]
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", headers
        assert err["code"] == "invalid_api_key", err
        assert "Authorization: Bearer" in err["message"] or "--api-key" in err["message"], err
        assert KEY not in r.text
    # checked before the body is read or parsed, and unknown routes show nothing without it
    assert httpx.post(server.url + "/v1/chat/completions", content=b"{bad").status_code == 401
    assert httpx.get(server.url + "/v1/nowhere").status_code == 401
    assert httpx.get(server.url + "/v1/nowhere",
                     headers={"Authorization": f"Bearer {KEY}"}).status_code == 404
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    assert "dsv4_refused_total" in httpx.get(server.url + "/metrics").text


def test_a_body_over_the_cap_is_refused_before_it_is_read(server):
    before = _refused(server)
    # a head declaring a gigabyte, and no body at all: the answer cannot have waited for it
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {10 ** 9}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.settimeout(30)
        s.sendall(head)
        status, err = _status_and_error(_one_response(s))
    assert status == 413 and err["code"] == "request_too_large"
    assert all(w in err["message"] for w in (str(10 ** 9), str(BODY_CAP), "--max-request-bytes"))

    def pieces():                                   # chunked: no length to judge up front
        for _ in range(BODY_CAP // 4096 + 8):
            yield b" " * 4096
    r = httpx.post(server.url + "/v1/chat/completions", content=pieces(),
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    # a body of exactly the cap is read and parsed (here: not JSON)
    r = httpx.post(server.url + "/v1/chat/completions", content=b"{" * BODY_CAP,
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    assert _refused(server)["too_large"] - before["too_large"] == 2


def test_a_client_that_stalls_gets_408_and_loses_its_connection(server):
    before = _refused(server)
    half_line = b"POST /v1/chat/completions HT"
    half_body = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                 f"Content-Length: 100\r\n\r\n{{\"prompt\": ").encode()
    for data in (half_line, half_body):
        out, took = _raw(server, data)
        status, err = _status_and_error(out)
        assert status == 408 and "--read-timeout" in err["message"], out
        assert READ_TIMEOUT * 0.9 <= took < READ_TIMEOUT + 10, took
    out, took = _raw(server, b"")                    # connects and says nothing
    assert out == b"" and READ_TIMEOUT * 0.9 <= took < READ_TIMEOUT + 10, (out, took)
    assert _refused(server)["timeout"] - before["timeout"] == 3
    # idle between two requests is not stalling: the connection outlives --read-timeout (uvicorn's
    # keep-alive timeout, 5 s, closes it), so a client reusing it never meets a close
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.settimeout(30)
        for _ in range(2):
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert _one_response(s).startswith(b"HTTP/1.1 200 ")
            time.sleep(1.5 * READ_TIMEOUT)
    assert _refused(server)["timeout"] - before["timeout"] == 3


def test_a_head_too_large_or_not_http_gets_a_4xx_error_object(server):
    out, _ = _raw(server, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 20000 + b"\r\n")
    status, err = _status_and_error(out)
    assert status == 431 and "--max-header-bytes" in err["message"]
    out, _ = _raw(server, b"HELLO THERE\r\n\r\n")
    status, err = _status_and_error(out)
    assert status == 400 and "HTTP/1.1" in err["message"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_connections_beyond_the_cap_get_503_with_retry_after(server):
    before = _refused(server)
    # idle connections, opened well within --read-timeout: the server counts them all
    held = [socket.create_connection(("127.0.0.1", server.port))
            for _ in range(MAX_CONNECTIONS + 2)]
    try:
        time.sleep(0.3 * READ_TIMEOUT)
        answers = []
        for s in held:
            s.setblocking(False)
            try:
                answers.append(s.recv(65536))      # a refused one was answered at once
            except BlockingIOError:
                answers.append(None)
    finally:
        for s in held:
            s.close()
    refused = [i for i, a in enumerate(answers) if a]
    assert refused and refused[0] <= MAX_CONNECTIONS, answers
    assert all(a is None for a in answers[:refused[0]])
    status, err = _status_and_error(answers[refused[0]])
    assert status == 503 and b"Retry-After: 1" in answers[refused[0]]
    assert "--max-connections" in err["message"] and err["code"] == "too_many_connections"
    assert _refused(server)["connections"] - before["connections"] == len(refused)
    deadline = time.monotonic() + 10                # the held ones are gone: served again
    while httpx.get(server.url + "/health").status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert httpx.get(server.url + "/health").status_code == 200


def test_soak_then_sigterm_exits_0_with_nothing_left(server):
    """Last in this file: it stops the module's server."""
    before = _refused(server)
    target = Soak(server.url, KEY, BODY_CAP, READ_TIMEOUT)
    out = soak_in_phases(target, n=200, warmup=60, concurrency=8, seed=0, rss=server.rss_bytes,
                         sample_s=0.2)
    assert out["errors"] == 0, out["first_errors"]
    assert out["drained"] and set(out["answers"]) == set(KINDS), out["answers"]
    after, sent = _refused(server), {k: sum(v.values()) for k, v in out["answers"].items()}
    assert after["api_key"] - before["api_key"] == sent["wrong_key"] + sent["no_key"]
    assert after["too_large"] - before["too_large"] == sent["oversized"]
    assert after["timeout"] - before["timeout"] == sent["slow"]
    metrics = httpx.get(server.url + "/metrics").text
    assert 'outcome="error"' not in metrics and 'outcome="rejected"' not in metrics
    samples = [mib for *_, mib in out["rss_over_time"]]
    half = len(samples) // 2
    assert half >= 5, out["rss_over_time"]
    first, second = max(samples[:half]), max(samples[half:] + [out["rss_mib"]["end"]])
    steps = (first - out["rss_mib"]["peak_warmup"], second - first)
    assert min(steps) * 2 ** 20 < RSS_GROWTH / 2, (steps, out["rss_mib"])

    # SIGTERM while a client is half-way through a request and another sits idle: the half one is
    # answered (503 shutting down, or its 408 if the read timeout came first), neither holds the
    # shutdown up
    half = socket.create_connection(("127.0.0.1", server.port))
    half.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                 f"Content-Length: 100\r\n\r\n{{".encode())
    idle = socket.create_connection(("127.0.0.1", server.port))
    pid, t0 = server.proc.pid, time.monotonic()
    assert server.stop() == 0
    assert time.monotonic() - t0 < 30
    half.settimeout(10)
    status, err = _status_and_error(_one_response(half))
    assert (status, err["code"]) in ((503, "shutting_down"), (408, "request_timeout")), err
    half.close()
    idle.close()
    assert "session closed" in server.stderr_tail()
    assert not Path(f"/proc/{pid}").exists()        # reaped: no process, no thread left
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", server.port), timeout=2)
