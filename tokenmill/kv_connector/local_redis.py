"""A local redis-server (Debian's package) on a free 127.0.0.1 port, its own
working dir, no persistence: for `tokenmill bench prefix` and the tests."""
from __future__ import annotations

import os
import socket
import subprocess
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, exe: str, workdir: str, port: int | None = None):
        self.exe, self.workdir = exe, workdir
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 15.0) -> "RedisServer":
        import redis
        os.makedirs(self.workdir, exist_ok=True)
        self.proc = subprocess.Popen(
            [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.workdir,
             "--save", "", "--appendonly", "no", "--daemonize", "no",
             "--logfile", os.path.join(self.workdir, "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout
        while True:
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server did not start on port {self.port}")
                time.sleep(0.05)
        client.close()
        return self

    def client(self):
        import redis
        return redis.Redis(host="127.0.0.1", port=self.port)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
