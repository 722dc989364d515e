"""Where a chat template renders (issue 52 row 12): the size that sends the rendering to the
preprocessing pool counts every part of every message (tool calls' names and arguments,
reasoning_content, names, ids, content parts), not only `content`. No clock: a spy around the
real tokenizer's apply_chat_template records the thread each render ran on."""

from __future__ import annotations

import json

import pytest

from nanoserve.server.preprocess import SMALL_INPUT
from tests.server.test_event_loop_budget import CHAT, Spy, post

LARGE = 5 * SMALL_INPUT  # characters in one part of one message
HELLO = {"role": "user", "content": "hello"}


def tool_call(name: str, arguments: str) -> dict:
    return {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}


LARGE_PARTS = {
    "tool_calls arguments": {
        "role": "assistant",
        "content": "",
        "tool_calls": [tool_call("f", json.dumps({"text": "x" * LARGE}))],
    },
    "tool_calls name": {
        "role": "assistant",
        "content": "",
        "tool_calls": [tool_call("f" * LARGE, "{}")],
    },
    "reasoning_content": {"role": "assistant", "content": "ok", "reasoning_content": "x" * LARGE},
    "name": {"role": "user", "content": "hi", "name": "n" * LARGE},
    "tool_call_id": {"role": "tool", "content": "ok", "tool_call_id": "c" * LARGE},
    "content parts": {"role": "user", "content": [{"type": "text", "text": "x" * LARGE}]},
}


def render_threads(server, monkeypatch, path: str, body: dict) -> Spy:
    render = Spy(monkeypatch, server.server.app.ctx.tokenizer, "apply_chat_template")
    status, _, raw = post(server.port, path, body)
    # rendered; what follows (a prompt too long for the tiny context) may still refuse it
    assert status in (200, 400), raw[:300]
    assert b"Internal" not in raw
    assert len(render.threads) == 1, raw[:300]
    return render


def test_small_messages_render_on_the_loop(tiny_server, monkeypatch):
    """The control: the spy tells the two paths apart."""
    render = render_threads(tiny_server, monkeypatch, "/tokenize", {"messages": [HELLO]})
    assert not render.off_the_loop()


@pytest.mark.parametrize("part", list(LARGE_PARTS))
def test_a_large_part_of_a_message_renders_off_the_loop(tiny_server, monkeypatch, part):
    render = render_threads(
        tiny_server, monkeypatch, "/tokenize", {"messages": [HELLO, LARGE_PARTS[part]]}
    )
    assert render.off_the_loop(), part


def test_chat_route_counts_tool_call_arguments(tiny_server, monkeypatch):
    body = {"messages": [HELLO, LARGE_PARTS["tool_calls arguments"], HELLO], "max_tokens": 1}
    assert render_threads(tiny_server, monkeypatch, CHAT, body).off_the_loop()
