"""gpt-oss's harmony output read by the `openai_gptoss` reasoning parser and the `openai` tool
parser: exact (reasoning, content, calls) for whole outputs, the same when the text comes piece by
piece (split at the special tokens and inside bodies, or character by character), the special
tokens kept, the flags, the gpt-oss default, and one real server whose random model a regex makes
write harmony."""

from __future__ import annotations

import re

import pytest

from nanoserve.sampling_params import SamplingParams
from nanoserve.server.args import ChatFeatures, ServerOptions
from nanoserve.server.chat import constrain_for_tools
from nanoserve.server.chat_output import ChatOutputReader, delta_messages
from nanoserve.server.reasoning_parsers import REASONING_PARSERS, GptOssReasoningParser
from nanoserve.server.responses import _output_items
from nanoserve.server.tool_parsers import TOOL_PARSERS, OpenAIToolParser
from nanoserve.server.tools import ToolUse

THINK = "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant"
CALL = (
    "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    '{"location": "Paris"}'
)
PARIS = ("get_weather", '{"location": "Paris"}')
TIME = ("now", "{}")

# (output text, reasoning, content, calls read by the `openai` tool parser)
CASES = {
    "final": (
        "<|channel|>analysis<|message|>The user asks ... thinking ...<|end|><|start|>"
        "assistant<|channel|>final<|message|>The capital is Paris.<|return|>",
        "The user asks ... thinking ...",
        "The capital is Paris.",
        [],
    ),
    "final without <|return|>": (
        "<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant"
        "<|channel|>final<|message|>Paris.",
        "Hm.",
        "Paris.",
        [],
    ),
    "call": (THINK + CALL + "<|call|>", "Need weather.", "", [PARIS]),
    "call without <|call|>": (THINK + CALL, "Need weather.", "", [PARIS]),
    "recipient before the channel": (
        THINK + ' to=functions.get_weather<|channel|>commentary json<|message|>{"location": '
        '"Paris"}<|call|>',
        "Need weather.",
        "",
        [PARIS],
    ),
    "recipient before the channel, first message": (
        ' to=functions.get_weather<|channel|>commentary json<|message|>{"location": "Paris"}',
        "",
        "",
        [PARIS],
    ),
    "cut in the reasoning": (
        "<|channel|>analysis<|message|>The user asks about",
        "The user asks about",
        "",
        [],
    ),
    "cut in the answer": (
        THINK + "<|channel|>final<|message|>The capital is",
        "Need weather.",
        "The capital is",
        [],
    ),
    "cut in a call": (
        THINK + CALL[:-4],
        "Need weather.",
        "",
        [("get_weather", '{"location": "Par')],
    ),
    "header incomplete": (THINK + "<|channel|>fin", "Need weather.", "", []),
    "header incomplete, first message": ("<|channel|>analysis", "", "", []),
    "two analysis messages": (
        "<|channel|>analysis<|message|>One.<|end|><|start|>assistant"
        "<|channel|>analysis<|message|>Two.<|end|><|start|>assistant"
        "<|channel|>final<|message|>Done.",
        "One.\nTwo.",
        "Done.",
        [],
    ),
    "no harmony at all": ("The capital is Paris.", "", "The capital is Paris.", []),
    "a preamble, then a call": (
        THINK
        + "<|channel|>commentary<|message|>Let me check.<|end|><|start|>assistant"
        + CALL
        + "<|call|>",
        "Need weather.",
        "Let me check.",
        [PARIS],
    ),
    "a preamble, then the answer": (
        "<|channel|>commentary<|message|>Let me check.<|end|><|start|>assistant<|channel|>final"
        "<|message|>Sunny.<|return|>",
        "",
        "Let me check.\nSunny.",
        [],
    ),
    "two calls, the second without arguments": (
        THINK + CALL + "<|call|><|start|>assistant<|channel|>commentary to=functions.now "
        "<|constrain|>json<|message|><|call|>",
        "Need weather.",
        "",
        [PARIS, TIME],
    ),
    "arguments not JSON": (
        THINK + "<|channel|>commentary to=functions.get_weather<|message|> Paris, please \n",
        "Need weather.",
        "",
        [("get_weather", "Paris, please")],
    ),
    "a built-in tool is neither": (
        '<|channel|>commentary to=browser.search<|message|>{"query": "x"}<|call|>',
        "",
        "",
        [],
    ),
    "end markers missing between messages": (
        "<|channel|>analysis<|message|>Hm.<|start|>assistant<|channel|>final<|message|>Yes.",
        "Hm.",
        "Yes.",
        [],
    ),
}
SPECIAL = re.compile(r"(<\|[a-z]+\|>)")


