"""The route table (jengine/server/routes.py) is the one statement of the server's routes: the
app registers exactly its rows, /openapi.json documents a 401 exactly where a row says `auth`
and an event-stream body exactly where it says `streams`, and the edge middleware asks for the
key exactly where the table does; and nothing in the server parses a command line (that is
jengine/cli/'s). No engine is loaded: the app is built with a loader that
never runs (no lifespan), which is all the routing and the document need."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from jengine.config import ServerConfig
from jengine.server.app import create_app
from jengine.server.routes import ROUTES, document_path, needs_key

KEY = "sk-routes"


@pytest.fixture(scope="module")
def app():
    return create_app(load_engine=lambda: None, config=ServerConfig(api_key=KEY))


def test_the_app_serves_exactly_the_table(app):
    served = [(r.path, m) for r in app.routes if isinstance(r, APIRoute) for m in r.methods]
    assert served == [(r.path, r.method) for r in ROUTES]
    # the public rule the table states route by route: /v1 needs the key, the rest is open
    assert all(r.auth == r.path.startswith("/v1/") for r in ROUTES)


def test_the_document_reads_auth_and_streaming_from_the_table(app):
    paths = app.openapi()["paths"]
    documented = [r for r in ROUTES if r.method != "HEAD"]
    assert len(documented) == sum(len(ops) for ops in paths.values())
    for route in documented:
        responses = paths[document_path(route)][route.method.lower()]["responses"]
        assert ("401" in responses) == route.auth, route.path
        assert ("504" in responses) == route.streams, route.path
        assert ("text/event-stream" in responses["200"]["content"]) == route.streams


def test_the_middleware_asks_the_table_for_the_key(app):
    client = TestClient(app)  # not entered: no lifespan, the engine never loads
    for route in ROUTES:
        path = route.path.replace("{model:path}", "some/model")
        status = client.request(route.method, path).status_code
        assert (status == 401) == route.auth, (route.method, path, status)
    # a /v1 path no route matches needs the key too: without it, it is a 401, not a 404
    assert needs_key("/v1/no-such-route") and client.get("/v1/no-such-route").status_code == 401
    assert client.get("/v1/no-such-route",
                      headers={"Authorization": f"Bearer {KEY}"}).status_code == 404
    assert not needs_key("/no-such-route")


def test_nothing_in_the_server_parses_a_command_line():
    server = Path(__file__).resolve().parents[2] / "jengine" / "server"
    found = []
    for path in sorted(server.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if "argparse" in names or (isinstance(node, ast.Attribute) and node.attr == "argv"):
                found.append(path.name)
    assert found == []
