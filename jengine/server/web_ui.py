"""The chat page at `/`: plain HTML, CSS and JS files shipped in the package (`web/`), so that
nothing is built at install time and the page needs no network beyond this server.

The page itself is public (it holds no data); the `/v1` calls it makes carry the API key the
user types into it. `--no-web-ui` (`ServerConfig.web_ui = False`) answers both routes 404, as
if they did not exist.
"""

from __future__ import annotations

from importlib import resources

from fastapi import Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException

# The files the page is made of, and their media types: a fixed list, so no path a client sends
# ever reaches the file system.
_ASSETS = {
    "index.html": "text/html; charset=utf-8",
    "chat.css": "text/css; charset=utf-8",
    "chat.js": "text/javascript; charset=utf-8",
    "markdown.js": "text/javascript; charset=utf-8",
}


def _file(request: Request, name: str) -> Response:
    if not request.app.state.server.config.web_ui or name not in _ASSETS:
        raise HTTPException(404)
    body = resources.files("jengine.server").joinpath("web", name).read_bytes()
    # no-cache: revalidated on each load, so an upgraded server never runs a stale script
    return Response(body, media_type=_ASSETS[name], headers={"Cache-Control": "no-cache"})


async def page(request: Request) -> Response:
    return _file(request, "index.html")


async def asset(name: str, request: Request) -> Response:
    return _file(request, name)
