"""GET / and /static/*: the web page, a chat playground and a live dashboard. Its files
(../static) ship as package data and are served as they are: no build step, nothing
loaded from elsewhere (the machine may be offline). The page and its files need no API
key; every API call the page makes sends the key typed into it. Off with --no-web-ui."""
from __future__ import annotations

import functools
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import Response

from tokenmill.entrypoints.openai.errors import APIError

router = APIRouter()

STATIC = resources.files("tokenmill.entrypoints.openai") / "static"
_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}
ASSETS = tuple(sorted(p.name for p in STATIC.iterdir()
                      if p.name[p.name.rfind("."):] in _TYPES))
# BearerAuth lets these through without the key.
PUBLIC_PATHS = ("/",) + tuple(f"/static/{name}" for name in ASSETS)

# Same-origin only and no inline code: what the page runs is exactly these files.
_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; object-src 'none'; "
                               "base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",  # revalidate: an upgraded server serves its own page
}


@functools.cache
def _read(name: str) -> bytes:
    return (STATIC / name).read_bytes()


@router.get("/", include_in_schema=False)
async def index():
    return Response(_read("index.html"), media_type="text/html; charset=utf-8",
                    headers=_HEADERS)


@router.get("/static/{name}", include_in_schema=False)
async def asset(name: str):
    if name not in ASSETS:
        raise APIError(f"no file /static/{name}", 404, "NotFoundError")
    return Response(_read(name), media_type=_TYPES[name[name.rfind("."):]], headers=_HEADERS)
