"""The route table (jengine/server/routes.py) is the one statement of the server's routes: the
app registers exactly its rows, /openapi.json documents a 401 exactly where a row says `auth`,
an event-stream body exactly where it says `streams` and its error shape's body, the edge
middleware asks for the key exactly where the table does, and the errors of the middleware, the
handlers and the admission have the body the row's shape says; and nothing in the server parses
a command line (that is jengine/cli/'s). No engine is loaded: the app is built with a loader
that never runs (no lifespan), which is all the routing and the document need."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from jengine.config import ServerConfig
from jengine.server.app import create_app
from jengine.server.routes import ROUTES, document_path, error_shape, needs_key

KEY = "sk-routes"


@pytest.fixture(scope="module")
def app():
    return create_app(load_engine=lambda: None, config=ServerConfig(api_key=KEY))


def test_the_app_serves_exactly_the_table(app):
    served = [(r.path, m) for r in app.routes if isinstance(r, APIRoute) for m in r.methods]
    assert served == [(r.path, r.method) for r in ROUTES]
    # the public rule the table states route by route: /v1 needs the key, the rest is open
    assert all(r.auth == r.path.startswith("/v1/") for r in ROUTES)
    # undocumented: the HEAD probe and the chat page (its HTML is no API)
    assert {(r.path, r.method) for r in ROUTES if not r.documented} == {
        ("/health", "HEAD"), ("/", "GET"), ("/static/{name}", "GET")}


def test_the_document_reads_auth_and_streaming_from_the_table(app):
    paths = app.openapi()["paths"]
    documented = [r for r in ROUTES if r.documented]
    assert len(documented) == sum(len(ops) for ops in paths.values())
    for route in documented:
        responses = paths[document_path(route)][route.method.lower()]["responses"]
        assert ("401" in responses) == route.auth, route.path
        assert ("504" in responses) == route.streams, route.path
        assert ("text/event-stream" in responses["200"]["content"]) == route.streams
        schema = {"openai": "ErrorResponse", "anthropic": "AnthropicErrorResponse"}[route.errors]
        for code, answer in responses.items():  # every error in the row's shape
            if code[0] in "45":
                assert answer["content"]["application/json"]["schema"] == {
                    "$ref": f"#/components/schemas/{schema}"}, (route.path, code)


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


def test_errors_have_the_body_the_table_says(app):
    """The middleware's 401, the handlers' 400 and the admission's 503 (the engine is still
    loading here, as it never loads) of one route, in its row's error shape."""
    client = TestClient(app)
    key = {"Authorization": f"Bearer {KEY}"}
    body = {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        assert error_shape(path) == "anthropic"
        answers = [(client.post(path, json=body), 401, "authentication_error"),
                   (client.post(path, headers=key, json={}), 400, "invalid_request_error"),
                   (client.post(path, headers=key, json=body if path == "/v1/messages" else
                                {"messages": body["messages"]}), 503, "overloaded_error")]
        for r, status, kind in answers:
            assert r.status_code == status and r.json()["type"] == "error", (path, r.text)
            assert r.json()["error"]["type"] == kind
    assert client.post("/v1/messages", headers=key, json=body).headers["retry-after"]
    r = client.post("/v1/chat/completions", headers=key, json={})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert error_shape("/v1/no-such-route") == "openai"


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
