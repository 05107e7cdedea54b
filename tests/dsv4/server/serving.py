"""Test helpers: a real server process on 127.0.0.1 (scripts/serve.py, or a launcher), its URL,
its memory, its shutdown; clients that skip, naming the package, where the serve extra or the
openai client is absent."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SERVE = REPO / "scripts" / "serve.py"
START_TIMEOUT_S = 300


def require_serve_packages():
    for name in ("fastapi", "uvicorn", "pydantic", "httpx", "openai"):
        pytest.importorskip(name, reason=f"the server tests need {name} (pip install -e '.[dev]')")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server started with `args` (scripts/serve.py, or `launcher`) and `env` added to the
    environment (without the runner's own DSV4_API_KEY), ready when /health is 200."""

    def __init__(self, args, launcher: Path | None = None, log: Path | None = None,
                 env: dict | None = None):
        import httpx
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        inherited = {k: v for k, v in os.environ.items() if k != "DSV4_API_KEY"}
        env = dict(inherited, **(env or {}), PYTHONPATH=os.pathsep.join(
            [str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]))
        self.log = log
        self._err = open(log, "w") if log else subprocess.DEVNULL
        cmd = [sys.executable, str(launcher or SERVE), "--port", str(self.port), *map(str, args)]
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                                     stderr=self._err)
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}: "
                                   f"{self.stderr_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > START_TIMEOUT_S:
                self.proc.kill()
                raise RuntimeError(f"the server did not answer /health in {START_TIMEOUT_S} s")
            time.sleep(0.25)

    def stderr_tail(self, n: int = 3000) -> str:
        return Path(self.log).read_text()[-n:] if self.log else "(no log)"

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS line")

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM, then the exit status (kills after timeout)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.log:
            self._err.close()
        return self.proc.returncode


def openai_client(server, **kw):
    import openai
    return openai.OpenAI(base_url=server.url + "/v1", api_key=kw.pop("api_key", "unused"),
                         max_retries=0, timeout=kw.pop("timeout", 300), **kw)
