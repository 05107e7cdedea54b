"""The `scripts/serve.py` (`dsv4 serve`) command: an OpenAI-compatible HTTP server over one decode
session (FastAPI + uvicorn, the `serve` extra). The port is bound first (a busy one is an error
before anything loads), then the model loads, the graphs are captured and one short generation
runs, and only then does the port listen, so GET /health answers 200 as soon as it answers.

Exit status: 0 after SIGTERM / Ctrl-C (the running request stops at its next token, the session is
closed: graphs and memory released); 2 bad usage (one stderr line naming the problem and the fix);
1 runtime failure. Endpoints, fields and limits: docs/SERVING.md. The server's environment (the
API key) is read here, by `server_env`, and nowhere else.
"""
from __future__ import annotations

import argparse
import errno
import importlib.util
import ipaddress
import os
import signal
import socket
import sys
import time
from dataclasses import replace

from ..errors import InputError, exit_code
from .options import (
    Parser,
    add_model_args,
    add_runtime_args,
    add_sampling_args,
    check_checkpoint_args,
    check_runtime_args,
    check_tp_split,
    checkpoint_dir,
    model_name,
)

DEFAULT_MAX_SEQ_LEN = 4096
SERVE_PACKAGES = ("fastapi", "uvicorn", "pydantic")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="dsv4 serve", description="OpenAI-compatible DeepSeek-V4 server (batch 1: one "
                                             "request decodes at a time, the others queue).")
    add_model_args(p)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (0.0.0.0: every interface; give it an API key)")
    s.add_argument("--port", type=int, default=8000, help="port to listen on")
    s.add_argument("--max-queue", type=int, default=16, metavar="N",
                   help="requests that may wait while one decodes; beyond, 503 "
                        "with Retry-After")
    s.add_argument("--served-model-name", metavar="NAME",
                   help="the model name requests give (default: the --ckpt repo id, or the "
                        "checkpoint folder's name)")
    s.add_argument("--prefix-snapshots", type=int, default=4, metavar="N",
                   help="decode-state snapshots kept for prefix reuse (the ends of "
                        "recent prompts; 0 = reuse the live sequence only); each costs a window "
                        "ring and the compressors' open rows per layer")
    add_exposure_args(s)
    s.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level (info: one access line per request)")
    s.add_argument("--allow-force-ids", action="store_true", help=argparse.SUPPRESS)  # tests
    add_sampling_args(p, title="sampling defaults (a request's own fields win)")
    add_runtime_args(p, DEFAULT_MAX_SEQ_LEN,
                     f"cache capacity: the context length (prompt + max_tokens) of every request "
                     f"(default {DEFAULT_MAX_SEQ_LEN})", parallel=True)
    return p


def add_exposure_args(s) -> None:
    """The API key and the bounds on what one client may send (dsv4.server.limits)."""
    from ..server.limits import HEADER_BYTES, MAX_CONNECTIONS, READ_TIMEOUT_S
    s.add_argument("--api-key", metavar="KEY",
                   help="every route but /health and /metrics answers 401 unless the request "
                        "has `Authorization: Bearer KEY` (default: $DSV4_API_KEY, else no key)")
    s.add_argument("--api-key-all-routes", action="store_true",
                   help="with a key: /health and /metrics ask for it too")
    s.add_argument("--max-request-bytes", metavar="SIZE",
                   help="largest request body (e.g. 4M), refused with 413 while it is read "
                        "(default: 128 bytes a token of --max-seq-len, at least 1M: any prompt "
                        "that fits the context fits)")
    s.add_argument("--max-header-bytes", default=str(HEADER_BYTES), metavar="SIZE",
                   help="largest request line + headers; beyond, 431")
    s.add_argument("--read-timeout", type=float, default=READ_TIMEOUT_S, metavar="S",
                   help="seconds a client may take to send a whole request (from connecting, or "
                        "from the previous reply); beyond, 408 and the connection closes")
    s.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS, metavar="N",
                   help="open connections at once; a connection beyond gets 503 with Retry-After")


def server_env(args, env=None) -> str | None:
    """The API key: --api-key, else $DSV4_API_KEY, else None (checked: InputError names the
    source). The one place the server's environment is read; the key is never printed."""
    from ..server.auth import check_key
    env = os.environ if env is None else env
    if args.api_key is not None:
        return check_key(args.api_key, "--api-key")
    if "DSV4_API_KEY" in env:
        return check_key(env["DSV4_API_KEY"], "DSV4_API_KEY")
    return None