def token_pieces(text: str, size: int) -> list[str]:
    """Each special token alone (as the detokenizer sends it), the text between in `size`
    characters."""
    pieces = []
    for part in SPECIAL.split(text):
        if SPECIAL.fullmatch(part):
            pieces.append(part)
        else:
            pieces += [part[i : i + size] for i in range(0, len(part), size)]
    return pieces


def char_pieces(text: str) -> list[str]:
    return list(text)  # even inside the markers: what may be one must wait


def whole(reader: ChatOutputReader, text: str):
    output = reader.new_choice()
    output.feed(text, True)
    return (
        output.reasoning,
        output.content,
        [(call.function.name, call.function.arguments) for call in output.tool_calls],
    )


def streamed(reader: ChatOutputReader, pieces: list[str]):
    output = reader.new_choice()
    reasoning, content, calls = "", "", {}
    for number, piece in enumerate(pieces):
        for message in delta_messages(output.feed(piece, number == len(pieces) - 1)):
            reasoning += message.reasoning_content or ""
            content += message.content or ""
            for call in message.tool_calls:
                if call.id is not None:
                    assert call.id.startswith("chatcmpl-tool-") and call.index == len(calls)
                    assert call.function.arguments == ""
                    calls[call.index] = [call.function.name, ""]
                else:
                    assert call.function.name is None and call.function.arguments
                    calls[call.index][1] += call.function.arguments
    return reasoning, content, [tuple(call) for call in calls.values()]


def readers():
    return {
        "with the openai tool parser": ChatOutputReader(
            GptOssReasoningParser(), OpenAIToolParser(), "auto"
        ),
        "without a tool parser": ChatOutputReader(GptOssReasoningParser(), None),
    }


@pytest.mark.parametrize("case", list(CASES))
def test_whole_outputs(case):
    text, reasoning, content, calls = CASES[case]
    with_tools, without = readers().values()
    assert whole(with_tools, text) == (reasoning, content, calls)
    assert whole(without, text) == (reasoning, content, [])  # calls unread, never markup
    assert GptOssReasoningParser().split(text, True) == (reasoning, content)


def test_message_fields():
    with_tools, without = readers().values()
    for reader, case, fields in (
        (with_tools, "call", (None, "Need weather.")),
        (without, "call", (None, "Need weather.")),
        (with_tools, "final", ("The capital is Paris.", "The user asks ... thinking ...")),
        (without, "no harmony at all", ("The capital is Paris.", None)),
        (without, "header incomplete, first message", ("", None)),
    ):
        output = reader.new_choice()
        output.feed(CASES[case][0], True)
        assert output.message_fields() == fields, case


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("split", ["tokens", "tokens, 3 characters", "characters"])
def test_streamed_adds_up_to_the_whole(case, split):
    text = CASES[case][0]
    pieces = {
        "tokens": token_pieces(text, 1000),
        "tokens, 3 characters": token_pieces(text, 3),
        "characters": char_pieces(text),
    }[split]
    assert "".join(pieces) == text
    for name, reader in readers().items():
        assert streamed(reader, pieces) == whole(reader, text), name


def test_only_grows_while_a_header_is_written():
    parser = GptOssReasoningParser()
    text = THINK + "<|channel|>final<|message|>Paris."
    seen = ("", "")
    for end in range(len(text) + 1):
        reasoning, content = parser.split(text[:end], False)
        assert reasoning.startswith(seen[0]) and content.startswith(seen[1])
        seen = (reasoning, content)
    assert parser.split(THINK + "<|channel|>final", False) == ("Need weather.", "")
    assert parser.split(THINK + "<|channel|>final<|message|>Par<|e", False) == (
        "Need weather.",
        "Par",
    )  # maybe <|end|>: it waits


def test_parallel_tool_calls_false_keeps_the_first_call():
    reader = ChatOutputReader(GptOssReasoningParser(), OpenAIToolParser(), "auto", 1)
    assert whole(reader, CASES["two calls, the second without arguments"][0])[2] == [PARIS]
    assert reader.finish_reason(True, "stop") == "tool_calls"


def test_special_tokens_are_kept_for_either_parser():
    for reasoning, tool in (
        (GptOssReasoningParser(), None),
        (None, OpenAIToolParser()),
        (REASONING_PARSERS["qwen3"](), OpenAIToolParser()),
    ):
        params = SamplingParams()
        constrain_for_tools(params, ToolUse(None, "auto"), ChatOutputReader(reasoning, tool))
        assert params.skip_special_tokens is False
    params = SamplingParams()
    constrain_for_tools(
        params, ToolUse(None, "none"), ChatOutputReader(REASONING_PARSERS["qwen3"](), None)
    )
    assert params.skip_special_tokens is True


