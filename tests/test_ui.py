"""The chat page at `/`: served from the package under a strict CSP, its markdown renderer's
escaping checked in node, and the page itself driven in a real headless Chromium (Debian's
`chromium`, through Playwright's Python API; skipped where either is missing): a streamed
answer appears token by token, the stop button aborts it and frees its KV blocks, an answer
holding `<script>` renders as text, reasoning is folded, and `--api-key` asks for the key."""
from __future__ import annotations

import asyncio
import json
import random
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from test_server import FakeEngine, fake, serve_in_thread, start_server, wait_idle  # noqa: F401

UI = Path(__file__).resolve().parents[1] / "src" / "nanoserve" / "ui"
API_KEY = "sk-ui-test"
# Tags the renderer may emit; anything else that starts with "<" would be the model's markup.
ALLOWED_TAG = re.compile(r'</?(p|br|strong|em|code|h[3-6]|ul|ol|li|pre( data-lang="[^"<>]*")?'
                         r'|a href="https?://[^"<>]*" target="_blank" rel="noopener noreferrer")>')


def _asgi_get(app, path: str) -> httpx.Response:
    async def get():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.get(path)

    return asyncio.run(get())


def test_page_is_served_from_the_package_unless_no_ui(fake):  # noqa: F811
    from nanoserve.entrypoints.server import build_app

    _, async_engine = fake
    app = build_app(async_engine, "fake", api_key="k")
    page = _asgi_get(app, "/")  # no key needed: the page asks for it
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert page.text == (UI / "index.html").read_text()
    for name, kind in (("app.js", "text/javascript"), ("markdown.js", "text/javascript"),
                       ("style.css", "text/css")):
        asset = _asgi_get(app, f"/ui/{name}")
        assert asset.status_code == 200 and asset.headers["content-type"].startswith(kind)
    assert _asgi_get(app, "/ui/..%2Fserver.py").status_code == 404
    assert not re.search(r"(src|href)=\"(https?:)?//", page.text)  # nothing from elsewhere
    assert _asgi_get(build_app(async_engine, "fake", ui=False), "/").status_code == 404


NODE = shutil.which("node")


@pytest.mark.skipif(NODE is None, reason="node is not installed")
def test_scripts_parse_and_markdown_escapes_every_input():
    for name in ("app.js", "markdown.js"):
        subprocess.run([NODE, "--check", str(UI / name)], check=True)
    rng = random.Random(0)
    pieces = ["<", ">", "&", '"', "'", "`", "```", "*", "**", "#", "- ", "1. ", "\n", "[x](",
              "https://e.com/", "javascript:", ")", "<script>", "</script>", "onerror=", " ",
              "a", "<img src=x onerror=alert(1)>", "```js\n"]
    texts = ["<script>alert(1)</script>", "`<b>` **<i>x</i>**", "```\n</code><script>\n```",
             '[x](https://e.com/"onmouseover="alert(1))'] + \
        ["".join(rng.choice(pieces) for _ in range(rng.randrange(1, 40))) for _ in range(300)]
    code = ("const {renderMarkdown} = require(process.argv[1]);"
            "const texts = JSON.parse(require('fs').readFileSync(0, 'utf8'));"
            "console.log(JSON.stringify(texts.map(renderMarkdown)));")
    out = subprocess.run([NODE, "-e", code, str(UI / "markdown.js")], input=json.dumps(texts),
                         capture_output=True, text=True, check=True).stdout
    for text, html in zip(texts, json.loads(out)):
        stray = ALLOWED_TAG.sub("", html)
        assert "<" not in stray and ">" not in stray, (text, html)
    assert json.loads(out)[1] == "<p><code>&lt;b&gt;</code> <strong>&lt;i&gt;x&lt;/i&gt;</strong></p>"


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or \
    shutil.which("google-chrome")
try:
    from playwright.sync_api import sync_playwright
except ImportError:
    sync_playwright = None
needs_browser = pytest.mark.skipif(CHROMIUM is None or sync_playwright is None,
                                   reason="needs a chromium binary and the playwright package")


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser
        browser.close()


