"""`tokenmill serve` in a subprocess on a free 127.0.0.1 port, for the server tests."""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    def __init__(self, url: str, proc: subprocess.Popen, log):
        self.url, self.proc, self.log = url, proc, log


@contextlib.contextmanager
def live_server(model_path: str, log_path, *args: str, timeout: float = 120,
                extra_env: dict | None = None):
    """Start the server with `args` (after the model, host and port) and `extra_env`,
    wait until /health answers, yield a LiveServer, kill it on exit."""
    port = free_port()
    log = open(log_path, "w+")
    cmd = [sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", model_path,
           "--host", "127.0.0.1", "--port", str(port), *args]
    # A key exported in the developer's shell must not turn on auth for every test.
    env = {k: v for k, v in os.environ.items() if k != "TOKENMILL_API_KEY"}
    env.update(extra_env or {})
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    try:
        while True:
            if proc.poll() is not None:
                log.seek(0)
                pytest.fail(f"server exited with {proc.returncode}:\n{log.read()}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("server did not become healthy")
            time.sleep(0.3)
        yield LiveServer(url, proc, log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
