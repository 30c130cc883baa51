"""A real redis-server (Debian's package) for the tests: started on a free 127.0.0.1
port with its own temp dir, no persistence, stopped afterwards.

Without redis-server the tests that need it are skipped, except in CI (CI=true),
where they fail: `make test` / .ci/run install it (apt-get install redis-server).
"""
from __future__ import annotations

import os
import shutil

import pytest

from tokenmill.kv_connector.local_redis import RedisServer, free_port  # noqa: E402,F401


def require_redis_server() -> str:
    exe = shutil.which("redis-server")
    if exe is None:
        msg = ("redis-server is not installed (`make test` installs it: "
               "apt-get install redis-server)")
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"{msg}; CI must run the Redis tests")
        pytest.skip(msg)
    return exe


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    server = RedisServer(require_redis_server(), str(tmp_path_factory.mktemp("redis"))).start()
    try:
        yield server
    finally:
        server.stop()