def _page(browser):
    # Without the page's CSP: Playwright's waits evaluate strings, which it forbids, and the
    # escaping must hold on its own (the CSP is a second wall, checked above).
    return browser.new_page(bypass_csp=True)


def _settings(page, max_tokens: int) -> None:
    page.click("#settings-toggle")
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#temperature", "0")


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    srv = start_server(tiny_llama, tmp_path_factory.mktemp("ui") / "log", "--api-key", API_KEY)
    yield srv
    srv.stop()


@needs_browser
def test_chat_streams_then_stop_aborts_and_frees_the_cache(browser, server, tmp_path):
    page = _page(browser)
    page.goto(server.url + "/")
    page.wait_for_selector("#key-form:not([hidden])")  # --api-key: the page asks for it
    page.fill("#key", API_KEY)
    page.click("#key-form button")
    page.wait_for_function("document.getElementById('model').textContent === 'tiny-llama'")
    assert page.evaluate("sessionStorage.getItem('nanoserve-api-key')") == API_KEY
    _settings(page, 450)  # with the prompt, within the tiny model's 512 positions
    page.fill("#prompt", "Tell me a very long story.")
    page.click("#send")
    lengths = set()
    deadline = time.time() + 60
    while len(lengths) < 4 and time.time() < deadline:  # the answer grows token by token
        lengths.add(len(page.text_content(".message.assistant .content") or ""))
        time.sleep(0.05)
    assert len(lengths) >= 4 and not page.is_disabled("#stop")
    page.screenshot(path=str(tmp_path / "chat-streaming.png"))
    page.click("#stop")
    page.wait_for_selector(".message.assistant[data-done]")
    assert page.is_disabled("#stop") and not page.is_disabled("#send")
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}) as h:
        values = wait_idle(h)
    assert values["nanoserve:num_requests_running"] == 0
    assert values["nanoserve:kv_cache_usage_perc"] == 0
    assert values['nanoserve:request_success_total{finished_reason="abort"}'] == 1
    page.close()


class WordTokenizer:
    """A tokenizer for the fake engine: one token per word, a template joining contents."""

    chat_template = "words"

    def apply_chat_template(self, conversation, tools=None, tokenize=False,
                            add_generation_prompt=True):
        return " ".join(m["content"] for m in conversation)

    def encode(self, text, add_special_tokens=True):
        return [5] * max(1, len(text.split()))


# The fake model's answer, one piece per token: thinking, then markup that must stay text.
PIECES = ["<think>", "plan ", "it</think>", "<script>window.pwned = 1</script>",
          " <img src=x onerror=\"window.pwned = 2\">", " **bold**"]


class ScriptedEngine(FakeEngine):
    tokenizer = WordTokenizer()

    def _output(self, rid, finish, why=None):
        out = super()._output(rid, finish, why)
        out.outputs[0].text = "".join(PIECES[:len(out.outputs[0].token_ids)])
        return out


@needs_browser
def test_model_markup_renders_as_text_and_reasoning_folds(browser, tmp_path):
    from nanoserve.engine.async_engine import AsyncLLMEngine
    from nanoserve.entrypoints.server import build_app

    engine = AsyncLLMEngine(ScriptedEngine)
    engine.start()
    try:
        with serve_in_thread(build_app(engine, "fake", reasoning_parser="qwen3")) as url:
            page = _page(browser)
            page.goto(url + "/")
            page.wait_for_function("document.getElementById('model').textContent === 'fake'")
            _settings(page, len(PIECES))
            page.fill("#prompt", "Say something dangerous.")
            page.press("#prompt", "Enter")
            page.wait_for_selector(".message.assistant[data-done]")
            page.screenshot(path=str(tmp_path / "chat-markup.png"))
            content = page.locator(".message.assistant .content")
            assert "<script>window.pwned = 1</script>" in content.text_content()
            assert content.locator("script, img").count() == 0
            assert content.locator("strong").text_content() == "bold"
            assert page.evaluate("window.pwned") is None
            reasoning = page.locator("details.reasoning")
            assert reasoning.is_visible() and reasoning.get_attribute("open") is None
            assert reasoning.locator("div").text_content() == "plan it"
            assert page.text_content("#speed").endswith("tok/s")
            page.close()
    finally:
        engine.shutdown()
