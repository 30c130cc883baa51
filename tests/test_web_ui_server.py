"""The web page's server side, without a browser: its files and who may fetch them,
--no-web-ui, and the files in a built wheel. The page itself, in chromium, is
tests/test_web_ui.py; /stats, which its dashboard reads, tests/test_server_stats.py."""
from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from importlib import resources
from pathlib import Path

from inprocess_app import async_llm, call  # noqa: F401 (a fixture)
from tokenmill.entrypoints.openai.context import ServerOptions
from tokenmill.entrypoints.openai.routes import web_ui
from tokenmill.entrypoints.openai.server import build_app

ROOT = Path(__file__).resolve().parents[1]
STATIC = ROOT / "tokenmill" / "entrypoints" / "openai" / "static"
MODEL, KEY = "demo", "sekrit"
AUTH = {"Authorization": f"Bearer {KEY}"}


def test_page_and_its_files_are_public_every_api_route_needs_the_key(async_llm):
    app = build_app(async_llm, MODEL, api_key=KEY)
    page, *assets = call(app, ("GET", "/", {}),
                         *(("GET", f"/static/{name}", {}) for name in web_ui.ASSETS))
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    for name, r in zip(web_ui.ASSETS, assets):
        assert r.status_code == 200, name
        kind = "text/javascript" if name.endswith(".js") else "text/css"
        assert r.headers["content-type"].startswith(kind), name
        assert r.content == (STATIC / name).read_bytes()
    denied = call(app, ("GET", "/stats", {}), ("GET", "/v1/models", {}),
                  ("GET", "/static/", {}), ("GET", "/index.html", {}))
    assert [r.status_code for r in denied] == [401, 401, 401, 401]
    assert denied[0].json()["error"]["message"] == "invalid or missing API key"
    stats, missing = call(app, ("GET", "/stats", {"headers": AUTH}),
                          ("GET", "/static/nope.js", {"headers": AUTH}))
    assert stats.status_code == 200 and missing.status_code == 404


def test_the_page_refers_only_to_files_the_server_serves():
    """index.html's stylesheet and script, and every module a script imports, are in
    ASSETS; nothing comes from another origin."""
    html = (STATIC / "index.html").read_text()
    refs = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert sorted(refs) == ["data:,", "static/app.js", "static/style.css"]
    for name in web_ui.ASSETS:
        if name.endswith(".js"):
            for imported in re.findall(r'from "\./([^"]+)"', (STATIC / name).read_text()):
                assert imported in web_ui.ASSETS, (name, imported)
    for name in (*web_ui.ASSETS, "index.html"):
        assert "http://" not in (STATIC / name).read_text()
        assert "https://" not in (STATIC / name).read_text()


def test_no_web_ui_turns_the_page_off_but_not_stats(async_llm):
    from tokenmill.entrypoints.cli import build_parser
    assert build_parser().parse_args(["serve", "--no-web-ui"]).no_web_ui is True
    assert build_parser().parse_args(["serve"]).no_web_ui is False
    app = build_app(async_llm, MODEL, options=ServerOptions(web_ui=False))
    page, asset, stats = call(app, ("GET", "/", {}), ("GET", "/static/app.js", {}),
                              ("GET", "/stats", {}))
    assert page.status_code == asset.status_code == 404
    assert stats.status_code == 200
    # with a key as well: nothing is public but /health
    app = build_app(async_llm, MODEL, options=ServerOptions(api_key=KEY, web_ui=False))
    assert [r.status_code for r in call(app, ("GET", "/", {}), ("GET", "/health", {}))] == [
        401, 200]


def test_the_static_files_are_package_data():
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())[
        "tool"]["setuptools"]["package-data"]["tokenmill"]
    files = [p for p in STATIC.iterdir() if p.is_file()]
    assert {"index.html", "app.js", "style.css"} <= {p.name for p in files}
    for p in files:
        rel = p.relative_to(ROOT / "tokenmill").as_posix()
        assert any(fnmatch.fnmatch(rel, g) for g in globs), f"{rel} is not package data"
    assert (resources.files("tokenmill.entrypoints.openai") / "static" / "index.html").is_file()


# What the installed copy runs: GET / and every file through build_app, on a stand-in
# engine (this checks packaging, not the engine).
INSTALLED_CHILD = r"""
import asyncio, json, sys
from types import SimpleNamespace
import httpx
import tokenmill
from tokenmill.engine.async_llm import EngineStats
from tokenmill.entrypoints.openai.routes import web_ui
from tokenmill.entrypoints.openai.server import build_app
from tokenmill.limits import RequestLimits
llm = SimpleNamespace(tokenizer=None, observer=None, stats=EngineStats(),
                      is_healthy=lambda: True,
                      model_config=SimpleNamespace(max_model_len=64, path="/x"),
                      engine=SimpleNamespace(args=SimpleNamespace(max_logprobs=5,
                                                                  limits=RequestLimits())))
async def go():
    transport = httpx.ASGITransport(app=build_app(llm, "m"))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        return {p: (r.status_code, len(r.content)) for p in web_ui.PUBLIC_PATHS
                for r in [await c.get(p)]}
print(json.dumps({"package": tokenmill.__file__, "served": asyncio.run(go())}))
"""


def test_a_built_wheel_serves_the_page(tmp_path):
    """`pip wheel .` then install: / and its files are served from the installed copy.
    TOKENMILL_NO_NATIVE=1: no kernels compiled (seconds, not minutes; the kernels' own
    wheel test is tests/unit/test_kernel_build.py)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        (src / name).write_bytes((ROOT / name).read_bytes())
    shutil.copytree(ROOT / "tokenmill", src / "tokenmill",
                    ignore=shutil.ignore_patterns("__pycache__", "_C_*", "*.egg-info"))
    env = {**os.environ, "TOKENMILL_NO_NATIVE": "1"}
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation",
                           "--no-deps", "-w", str(tmp_path / "wheel"), str(src)], cwd=src,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    [wheel] = (tmp_path / "wheel").glob("tokenmill-*.whl")
    target = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                           "--target", str(target), str(wheel)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    # cwd: not the checkout, whose tokenmill would come first on sys.path
    done = subprocess.run([sys.executable, "-c", INSTALLED_CHILD], cwd=tmp_path,
                          env={**env, "PYTHONPATH": str(target)}, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(out["package"]).is_relative_to(target)
    assert set(out["served"]) == set(web_ui.PUBLIC_PATHS)
    for path, (status, size) in out["served"].items():
        assert status == 200 and size > 0, path