def test_responses_output_items():
    text = CASES["a preamble, then a call"][0]
    items, reasoning = _output_items(readers()["with the openai tool parser"], text)
    assert reasoning == "Need weather."
    assert [item["type"] for item in items] == ["reasoning", "message", "function_call"]
    assert items[1]["content"][0]["text"] == "Let me check."
    assert (items[2]["name"], items[2]["arguments"]) == PARIS


def test_flags_and_the_gpt_oss_default():
    from nanoserve.cli import build_parser
    from nanoserve.server.args import options_from_args

    args = build_parser().parse_args(
        [
            "serve",
            "--reasoning-parser",
            "openai_gptoss",
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "openai",
        ]
    )
    features = ChatFeatures.from_options(options_from_args(args))
    assert isinstance(features.reasoning_parser, GptOssReasoningParser)
    assert features.auto_tool_parser is TOOL_PARSERS["openai"]
    for flag in ("--reasoning-parser", "--tool-call-parser"):
        with pytest.raises(ValueError, match=f"{flag} must be one of .*got 'harmony'"):
            options_from_args(build_parser().parse_args(["serve", flag, "harmony"]))
    default = ChatFeatures.from_options(ServerOptions(), "GptOssForCausalLM")
    assert isinstance(default.reasoning_parser, GptOssReasoningParser)
    assert default.auto_tool_parser is None  # calls still need the flags, as in vLLM
    explicit = ChatFeatures.from_options(
        ServerOptions(reasoning_parser="qwen3"), "GptOssForCausalLM"
    )
    assert explicit.reasoning_parser.name == "qwen3"
    assert ChatFeatures.from_options(ServerOptions(), "LlamaForCausalLM").reasoning_parser is None
    assert ChatFeatures.from_options(ServerOptions()).reasoning_parser is None


# ---- a real server ------------------------------------------------------------------------
# The random Llama's tokens spell the markers as plain text; the regex ends each output with the
# end marker gpt-oss's eos token would write (the eos token that ends the grammar adds no text,
# as in vLLM, special tokens kept or not).
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
HARMONY_CALL = (
    "<\\|channel\\|>analysis<\\|message\\|>[a-z]{1,12}<\\|end\\|><\\|start\\|>"
    "assistant<\\|channel\\|>commentary to=functions\\.get_weather <\\|constrain\\|>"
    'json<\\|message\\|>\\{"city": "(Paris|Oslo)"\\}<\\|call\\|>'
)
HARMONY_ANSWER = (
    "<\\|channel\\|>analysis<\\|message\\|>[a-z]{1,12}<\\|end\\|><\\|start\\|>"
    "assistant<\\|channel\\|>final<\\|message\\|>(Sunny|Rainy)\\.<\\|return\\|>"
)


@pytest.fixture(scope="module")
def server(long_context_llama_dir, tmp_path_factory):
    from tests.server.conftest import ServerHandle
    from tests.server.tool_templates import QWEN_STYLE

    template = tmp_path_factory.mktemp("templates") / "qwen_style.jinja"
    template.write_text(QWEN_STYLE)
    handle = ServerHandle(
        long_context_llama_dir,
        chat_template=str(template),
        enable_auto_tool_choice=True,
        tool_call_parser="openai",
        reasoning_parser="openai_gptoss",
    )
    yield handle
    handle.close()


def test_server_reads_harmony(server):
    client = server.client()
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    base = dict(model=server.engine.served_model_name, messages=ask, temperature=0, max_tokens=200)
    for regex, tools in ((HARMONY_CALL, [WEATHER]), (HARMONY_ANSWER, None)):
        kwargs = dict(
            base,
            extra_body={"structured_outputs": {"regex": regex}},
            **({"tools": tools} if tools else {}),
        )
        choice = client.chat.completions.create(**kwargs).choices[0]
        reasoning = choice.message.model_extra["reasoning_content"]
        assert reasoning.isalpha()
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert (
            "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
            == reasoning
        )
        content = "".join(d.content or "" for d in deltas)
        arguments = "".join(
            call.function.arguments or "" for d in deltas for call in d.tool_calls or []
        )
        if tools:
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            [call] = choice.message.tool_calls
            assert call.function.name == "get_weather"
            assert call.function.arguments in ('{"city": "Paris"}', '{"city": "Oslo"}')
            assert (content, arguments) == ("", call.function.arguments)
        else:
            assert choice.message.content in ("Sunny.", "Rainy.") and not choice.message.tool_calls
            assert content == choice.message.content
