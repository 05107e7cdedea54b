"""A soak of the server: N mixed requests from C concurrent clients against a real server on
loopback, each kind with the answer it must get, and what the server's memory did meanwhile.

    python scripts/bench_soak.py [--ckpt DIR] [--requests 10000] [--duration S] [--concurrency 8]
        [--json]

The kinds (KINDS: share of the requests, expected status): short chats (the latency figure: p50 /
p99 from sending to the whole answer, the queue included), completions, streams the client cuts
after 50 bytes, streams read to [DONE], malformed bodies, an unknown model, bodies over the cap
(declared, and chunked past it), wrong and missing API keys, slow clients (half a request, then
silence), /health, /metrics and /v1/models. An error is a 5xx, a failed connection or a status
other than the kind's. The server is started by `start_server` with an API key in its
environment; its resident memory is sampled while the requests run (Linux: /proc). The plan of
kinds is drawn from a seed, so two runs send the same requests.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InputError

REPO = Path(__file__).resolve().parents[2]
CUT_AFTER = 50                        # bytes of a stream the client reads before it hangs up
SHORT = "chat"                        # the kind whose latency is reported
# kind -> (share of the requests, the status it must get; "cut": the client hung up itself)
KINDS = {"chat": (0.30, 200), "completion": (0.12, 200), "stream_cut": (0.10, "cut"),
         "stream_full": (0.05, 200), "malformed": (0.08, 400), "unknown_model": (0.04, 404),
         "oversized": (0.05, 413), "wrong_key": (0.06, 401), "no_key": (0.03, 401),
         "slow": (0.02, 408), "health": (0.06, 200), "metrics": (0.03, 200),
         "models": (0.06, 200)}
TOPICS = ("rivers", "glass", "owls", "tides", "maps", "bread", "comets", "moss", "bells", "salt")


@dataclass
class Soak:
    """What the soak sends: to `url`, with `key`; bodies over `max_request_bytes` are refused and
    slow clients cut after `read_timeout` s (the server's flags)."""
    url: str
    key: str
    max_request_bytes: int
    read_timeout: float
    vocab: int = 1000                 # token ids of completion prompts are drawn below this

    def _auth(self, key: str | None = "right") -> dict:
        if key is None:
            return {}
        return {"Authorization": f"Bearer {self.key if key == 'right' else 'not-' + self.key}"}

    async def send(self, http, kind: str, rng: random.Random):
        """One request of `kind` -> its status (an int), or "cut"."""
        chat = {"messages": [{"role": "user", "content": f"A word on {rng.choice(TOPICS)}."}],
                "max_tokens": 2, "temperature": 0}
        if kind == "chat":
            return (await http.post(self.url + "/v1/chat/completions", json=chat,
                                    headers=self._auth())).status_code
        if kind == "completion":
            ids = [0] + [rng.randrange(1, self.vocab) for _ in range(rng.randrange(1, 6))]
            return (await http.post(self.url + "/v1/completions", headers=self._auth(),
                                    json={"prompt": ids, "max_tokens": rng.randrange(1, 4)})
                    ).status_code
        if kind in ("stream_cut", "stream_full"):
            body = {**chat, "stream": True, "max_tokens": 8, "ignore_eos": True,
                    "stream_options": {"include_usage": True}}
            return await self._stream(http, body, cut=kind == "stream_cut")
        if kind == "malformed":
            raw = rng.choice([b'{"messages": [', b"[1, 2]", b'{"messages": "hi"}', b"\xff\xfe"])
            return (await http.post(self.url + "/v1/chat/completions", content=raw,
                                    headers={**self._auth(), "content-type": "application/json"})
                    ).status_code
        if kind == "unknown_model":
            return (await http.post(self.url + "/v1/chat/completions", headers=self._auth(),
                                    json={**chat, "model": "gpt-4o"})).status_code
        if kind == "oversized":
            return await self._oversized(http, chunked=rng.random() < 0.5)
        if kind in ("wrong_key", "no_key"):
            return (await http.post(self.url + "/v1/chat/completions", json=chat,
                                    headers=self._auth("wrong" if kind == "wrong_key" else None))
                    ).status_code
        if kind == "slow":
            return await self._slow()
        path = {"health": "/health", "metrics": "/metrics", "models": "/v1/models"}[kind]
        return (await http.get(self.url + path, headers=self._auth() if kind == "models" else {})
                ).status_code

    async def _stream(self, http, body: dict, cut: bool):
        n = 0
        async with http.stream("POST", self.url + "/v1/chat/completions", json=body,
                               headers=self._auth()) as r:
            if r.status_code != 200:
                return r.status_code
            tail = b""
            async for chunk in r.aiter_raw():
                n += len(chunk)
                tail = (tail + chunk)[-64:]
                if cut and n >= CUT_AFTER:
                    return "cut"              # leaving the block closes the connection
        if not tail.rstrip().endswith(b"data: [DONE]"):
            raise RuntimeError(f"a stream ended without data: [DONE] (last bytes {tail!r})")
        return 200

    async def _oversized(self, http, chunked: bool):
        size = self.max_request_bytes + 1
        if not chunked:                        # declared: refused before a byte is read
            return (await http.post(self.url + "/v1/chat/completions", content=b" " * size,
                                    headers=self._auth())).status_code

        async def pieces():                    # no Content-Length: refused once past the cap
            left = size
            while left > 0:
                yield b" " * min(left, 65536)
                left -= 65536
        return (await http.post(self.url + "/v1/chat/completions", content=pieces(),
                                headers=self._auth())).status_code

    async def _slow(self):
        """Half a request line, then silence: the server answers once read_timeout is over."""
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(b"POST /v1/chat/completions HT")
            await writer.drain()
            data = await asyncio.wait_for(reader.read(), self.read_timeout + 30)
            return int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else "closed"
        finally:
            writer.close()


@dataclass
class Report:
    """Counts per kind and answer, errors, latencies (ms), memory samples (s, done, bytes)."""
    requests: int = 0
    seconds: float = 0.0
    answers: dict = field(default_factory=dict)         # kind -> {status: count}
    errors: list = field(default_factory=list)          # the first 20, as text
    n_errors: int = 0
    latency_ms: dict = field(default_factory=dict)      # kind -> [ms]
    rss: list = field(default_factory=list)             # (seconds, requests done, bytes)
    drained: bool = False

    def percentile(self, kind: str, q: float) -> float | None:
        xs = sorted(self.latency_ms.get(kind, ()))
        return round(xs[min(len(xs) - 1, int(q * len(xs)))], 1) if xs else None

    def sent(self, kind: str) -> int:
        return sum(self.answers.get(kind, {}).values())


def soak_in_phases(target: "Soak", n: int, warmup: int, concurrency: int, seed: int, rss,
                   sample_s: float = 1.0, progress=None, solo: int = 0,
                   duration: float | None = None) -> dict:
    """`solo` short chats one at a time (the latency of a short request alone), a warm-up of
    `warmup` requests, then the other n - warmup (the same plan of kinds; no new one sent once
    `duration` s have passed since the start), each phase waited out until the queue is empty;
    -> the summary: requests sent, errors, answers per kind, the short request's p50 /
    p99 (ms) alone and under the load of the last phase, the server's resident MiB when idle
    (before any request, after the warm-up, at the end), its peak in each phase (a leak raises
    the last phase's above the warm-up's; the idle figure moves by the transient blocks of the
    last request), and the samples over time."""
    kinds, t0 = plan(n, seed), time.monotonic()
    idle = [rss()]
    alone = asyncio.run(soak(target, [SHORT] * solo, 1, seed))
    first = asyncio.run(soak(target, kinds[:warmup], concurrency, seed, rss, sample_s))
    idle.append(rss())
    rep = asyncio.run(soak(target, kinds[warmup:], concurrency, seed + 1, rss, sample_s,
                           progress, None if duration is None else t0 + duration))
    idle.append(rss())
    answers = {}
    for r in (alone, first, rep):
        for kind, counts in r.answers.items():
            for got, c in counts.items():
                answers.setdefault(kind, {})[got] = answers.get(kind, {}).get(got, 0) + c
    return {"requests": warmup + rep.requests, "warmup": warmup, "solo": solo,
            "seconds": round(alone.seconds + first.seconds + rep.seconds, 1),
            "errors": alone.n_errors + first.n_errors + rep.n_errors,
            "first_errors": alone.errors + first.errors + rep.errors,
            "drained": first.drained and rep.drained,
            "answers": {k: dict(sorted(v.items(), key=str)) for k, v in answers.items()},
            "short_request_ms": {"alone_p50": alone.percentile(SHORT, 0.50),
                                 "alone_p99": alone.percentile(SHORT, 0.99),
                                 "p50": rep.percentile(SHORT, 0.50),
                                 "p99": rep.percentile(SHORT, 0.99)},
            "rss_mib": {"start": _mib(idle[0]), "after_warmup": _mib(idle[1]),
                        "end": _mib(idle[2]), "peak_warmup": _mib(_peak(first, idle[1])),
                        "peak": _mib(_peak(rep, idle[2]))},
            "rss_over_time": [(round(t, 1), warmup + d, _mib(b)) for t, d, b in rep.rss]}


def _peak(rep: Report, last: int) -> int:
    return max([b for *_, b in rep.rss] + [last])


def _mib(b: int) -> float:
    return round(b / 2 ** 20, 1)


def plan(n: int, seed: int) -> list[str]:
    """The kinds of n requests, drawn by share (the same list for the same seed)."""
    rng = random.Random(seed)
    names = list(KINDS)
    return rng.choices(names, weights=[KINDS[k][0] for k in names], k=n)


async def soak(target: Soak, kinds: list[str], concurrency: int, seed: int = 0,
               rss=None, sample_s: float = 1.0, progress=None,
               deadline: float | None = None) -> Report:
    """Send `kinds` from `concurrency` clients at once (none sent after time.monotonic()
    `deadline`); then wait for the queue to drain. rss: a callable -> the server's resident
    bytes, sampled every sample_s seconds."""
    import httpx
    rep, todo, t0 = Report(), list(enumerate(kinds)), time.perf_counter()
    done = 0

    async def client(c: int):
        nonlocal done
        rng = random.Random(seed * 1000 + c)
        async with httpx.AsyncClient(timeout=600) as http:
            while todo and (deadline is None or time.monotonic() < deadline):
                i, kind = todo.pop(0)
                rep.requests += 1
                t = time.perf_counter()
                try:
                    got = await target.send(http, kind, rng)
                except Exception as e:               # a failed connection, a broken stream
                    got = f"{type(e).__name__}: {e}"
                ms = 1e3 * (time.perf_counter() - t)
                counts = rep.answers.setdefault(kind, {})
                counts[got] = counts.get(got, 0) + 1
                if got != KINDS[kind][1]:
                    rep.n_errors += 1
                    if len(rep.errors) < 20:
                        rep.errors.append(f"request {i} ({kind}): {got}")
                else:
                    rep.latency_ms.setdefault(kind, []).append(ms)
                done += 1
                if progress and done % max(1, len(kinds) // 20) == 0:
                    progress(done, rep)

    async def sampler():
        while True:
            rep.rss.append((time.perf_counter() - t0, done, rss()))
            await asyncio.sleep(sample_s)

    watch = asyncio.create_task(sampler()) if rss else None
    await asyncio.gather(*(client(c) for c in range(concurrency)))
    rep.drained = await _drained(target.url)
    if watch:
        watch.cancel()
        rep.rss.append((time.perf_counter() - t0, done, rss()))
    rep.seconds = time.perf_counter() - t0
    return rep


async def _drained(url: str, timeout: float = 60) -> bool:
    """Whether /health shows nothing waiting or running within `timeout` s."""
    import httpx
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=10) as http:
        while time.monotonic() < deadline:
            h = (await http.get(url + "/health")).json()
            if h["waiting"] == 0 and h["running"] == 0:
                return True
            await asyncio.sleep(0.1)
    return False


def rss_of(pid: int) -> int:
    """Resident bytes of process `pid` (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS line in /proc/{pid}/status")


def start_server(args: list, key: str, log=subprocess.DEVNULL, timeout: float = 900):
    """scripts/serve.py on a free loopback port with DSV4_API_KEY = key -> (process, url)."""
    import httpx
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, DSV4_API_KEY=key, PYTHONPATH=os.pathsep.join(
        [str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, str(REPO / "scripts" / "serve.py"), "--host",
                             "127.0.0.1", "--port", str(port), *map(str, args)],
                            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=log)
    url, t0 = f"http://127.0.0.1:{port}", time.monotonic()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it answered")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.monotonic() - t0 > timeout:
            proc.kill()
            raise RuntimeError(f"the server did not answer /health in {timeout:g} s")
        time.sleep(0.25)


# ---- the run -------------------------------------------------------------------------------------

def run(args, ckpt) -> int:
    """The soak for the flags of scripts/bench_soak.py (dsv4.cli.bench.soak_parser) against a
    server of `ckpt`; prints the summary (or the JSON); -> the exit status (1 on any error)."""
    if args.concurrency < 1 or args.solo < 1 or not 0 <= args.warmup < args.requests:
        raise InputError(f"--concurrency {args.concurrency}, --solo {args.solo}, --warmup "
                         f"{args.warmup}, --requests {args.requests}: need concurrency and solo "
                         f">= 1 and 0 <= warmup < requests")
    key = secrets.token_hex(16)
    # Ctrl-C or SIGTERM (also where a background job ignores SIGINT): stop the server below too
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    proc, url = start_server(["--ckpt", ckpt, "--device", args.device, "--max-seq-len",
                              args.max_seq_len, "--max-queue", max(16, args.concurrency),
                              "--read-timeout", args.read_timeout, "--max-request-bytes",
                              args.max_request_bytes, "--log-level", "warning"], key)
    try:
        target = Soak(url, key, args.max_request_bytes, args.read_timeout)
        t0 = time.perf_counter()

        def progress(done, rep):
            print(f"[soak] {args.warmup + done}/{args.requests} requests, {rep.n_errors} errors, "
                  f"{time.perf_counter() - t0:.0f} s, rss {_mib(rss_of(proc.pid))} MiB",
                  file=sys.stderr)
        summary = soak_in_phases(target, args.requests, args.warmup, args.concurrency, args.seed,
                                 lambda: rss_of(proc.pid), sample_s=1.0, progress=progress,
                                 solo=args.solo, duration=args.duration)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            status = proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            status = "killed after 120 s"
    out = {"machine": _machine(), "ckpt": str(ckpt), "concurrency": args.concurrency,
           "duration_limit_s": args.duration,
           "read_timeout": args.read_timeout, "max_request_bytes": args.max_request_bytes,
           **summary, "sigterm_exit": status}
    if args.json:
        print(json.dumps(out))
    else:
        s, m = out["short_request_ms"], out["rss_mib"]
        print(f"{out['requests']} requests in {out['seconds']} s ({args.concurrency} clients): "
              f"{out['errors']} errors, queue drained: {out['drained']}, SIGTERM exit: {status}")
        print(f"short chat (2 tokens): p50 {s['p50']:.0f} ms, p99 {s['p99']:.0f} ms under the "
              f"load ({args.concurrency} clients, the queue included); alone p50 "
              f"{s['alone_p50']:.0f} ms, p99 {s['alone_p99']:.0f} ms ({args.solo} requests)")
        print(f"server RSS, idle: {m['start']} MiB at start -> {m['after_warmup']} MiB after "
              f"{args.warmup} requests -> {m['end']} MiB at the end; peak {m['peak_warmup']} MiB "
              f"in the warm-up, {m['peak']} MiB after it")
        for kind, counts in out["answers"].items():
            print(f"  {kind:14s} {counts}")
        for e in out["first_errors"]:
            print(f"  error: {e}")
    return 0 if out["errors"] == 0 and out["drained"] and status == 0 else 1


def _machine() -> str:
    import platform
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text()
                .splitlines() if ln.startswith("model name")), platform.processor()) \
        if Path("/proc/cpuinfo").exists() else platform.processor()
    return f"{cpu}, {os.cpu_count()} cores visible"
