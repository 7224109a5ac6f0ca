"""The playground page at `/`: hand-written static files shipped in the package (serving/ui), read once.

No build step and nothing fetched from elsewhere; the page asks for its data through `/v1/*` and `/server` like any
client, so its own files are never behind the key. A strict Content-Security-Policy keeps it to its own origin.
"""

from __future__ import annotations

from importlib.resources import files

from fastapi import FastAPI
from fastapi.responses import Response

from mirror_rt.serving.errors import APIError

TYPES = {".html": "text/html; charset=utf-8", ".css": "text/css; charset=utf-8",
         ".js": "text/javascript; charset=utf-8", ".svg": "image/svg+xml"}
HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff",
           "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; base-uri 'none'; "
                                      "form-action 'none'; frame-ancestors 'none'"}


def page_files() -> dict[str, bytes]:
    """Every file of the page by name (index.html included), from the installed package."""
    folder = files("mirror_rt.serving").joinpath("ui")
    return {item.name: item.read_bytes() for item in folder.iterdir()
            if item.is_file() and any(item.name.endswith(suffix) for suffix in TYPES)}


def add_page_routes(app: FastAPI) -> None:
    """`GET /` (the page) and `GET /ui/<file>` (its styles and scripts)."""
    assets = page_files()

    def answer(name: str) -> Response:
        if name not in assets:
            raise APIError(404, f"not found: GET /ui/{name}")
        suffix = name[name.rfind("."):]
        return Response(assets[name], media_type=TYPES[suffix], headers=HEADERS)

    @app.get("/")
    async def index():
        return answer("index.html")

    @app.get("/ui/{name}")
    async def asset(name: str):
        return answer(name)
