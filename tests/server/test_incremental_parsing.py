"""Tool-call and reasoning parsers read a stream delta by delta (issue 52 row 2): every delta must
give exactly what re-parsing the whole text so far gives (the oracle below is the stream as it was:
`parse(text so far)` after each delta, differences sent), over many random splittings of real
outputs and of random JSON-ish text, and the work must be linear: the scanners' steps are counted
for a 64k-character argument sent a few characters at a time, and the whole text is parsed once
(the last delta), not after every delta. No clock, no model."""

from __future__ import annotations

import json
import random

import pytest

from nanoserve.server.chat_output import ChatOutputReader
from nanoserve.server.reasoning_parsers import REASONING_PARSERS
from nanoserve.server.tool_parsers import (
    TOOL_PARSERS,
    NamedToolParser,
    RequiredToolParser,
    ToolCallStream,
)

ARGUMENTS = [
    '{"city": "Paris", "unit": "c"}',
    '{"q": "caf\\u00e9 \\ud83d\\ude00 \\"quoted\\" back\\\\slash", "nested": {"a": [1, 2, '
    '{"b": "}{][", "c": null}], "d": {"e": {"f": []}}}, "n": -1.5e3, "t": true}',
    '{"text": "ünïcødé ✓ 日本語 😀", "code": "if (x) { return \\"}\\"; }"}',
    "{}",
    '[1, {"a": "]"}]',
]


def oracle(parser, pieces, max_calls=None):
    """The stream before the readers: the whole text parsed after each delta."""
    text, content_sent, calls, feeds = "", "", [], []
    for number, piece in enumerate(pieces):
        text += piece
        parsed = parser.parse(text, number == len(pieces) - 1)
        content = ""
        if len(parsed.content) > len(content_sent) and parsed.content.startswith(content_sent):
            content, content_sent = parsed.content[len(content_sent) :], parsed.content
        deltas = []
        for index, call in enumerate(parsed.calls[:max_calls]):
            if index == len(calls):
                calls.append([call.name, ""])
                deltas.append((index, call.name, ""))
            sent = calls[index]
            if len(call.arguments) > len(sent[1]) and call.arguments.startswith(sent[1]):
                deltas.append((index, None, call.arguments[len(sent[1]) :]))
                sent[1] = call.arguments
        feeds.append((content, deltas))
    return feeds


def streamed(parser, pieces, max_calls=None):
    stream = ToolCallStream(parser, max_calls)
    feeds = []
    for number, piece in enumerate(pieces):
        content, deltas = stream.feed(piece, number == len(pieces) - 1)
        feeds.append((content, [(d.index, d.name, d.arguments) for d in deltas]))
    return feeds


def splittings(text, count, seed):
    """`count` random ways to cut `text` into pieces (mostly a few characters, as tokens are),
    the first few fixed: one character at a time, the whole at once, and a final empty piece."""
    yield list(text) or [""]
    yield [text]
    yield [text, ""]
    rng = random.Random(seed)
    for _ in range(count):
        pieces, index = [], 0
        while index < len(text):
            size = rng.choice((1, 1, 2, 3, 4, 5, 8, 13, 40))
            pieces.append(text[index : index + size])
            index += size
        if rng.random() < 0.2:
            pieces.append("")
        yield pieces or [""]


def hermes_texts():
    texts = []
    for arguments in ARGUMENTS:
        call = f'{{"name": "get_weather", "arguments": {arguments}}}'
        texts += [
            f"Let me look.\n<tool_call>\n{call}\n</tool_call>",
            f'<tool_call>{call}</tool_call>\n<tool_call>\n{{"name": "now"}}\n</tool_call>\nafter',
            f'<tool_call>\n{{"arguments": {arguments}, "name": "f"}}\n</tool_call>',
            f'<tool_call>\n{{"name": "f", "parameters": {arguments}}}',
            f"<tool_call>\n{call[: len(call) // 2]}",
        ]
    return texts + [
        '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": null}\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": 12}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>',
        '<tool_call>\n["get_weather"]\n</tool_call>',
        '<tool_call>\n{"arguments": {}}\n</tool_call><tool_call>{"name": "g", "arguments": {}}',
        '<tool_call>\n{"name": "a", "arguments": {"x": 1}, "arguments": {"x": 1, "y": 2}}',
        '<tool_call>\n{"name": "a", "arguments": {"x": 1}, "name": "b"}\n</tool_call>',
        '<tool_call>\n{"name": "a", "parameters": {"x": 1}, "arguments": {"x": 1, "y": 2}}',
        '<tool_call>\n{"name": "a" "arguments": {}}',
        '<tool_call>{"name": "a\\x"}',
        "a <tool_call> inside prose, then more prose",
        "Hello <tool_ and <tool_call",
        "plain text only, no calls at all",
    ]