def limits_of(args):
    """dsv4.server.limits.Limits of the flags (InputError naming the flag)."""
    from ..server.limits import Limits, parse_size
    if args.max_connections < args.max_queue + 2:
        raise InputError(f"--max-connections {args.max_connections}: must be >= --max-queue + 2 "
                         f"= {args.max_queue + 2} (the waiting requests, the running one and a "
                         f"look at /health)")
    return Limits.for_context(
        args.max_seq_len,
        max_request_bytes=None if args.max_request_bytes is None else
        parse_size(args.max_request_bytes, "--max-request-bytes"),
        max_header_bytes=parse_size(args.max_header_bytes, "--max-header-bytes"),
        read_timeout=args.read_timeout, max_connections=args.max_connections)


def loopback(host: str) -> bool:
    """Whether every address `host` names is a loopback one (127.0.0.0/8, ::1)."""
    try:
        addrs = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except (OSError, UnicodeError):
        return False
    return bool(addrs) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs)


def exposure_warning(host: str, port: int, key: str | None) -> str | None:
    """The stderr warning for a server that anyone on the network can use, or None."""
    if key is not None or loopback(host):
        return None
    return (f"[dsv4] warning: --host {host} without an API key: anyone who can reach port {port} "
            f"can generate with the model (/v1/chat/completions, /v1/completions) and read "
            f"/metrics; set DSV4_API_KEY (or --api-key), and put TLS in front (docs/SERVING.md, "
            f"\"Running it exposed\")")


def main(argv=None) -> int:
    return exit_code(lambda: run(build_parser().parse_args(argv)))


def run(args) -> int:
    missing = [m for m in SERVE_PACKAGES if importlib.util.find_spec(m) is None]
    if missing:
        raise InputError(f"the server needs {', '.join(missing)}: pip install -e '.[serve]' (or "
                         f"pip install fastapi uvicorn pydantic)")
    if not 0 <= args.port < 65536:
        raise InputError(f"--port {args.port}: expected 0..65535")
    if args.max_queue < 0 or args.prefix_snapshots < 0:
        flag, v = (("--max-queue", args.max_queue) if args.max_queue < 0 else
                   ("--prefix-snapshots", args.prefix_snapshots))
        raise InputError(f"{flag} {v}: must be >= 0")
    if args.max_seq_len < 16:
        raise InputError(f"--max-seq-len {args.max_seq_len}: must be >= 16 (the context of "
                         f"every request: prompt + max_tokens)")
    key, limits = server_env(args), limits_of(args)   # before the model loads
    devices, mode = check_runtime_args(args)
    from ..runtime.sampling import SamplingParams
    from ..text.tokenizer import load_tokenizer
    from ..weights.config import ModelConfig
    defaults_sampling = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed or 0)
    sock = bind(args.host, args.port)     # a busy port: an error now, not after the load
    try:
        ckpt = checkpoint_dir(args)
        cfg = ModelConfig.from_json(ckpt)
        check_checkpoint_args(args, cfg)
        check_tp_split(args, cfg, devices)
        tok = load_tokenizer(ckpt)
        engine, defaults = _build(args, ckpt, cfg, tok, devices, mode, defaults_sampling)
        return _listen(args, sock, engine, tok, defaults, key, limits)
    finally:
        sock.close()


