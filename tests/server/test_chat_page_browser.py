"""The chat page in a real headless Chromium (Debian's, driven by playwright) against a real
server with the tiny random model. The oracle for streamed text is the same request answered
non-streamed by the official client at temperature 0."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from tests.helpers import wait_until
from tests.server.conftest import ServerHandle
from tests.server.server_helpers import StepSpy, letter_bias, scrape_metrics

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on PATH (apt-get install chromium; .ci/run does)"
)
sync_api = pytest.importorskip(
    "playwright.sync_api", reason="playwright is not installed (pip install playwright)"
)

SPEED = re.compile(r"^(\d+) tokens in \d+\.\d\d s · \d+\.\d tok/s · first token after \d+ ms$")
TIMEOUT_MS = 60_000


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM)
        yield browser
        browser.close()


@pytest.fixture
def page(browser):
    context = browser.new_context()
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    yield page
    context.close()


def open_page(page, server: ServerHandle, **settings: str):
    page.goto(server.url + "/")
    for field, value in settings.items():
        page.fill("#" + field, value)
    return page


def send(page, text: str, index: int):
    """Type and send a message; wait for assistant answer number `index` to end."""
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")
    answer = page.locator(".msg.assistant").nth(index)
    answer.and_(page.locator("[data-done]")).wait_for()
    return answer


def oracle(server: ServerHandle, messages: list[dict], max_tokens: int, **client_kwargs):
    response = server.client(**client_kwargs).chat.completions.create(
        model=server.engine.served_model_name,
        messages=messages,
        temperature=0,
        top_p=1,
        max_tokens=max_tokens,
    )
    return response.choices[0].message.content, response.usage.completion_tokens


def test_streamed_conversation_matches_the_oracle(page, tiny_server):
    open_page(page, tiny_server, temperature="0", **{"top-p": "1", "max-tokens": "24"})
    page.locator("#model", has_text=tiny_server.engine.served_model_name).wait_for()
    assert page.locator("#api-key-row").is_hidden()
    first = send(page, "The quick brown fox", 0)
    expected, tokens = oracle(tiny_server, [{"role": "user", "content": "The quick brown fox"}], 24)
    assert expected
    assert first.get_attribute("data-done") == "true"
    assert first.locator(".content").text_content() == expected
    speed = page.text_content("#speed")
    assert SPEED.match(speed), speed
    assert int(SPEED.match(speed).group(1)) == tokens
    # the second turn sends the whole conversation
    second = send(page, "Paris is the capital of", 1)
    expected_second, _ = oracle(
        tiny_server,
        [
            {"role": "user", "content": "The quick brown fox"},
            {"role": "assistant", "content": expected},
            {"role": "user", "content": "Paris is the capital of"},
        ],
        24,
    )
    assert second.locator(".content").text_content() == expected_second
    assert page.locator(".msg.user").all_text_contents() == [
        "userThe quick brown fox",
        "userParis is the capital of",
    ]


def abort_count(server: ServerHandle) -> float:
    key = (
        'vllm:request_success_total{engine="0",finished_reason="abort",model_name="%s"}'
        % server.engine.served_model_name
    )
    return scrape_metrics(server.port)[key]


def test_stop_aborts_the_request_on_the_server(page, tiny_server):
    max_tokens = 400
    aborted_before = abort_count(tiny_server)
    # Every token is the letter "a", so the first token already shows as text.
    extra = json.dumps(
        {"ignore_eos": True, "logit_bias": letter_bias(tiny_server.server.app.ctx.tokenizer)}
    )
    open_page(page, tiny_server, extra=extra, **{"max-tokens": str(max_tokens)})
    page.locator("#model", has_text=tiny_server.engine.served_model_name).wait_for()
    # Press Stop the moment the first text arrives.
    page.evaluate("""() => new MutationObserver((changes, observer) => {
        const answer = document.querySelector(".msg.assistant .content");
        if (answer && answer.textContent) { observer.disconnect(); document.getElementById("stop").click(); }
    }).observe(document.getElementById("messages"), {subtree: true, childList: true, characterData: true})""")
    spy = StepSpy(tiny_server.engine)
    try:
        # The first step's token goes out, then the second step stays running until the browser
        # has stopped: the browser's reaction time is no race against 400 tokens.
        second = spy.hold_second_step(lambda: (page.fill("#prompt", "hello"), page.click("#send")))
        answer = page.locator(".msg.assistant").first
        try:
            answer.and_(page.locator("[data-done]")).wait_for()
        finally:
            spy.release(second)
        assert answer.get_attribute("data-done") == "stopped"
        assert "(stopped)" in answer.text_content()
        assert page.is_enabled("#send") and page.is_disabled("#stop")
        wait_until(
            lambda: (
                abort_count(tiny_server) == aborted_before + 1
                and not tiny_server.engine.has_unfinished_requests()
            ),
            "the server to abort the stopped request",
        )
    finally:
        spy.restore()
    # The server learns of the close from its writes: the held step, two more, then the abort.
    assert len(spy.aborts) == 1 and spy.aborts[0][1] <= second + 4, (spy.aborts, second)


def test_clear_empties_the_conversation(page, tiny_server):
    open_page(page, tiny_server, temperature="0", **{"max-tokens": "16"})
    send(page, "def add(a, b):", 0)
    send(page, "import torch", 1)
    assert page.locator(".msg").count() == 4
    page.click("#clear")
    assert page.locator(".msg").count() == 0
    assert page.text_content("#speed") == ""
    # the next message starts a new conversation: no history is sent
    answer = send(page, "import torch", 0)
    expected, _ = oracle(tiny_server, [{"role": "user", "content": "import torch"}], 16)
    assert answer.locator(".content").text_content() == expected
    assert page.locator(".msg").count() == 2


def test_bad_setting_shows_the_servers_error_and_allows_a_retry(page, tiny_server):
    open_page(page, tiny_server, temperature="-1", **{"max-tokens": "8"})
    page.locator("#model", has_text=tiny_server.engine.served_model_name).wait_for()
    answer = send(page, "hello", 0)
    assert answer.get_attribute("data-done") == "error"
    assert "temperature" in answer.locator(".note.error").text_content()
    assert page.locator(".msg.user").count() == 0  # not part of the conversation
    assert page.input_value("#prompt") == "hello"  # given back for a retry
    page.fill("#temperature", "0")
    page.click("#send")
    retry = page.locator(".msg.assistant").nth(1)
    retry.and_(page.locator("[data-done]")).wait_for()
    expected, _ = oracle(tiny_server, [{"role": "user", "content": "hello"}], 8)
    assert retry.locator(".content").text_content() == expected


def test_api_key_field(page, tiny_llama_dir):
    server = ServerHandle(tiny_llama_dir, api_key="sekret")
    try:
        open_page(page, server, temperature="0", **{"max-tokens": "12"})
        page.locator("#status", has_text="Enter the server's API key.").wait_for()  # a 401
        assert page.is_visible("#api-key")
        assert page.text_content("#model") == "(no model)"
        page.fill("#prompt", "hello")
        page.click("#send")  # nothing is sent without a model
        page.locator("#status", has_text="Enter the server's API key.").wait_for()
        assert page.locator(".msg").count() == 0
        page.fill("#api-key", "wrong")
        page.dispatch_event("#api-key", "change")
        page.locator("#status", has_text="Enter the server's API key.").wait_for()
        page.fill("#api-key", "sekret")
        page.dispatch_event("#api-key", "change")
        page.locator("#model", has_text=server.engine.served_model_name).wait_for()
        answer = send(page, "hello", 0)
        expected, _ = oracle(server, [{"role": "user", "content": "hello"}], 12, api_key="sekret")
        assert answer.locator(".content").text_content() == expected
    finally:
        server.close()