def llama_texts():
    texts = []
    for arguments in ARGUMENTS:
        call = f'{{"name": "get_weather", "parameters": {arguments}}}'
        texts += [
            call,
            f'  <|python_tag|> {call}; {{"name": "now", "parameters": {{}}}}',
            f"{call} ; ; {call}",
            f"{call} and some words",
            call[: len(call) // 2],
        ]
    return texts + [
        "The capital of France is Paris.",
        "  <|python_ta",
        "<|python_tag|>",
        "<|python_tag|> Paris",
        "<|pyth on",
        "   \n  ",
        '{"name": 5}',
    ]


def mistral_texts():
    texts = []
    for arguments in ARGUMENTS:
        texts += [
            f'Checking. [TOOL_CALLS][{{"name": "f", "arguments": {arguments}}}, '
            f'{{"name": "now", "arguments": {{}}}}]',
            f"[TOOL_CALLS]get_weather[ARGS]{arguments}[TOOL_CALLS]now{{}}",
            f"[TOOL_CALLS] f {arguments} [TOOL_CALLS] g[ARGS] {arguments} trailing",
            f'[TOOL_CALLS][{{"name": "f", "arguments": {arguments}}}, 5]',
        ]
    return texts + [
        '[TOOL_CALLS]f{"a": }[TOOL_CALLS]g{}',
        "[TOOL_CALLS]bad name{}",
        '[TOOL_CALLS]f{"a": 1}[TOOL_CALLS]g{"b": ]}',
        "[TOOL_CALLS] not json",
        "no calls at all [TOOL_",
        "[TOOL_CALLS]f{}[TOOL_CALL",
        "[TOOL_CALLS]",
    ]


def required_texts():
    texts = []
    for arguments in ARGUMENTS:
        call = f'{{"name":"get_weather","parameters":{arguments}}}'
        texts += [
            f"[{call}]",
            f' [ {call} , {{"name": "now", "parameters": {{}}}} ] ',
            f"[{call}, x]",
            f"[{call}",
            f'[{{"parameters": {arguments}}}, {call}]',
        ]
    return texts + ['{"a": 1}', '[{"name": "f" x}, {"name": "g"}]', "[1]", "", "  "]


def named_texts():
    return [a for a in ARGUMENTS] + [
        "  " + ARGUMENTS[1] + " \n\t ",
        '\u00a0 {"a": 1}\t',
        "",
        " \n ",
        "x  y \n",
    ]


def pythonic_texts():
    calls = (
        '[get_weather(city="Paris, FR", unit=\'c\'), now(), search(terms=["a", "b)"], n=2),'
        ' f(s="caf\\u00e9 \\" ✓ (", d={"k": [1, None]})]'
    )
    return [
        calls,
        f"  <|python_start|> {calls} <|python_end|>",
        calls[:40],
        calls[:-1],
        "[get_weather(city=",
        "[get_weather(city=x)]",
        "[1, 2]",
        "Paris is sunny.",
        "[f(*args)]",
        "[f() g()]",
        "[f(), g(a=set())]",
        "[f()) g()]",
        "<|python_st",
        "<|python_end|>",
        "[f(), ,g()]",
        "[f() + g()]",
        "[f(a='''x)'''), g()]",
    ]


PARSERS = {
    "hermes": (lambda: TOOL_PARSERS["hermes"](), hermes_texts),
    "llama3_json": (lambda: TOOL_PARSERS["llama3_json"](), llama_texts),
    "mistral": (lambda: TOOL_PARSERS["mistral"](), mistral_texts),
    "required": (RequiredToolParser, required_texts),
    "named": (lambda: NamedToolParser("get_weather"), named_texts),
    "pythonic": (lambda: TOOL_PARSERS["pythonic"](), pythonic_texts),
}


@pytest.mark.parametrize("name", PARSERS)
def test_stream_matches_whole_text_parsing(name):
    """The same content and deltas as the oracle at every delta, for every splitting (its
    pieces add up to `parse` of the whole output: tests/server/test_tool_parsers.py)."""
    make, texts = PARSERS[name]
    for number, text in enumerate(texts()):
        for pieces in splittings(text, 60, seed=number):
            for max_calls in (None, 1):
                expected = oracle(make(), pieces, max_calls)
                assert streamed(make(), pieces, max_calls) == expected, (text, pieces)


TOKENS = [
    "{",
    "}",
    "[",
    "]",
    '"',
    ":",
    ",",
    " ",
    "\n",
    "\\",
    '\\"',
    '"name"',
    '"arguments"',
    '"parameters"',
    '"f"',
    "1",
    "null",
    "x",
    ";",
    "é",
    "<tool_call>",
    "</tool_call>",
    "<|python_tag|>",
    "[TOOL_CALLS]",
    "[ARGS]",
    '"name": "f", "arguments": {',
    "(",
    ")",
    "'",
    "f(",
    "a=1",
    "<|python_start|>",
    "<|python_end|>",
]


@pytest.mark.filterwarnings("ignore:invalid escape sequence")  # ast.parse of random pythonic
@pytest.mark.parametrize("name", PARSERS)
def test_stream_matches_on_random_text(name):
    """Random JSON-ish text (malformed almost always): still the oracle's deltas exactly."""
    make, _ = PARSERS[name]
    rng = random.Random(52)
    starts = {
        "hermes": "<tool_call>",
        "llama3_json": "",
        "mistral": "[TOOL_CALLS]",
        "required": "[",
        "named": "",
        "pythonic": "[",
    }
    for _ in range(400):
        text = starts[name] + "".join(rng.choice(TOKENS) for _ in range(rng.randint(0, 30)))
        for pieces in splittings(text, 3, seed=rng.random()):
            assert streamed(make(), pieces) == oracle(make(), pieces), (text, pieces)


class CountingRequired(RequiredToolParser):
    """Counts the characters handed to the whole-text parse."""

    parsed = 0

    def parse(self, text, final):
        self.parsed += len(text)
        return super().parse(text, final)


def long_arguments(size):
    words = []
    while sum(map(len, words)) < size:
        words.append(f'"k{len(words)}": {{"s": "caf\\u00e9 \\"x\\" ✓", "n": [1, 2.5, null]}}')
    return "{" + ", ".join(words) + "}"


def test_scanner_steps_are_linear_in_a_long_streamed_argument():
    """tool_choice "required": a 64k-character argument, 3 characters a delta. The old stream
    parsed the whole text after every delta (~n^2/6 characters); now the text is parsed whole
    only for the last delta and the scanner examines each character once."""
    arguments = long_arguments(64 * 1024)
    text = f'[{{"name": "get_weather", "parameters": {arguments}}}]'
    parser = CountingRequired()
    stream = ToolCallStream(parser)
    sent = ""
    for index in range(0, len(text), 3):
        _, deltas = stream.feed(text[index : index + 3], index + 3 >= len(text))
        sent += "".join(delta.arguments for delta in deltas)
    assert sent == arguments and json.loads(sent) == json.loads(arguments)
    assert parser.parsed <= len(text)  # the final read only
    assert stream.reader.steps <= 2 * len(text)


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral"])
def test_other_parsers_read_a_long_argument_once(name):
    arguments = long_arguments(64 * 1024)
    call = f'{{"name": "f", "arguments": {arguments}}}'
    text = {
        "hermes": f"<tool_call>\n{call}\n</tool_call>",
        "llama3_json": call,
        "mistral": f"[TOOL_CALLS][{call}]",
    }[name]
    stream = ToolCallStream(TOOL_PARSERS[name]())
    for index in range(0, len(text), 3):
        stream.feed(text[index : index + 3], False)
    assert stream.calls[0].arguments == arguments
    assert stream.reader.steps <= 2 * len(text)


# ---- reasoning ---------------------------------------------------------------------------
def reasoning_oracle(parser, pieces):
    """ChoiceOutput before the readers: `split` of the whole text after each delta."""
    text, reasoning_sent, rest_seen, feeds = "", "", 0, []
    for number, piece in enumerate(pieces):
        text += piece
        reasoning, rest = parser.split(text, number == len(pieces) - 1)
        feeds.append((reasoning[len(reasoning_sent) :], rest[rest_seen:]))
        reasoning_sent, rest_seen = reasoning, len(rest)
    return feeds


THINK_TEXTS = [
    "<think>\nThe user wants 2+2.\n</think>\n\n4",
    "4",
    "<think>cut off by max_tokens",
    "Okay, 2+2.</think>4",
    "<think>Okay.</think>4</think>5",
    "<thi",
    "<think",
    "<think>a</thi",
    "<thinking>no",
    "<think><think>x</think>",
    "",
    "</think>",
    "<think>" + "ünï ✓ " * 20 + "</think>after <think> more",
]


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
def test_think_reader_matches_whole_text_split(name):
    for number, text in enumerate(THINK_TEXTS):
        for pieces in splittings(text, 40, seed=number):
            output = ChatOutputReader(REASONING_PARSERS[name](), None).new_choice()
            got = [
                (d.reasoning, d.content)
                for d in (
                    output.feed(piece, i == len(pieces) - 1) for i, piece in enumerate(pieces)
                )
            ]
            assert got == reasoning_oracle(REASONING_PARSERS[name](), pieces), (text, pieces)


class CountingQwen3(REASONING_PARSERS["qwen3"]):
    split_characters = 0

    def split(self, text, final):
        self.split_characters += len(text)
        return super().split(text, final)


def test_think_reader_reads_each_character_once():
    """64k characters of reasoning, 3 a delta: `split` reads the whole text once (the last
    delta), the reader looks at each character about once."""
    text = "<think>" + "Let me think about {this} </thinx " * 2000 + "</think>The answer."
    parser = CountingQwen3()
    output = ChatOutputReader(parser, None).new_choice()
    for index in range(0, len(text), 3):
        output.feed(text[index : index + 3], index + 3 >= len(text))
    assert (output.reasoning, output.content) == parser.split(text, True)
    assert parser.split_characters <= 2 * len(text)  # the final read (and this check's)
    assert output.reasoning_reader.steps <= 4 * len(text)


def test_reasoning_then_tool_calls_match_the_oracle():
    """Qwen3's reasoning, then hermes calls: the content and calls of each delta as before."""
    text = (
        "<think>Need the weather.</think>\n\nOk. <tool_call>\n"
        f'{{"name": "get_weather", "arguments": {ARGUMENTS[1]}}}\n</tool_call>'
    )
    for pieces in splittings(text, 40, seed=7):
        output = ChatOutputReader(
            REASONING_PARSERS["qwen3"](), TOOL_PARSERS["hermes"](), "auto"
        ).new_choice()
        got = []
        for number, piece in enumerate(pieces):
            delta = output.feed(piece, number == len(pieces) - 1)
            got.append(
                (
                    delta.reasoning,
                    delta.content,
                    [(d.index, d.name, d.arguments) for d in delta.tool_calls],
                )
            )
        reasoning_feeds = reasoning_oracle(REASONING_PARSERS["qwen3"](), pieces)
        tool_feeds = oracle(TOOL_PARSERS["hermes"](), [rest for _, rest in reasoning_feeds])
        assert got == [(r, c, d) for (r, _), (c, d) in zip(reasoning_feeds, tool_feeds)]


# ---- harmony (gpt-oss) ----------------------------------------------------------------------
HARMONY_CALL = (
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    "<|message|> " + ARGUMENTS[1] + " \n<|call|>"
)
HARMONY_TEXTS = [
    "<|channel|>analysis<|message|>The user asks ... thinking ...<|end|><|start|>assistant"
    "<|channel|>final<|message|>The capital is Paris.<|return|>",
    "<|channel|>analysis<|message|>One.<|end|><|start|>assistant<|channel|>analysis<|message|>"
    "Two.<|end|><|start|>assistant<|channel|>commentary<|message|>Let me check.<|end|>"
    + HARMONY_CALL
    + "<|start|>assistant to=functions.now<|channel|>commentary json<|message|>"
    "<|call|><|start|>assistant<|channel|>final<|message|>Done <|en",
    ' to=functions.get_weather<|channel|>commentary json<|message|>{"location": "Paris"}',
    "<|channel|>analysis<|message|>cut <|star",
    "<|chan",
    "The capital is Paris.",
    "<|channel|>analysis",
    "<|channel|>final<|message|>a<|start|>assistant<|channel|>final<|message|>b",
    "to=browser.search<|message|>x<|end|><|channel|>final<|message|>  y  ",
]


def test_harmony_readers_match_whole_text_reading():
    for number, text in enumerate(HARMONY_TEXTS):
        for pieces in splittings(text, 40, seed=number):
            assert streamed(TOOL_PARSERS["openai"](), pieces) == oracle(
                TOOL_PARSERS["openai"](), pieces
            ), (text, pieces)
            output = ChatOutputReader(REASONING_PARSERS["openai_gptoss"](), None).new_choice()
            got = [
                (d.reasoning, d.content)
                for d in (
                    output.feed(piece, i == len(pieces) - 1) for i, piece in enumerate(pieces)
                )
            ]
            assert got == reasoning_oracle(REASONING_PARSERS["openai_gptoss"](), pieces), (
                text,
                pieces,
            )


def test_harmony_reads_a_long_call_once():
    text = (
        "<|channel|>analysis<|message|>"
        + "thinking <|x " * 3000
        + "<|end|>"
        + HARMONY_CALL.replace(ARGUMENTS[1], long_arguments(64 * 1024))
    )
    stream = ToolCallStream(TOOL_PARSERS["openai"]())
    for index in range(0, len(text), 3):
        stream.feed(text[index : index + 3], False)
    assert stream.calls[0].arguments == long_arguments(64 * 1024)
    assert stream.reader.steps <= 4 * len(text)