def bind(host: str, port: int) -> socket.socket:
    """The server's socket, bound (not yet listening: connections are refused until the model is
    ready) as uvicorn binds it; InputError naming --port / --host when that fails."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise InputError(f"--port {port}: {host}:{port} is already in use (another server?); "
                             f"pick a free port with --port N, or stop the process that holds "
                             f"it") from None
        if e.errno == errno.EACCES:
            raise InputError(f"--port {port}: permission denied (ports below 1024 need "
                             f"privileges); use a port such as 8000") from None
        raise InputError(f"--host {host}: cannot listen there ({e.strerror or e}); use "
                         f"127.0.0.1, 0.0.0.0 or an address of this machine") from None
    sock.set_inheritable(True)
    return sock


def _build(args, ckpt, cfg, tok, devices, mode, sampling):
    """Load, capture, warm up -> (Engine, Defaults), before any port opens."""
    from ..runtime.config import DTYPES, RuntimeConfig
    from ..runtime.session import Session, load_model
    from ..server.engine import Engine
    from ..server.logprobs_format import TokenTexts
    from ..server.openai_api import Defaults
    from ..server.structured import GrammarCompiler
    t0 = time.perf_counter()
    rt = RuntimeConfig(max_seq_len=args.max_seq_len, dtype=DTYPES[args.dtype],
                       devices=tuple(devices), prefill_chunk=args.prefill_chunk,
                       mtp=bool(args.speculative),
                       prefill_graphs=args.prefill_graphs if mode == "graph" else 0)
    session_kw = dict(params=sampling, mode=mode, granularity=args.granularity,
                      speculative=args.speculative,
                      spec_min_acceptance=args.speculative_min_acceptance,
                      per_request_sampling=True)
    if args.parallel == "tp":       # this process is rank 0 (the API); the others follow it
        from ..runtime.tp import open_session
        session, _ = open_session(devices, ckpt, replace(rt, devices=(devices[0],)), session_kw)
        model = session.model
    else:
        model, ck = load_model(ckpt, rt)
        ck.close()
        if ck.notice:
            print(f"[dsv4] notice: {ck.notice}", file=sys.stderr)
        session = Session(model, **session_kw)
    session.generate([tok.bos_id] + tok.encode("Hello"), 2)   # first-call costs, before serving
    session.reset()
    engine = Engine(session, tok, max_queue=args.max_queue,
                    prefix_snapshots=args.prefix_snapshots)
    name = args.served_model_name or model_name(args, ckpt)
    defaults = Defaults(model=name, max_seq_len=args.max_seq_len, vocab_size=cfg.vocab_size,
                        sampling=sampling, seed=args.seed, speculative=bool(args.speculative),
                        prefix_snapshots=args.prefix_snapshots,
                        allow_force_ids=args.allow_force_ids,
                        grammar=GrammarCompiler(tok, cfg.vocab_size), texts=TokenTexts(tok))
    per_snapshot = engine.cache.nbytes() / max(1, args.prefix_snapshots) / 2 ** 20
    tp = " tensor-parallel" if args.parallel == "tp" else ""
    print(f"[dsv4] {name}: mode={mode} device={','.join(devices)}{tp} dtype={args.dtype} "
          f"max-seq-len={args.max_seq_len} speculative={args.speculative} | ready in "
          f"{time.perf_counter() - t0:.1f} s (capture {session.capture_s:.1f} s) | prefix "
          f"snapshots {args.prefix_snapshots} x {per_snapshot:.1f} MiB", file=sys.stderr)
    return engine, defaults


def _listen(args, sock, engine, tok, defaults, key, limits) -> int:
    import uvicorn

    from ..server.app import create_app
    from ..server.connection import bounded_protocol

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):        # stop the running request at its next token
            engine.shutdown()
            super().handle_exit(sig, frame)

    app = create_app(engine, tok, defaults, limits, key, args.api_key_all_routes)
    server = Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                   lifespan="off", timeout_graceful_shutdown=30,
                                   http=bounded_protocol(limits, engine.metrics.refuse),
                                   h11_max_incomplete_event_size=limits.max_header_bytes))
    warning = exposure_warning(args.host, args.port, key)
    if warning:
        print(warning, file=sys.stderr)
    engine.start()
    # uvicorn re-raises the signal it shut down on once its own handlers are gone: let these
    # no-op handlers take it, so that the session below is closed and the exit status is 0
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    host, port = sock.getsockname()[:2]
    where = f"[{host}]" if ":" in host else host
    # (uvicorn logs its "running on" line only for a socket it bound itself)
    print(f"[dsv4] listening on http://{where}:{port} (Ctrl-C or SIGTERM stops) | API key: "
          f"{'required' if key else 'none'} | bodies <= {limits.max_request_bytes} bytes, "
          f"heads <= {limits.max_header_bytes}, requests within {limits.read_timeout:g} s, "
          f"<= {limits.max_connections} connections", file=sys.stderr)
    try:
        server.run(sockets=[sock])        # the socket bound before the load: it listens now
    except OSError as e:
        if e.errno != errno.EADDRINUSE:
            raise
        # two servers bound the port while neither listened yet (SO_REUSEADDR allows that);
        # the other one listens now
        raise InputError(f"--port {args.port}: {args.host}:{args.port} was taken while the model "
                         f"loaded (another server started on it); pick a free port with "
                         f"--port N") from None
    finally:
        engine.close()
    print("[dsv4] server stopped, session closed", file=sys.stderr)
    return 0
