"""The chat page at `/`, driven in a real headless Chromium (tests/browser.py) against the
session's `jengine serve` (SmolLM2, `--api-key`): the page loads without the key and says the
`/v1` calls need it, fills the model picker once the key is typed, streams answers equal to
what /v1/chat/completions returns, keeps the conversation, and its stop button aborts the
request on the server. Reasoning and `--no-web-ui` (404) run over the fake model
(tests/fake_runner.py).

Skipped when no Chromium is found (`--chromium PATH`, else `chromium` on PATH).
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from browser import Browser, find_chromium  # tests/browser.py
from fake_runner import fake_async_engine
from local_server import serving
from serve_process import KEY, MODEL  # tests/serve_process.py

from jengine.config import ServerConfig
from jengine.server.app import create_app

RUNNING = "jengine_num_requests_running"
ABORTED = "jengine_requests_total{finish_reason=abort}"


@pytest.fixture(scope="session")  # session, as `server` is: so without one, the skip comes first
def browser(request):
    path = find_chromium(request.config.getoption("--chromium"))
    if path is None:
        pytest.skip("no Chromium: pass --chromium PATH or put chromium on PATH")
    chromium = Browser(path)
    yield chromium
    chromium.close()


@pytest.fixture
def page(browser, server):
    """The chat page in a fresh tab, the key typed in and the model picker filled."""
    page = browser.open(server.url + "/")
    page.type("#api-key", KEY)
    page.click("#prompt")  # leaving the key field reloads the models with the key
    page.wait("document.getElementById('model').value")
    yield page
    browser.call("Target.closeTarget", targetId=page.target)


def set_field(page, field: str, value) -> None:
    page.eval(f"document.getElementById({json.dumps(field)}).value = {json.dumps(str(value))}")


def ask(page, prompt: str) -> str:
    """Types `prompt`, clicks Send, waits for the answer to end; returns its text as streamed."""
    page.type("#prompt", prompt)
    page.click("#send")
    page.wait("document.getElementById('stop').disabled && "
              "document.querySelectorAll('.message.assistant').length > 0", timeout=60)
    assert page.eval("document.getElementById('error').hidden"), page.eval(
        "document.getElementById('error').textContent")
    return page.eval("document.querySelector('.message.assistant:last-child .content')"
                     ".dataset.raw || ''")


@pytest.mark.browser
def test_the_page_needs_the_key_for_v1_and_then_lists_the_models(browser, server):
    r = httpx.get(server.url + "/", timeout=30)  # the page itself is served without the key
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = browser.open(server.url + "/")
    try:
        error = page.wait("!document.getElementById('error').hidden && "
                          "document.getElementById('error').textContent")
        assert error.startswith("401 Unauthorized") and "API key" in error
        assert page.eval("document.getElementById('model').options.length") == 0
        page.type("#api-key", "wrong-key")
        page.click("#prompt")
        assert page.wait("document.getElementById('error').textContent.includes('refused')")
        assert page.eval("document.getElementById('model').options.length") == 0

        page.eval("document.getElementById('api-key').value = ''")
        page.type("#api-key", KEY)
        page.click("#prompt")
        listed = page.wait("[...document.getElementById('model').options].map(o => o.value)"
                           ".join(',')")
        assert listed.split(",") == [m.id for m in server.client().models.list()] == [MODEL]
        assert page.eval("document.getElementById('error').hidden")
    finally:
        browser.call("Target.closeTarget", targetId=page.target)


@pytest.mark.browser
def test_the_streamed_answer_is_the_apis_and_the_conversation_is_kept(server, page):
    set_field(page, "temperature", 0)
    set_field(page, "max-tokens", 12)
    set_field(page, "system", "You are a terse assistant.")
    messages = [{"role": "system", "content": "You are a terse assistant."}]
    for prompt in ("What is the capital of France?", "And of Italy?"):
        shown = ask(page, prompt)
        messages.append({"role": "user", "content": prompt})
        full = server.client().chat.completions.create(
            model=MODEL, messages=messages, temperature=0, max_tokens=12)
        answer = full.choices[0].message.content
        assert shown == answer and answer
        messages.append({"role": "assistant", "content": answer})
    assert page.eval("document.querySelectorAll('.message').length") == 4
    rendered = page.eval("document.querySelector('.message.assistant .content').textContent")
    assert rendered.split() == messages[2]["content"].split()  # plain words render as themselves
    assert "(stopped at max tokens)" in page.eval("document.body.textContent")


@pytest.mark.browser
def test_stop_aborts_the_request_on_the_server(server, page):
    set_field(page, "temperature", 0)
    set_field(page, "max-tokens", 400)
    aborted = server.metrics().get(ABORTED, 0)
    page.type("#prompt", "Count from 1 to 300, one number per line.")
    page.click("#send")
    page.wait("(document.querySelector('.message.assistant .content').dataset.raw || '')"
              ".length > 20", timeout=60)
    assert server.metrics()[RUNNING] >= 1  # still generating
    page.click("#stop")
    page.wait("document.getElementById('send').disabled === false")
    assert "(stopped)" in page.eval("document.querySelector('.message.assistant').textContent")
    deadline = time.monotonic() + 15
    while server.metrics()[RUNNING] != 0:
        assert time.monotonic() < deadline, "the stopped request kept running on the server"
        time.sleep(0.1)
    assert server.metrics()[ABORTED] == aborted + 1  # ended by the abort, not by its length
    assert page.eval("document.getElementById('error').hidden")


@pytest.mark.browser
def test_markdown_is_rendered_escaped_and_reasoning_collapsed(page):
    html = page.eval("renderMarkdown(" + json.dumps(
        "# Title\n\nSome **bold**, *it* and `<b>x</b>` [site](https://a.b/c) "
        "[bad](javascript:alert(1))\n\n- one\n- two\n\n```python\nprint('<hi>')\n```\n"
        "<script>alert(1)</script>") + ")")
    assert html == (
        "<h1>Title</h1><p>Some <strong>bold</strong>, <em>it</em> and "
        "<code>&lt;b&gt;x&lt;/b&gt;</code> <a href=\"https://a.b/c\" target=\"_blank\" "
        "rel=\"noopener noreferrer\">site</a> [bad](javascript:alert(1))</p>"
        "<ul><li>one</li><li>two</li></ul>"
        "<pre><code class=\"language-python\">print(&#39;&lt;hi&gt;&#39;)</code></pre>"
        "<p>&lt;script&gt;alert(1)&lt;/script&gt;</p>")
    # an answer still streaming inside a fence renders as code so far
    assert page.eval("renderMarkdown('```\\nx = 1')") == "<pre><code>x = 1</code></pre>"
    # reasoning deltas (either field name) fill a <details> that stays closed
    state = page.eval("""(() => {
        const view = answerView(addMessage("assistant"));
        view.add({reasoning_content: "Think"});
        view.add({reasoning: "ing."});
        view.add({content: "Done."});
        const box = document.querySelector(".message.assistant:last-child");
        const details = box.querySelector("details");
        return [details.hidden, details.open, details.textContent,
                box.querySelector(".content").innerHTML];
    })()""")
    assert state == [False, False, "ReasoningThinking.", "<p>Done.</p>"]


@pytest.fixture(scope="module")
def fake_engine():
    """The real engine thread over the fake model (tests/fake_runner.py): these tests are about
    the page and its routes, and need no compile."""
    engine = fake_async_engine()
    yield engine
    engine.shutdown()


@pytest.mark.browser
def test_streamed_reasoning_fills_a_closed_details(browser):
    """deepseek_r1 reads an output that never closes a think block as all reasoning. Two fresh
    engines seeded alike draw the same seed for their first request (the page sends none), so
    the API's answer on one is what the page must show from the other."""
    config = ServerConfig(reasoning_parser="deepseek_r1")
    engines = [fake_async_engine(seed=0), fake_async_engine(seed=0)]
    try:
        with serving(create_app(engines[0], config)) as url, \
                serving(create_app(engines[1], config)) as api:
            page = browser.open(url + "/")
            model = page.wait("document.getElementById('model').value")
            set_field(page, "temperature", 0)
            set_field(page, "max-tokens", 8)
            assert ask(page, "hi") == ""  # no content
            shown = page.eval("(d => [d.hidden, d.open, d.lastChild.textContent])("
                              "document.querySelector('.message.assistant details'))")
            browser.call("Target.closeTarget", targetId=page.target)
            client = openai.OpenAI(base_url=api + "/v1", api_key="x", max_retries=0)
            full = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}], temperature=0,
                max_tokens=8).choices[0].message
        assert full.reasoning and full.content is None
        assert shown == [False, False, full.reasoning]
    finally:
        for engine in engines:
            engine.shutdown()


def test_no_web_ui_answers_404(fake_engine):
    with serving(create_app(fake_engine, ServerConfig(web_ui=False))) as url:
        for path in ("/", "/static/chat.js"):
            r = httpx.get(url + path, timeout=30)
            assert r.status_code == 404 and r.json()["error"]["message"] == (
                f"Not found: GET {path}")
    with serving(create_app(fake_engine, ServerConfig())) as url:
        assert httpx.get(url + "/static/chat.js", timeout=30).status_code == 200
        assert httpx.get(url + "/static/app.py", timeout=30).status_code == 404  # the page's only
