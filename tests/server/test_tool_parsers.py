"""The ``--tool-call-parser`` parsers on each model family's written syntax, and what the chat template sees of a
tool-calling conversation."""

from __future__ import annotations

import json

import pytest

from server.api.protocol import ChatMessage
from server.api.tool_parsers import PARSERS
from server.chat_template import BUILTIN_CHAT_TEMPLATE, ChatTemplate

TOOLS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}
PARIS, ROME = {"city": "Paris", "days": 2}, {"city": "Rome", "days": 1}


def _hermes(args: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': 'get_weather', 'arguments': args})}\n</tool_call>"


def _deepseek(args: dict) -> str:
    return (
        f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{json.dumps(args)}\n```<｜tool▁call▁end｜>"
    )


def _glm(args: dict) -> str:
    pairs = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in args.items())
    return f"<tool_call>get_weather\n{pairs}</tool_call>"


def _harmony(args: dict) -> str:
    return (
        f"<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        f"{json.dumps(args)}<|call|>"
    )


CASES = {
    "hermes": ("Let me check.\n" + _hermes(PARIS) + "\n" + _hermes(ROME), "Let me check."),
    "deepseek_v3": (
        "Let me check.<｜tool▁calls▁begin｜>" + _deepseek(PARIS) + _deepseek(ROME) + "<｜tool▁calls▁end｜>",
        "Let me check.",
    ),
    "glm45": ("Let me check.\n" + _glm(PARIS) + "\n" + _glm(ROME), "Let me check."),
    "openai": ("<|channel|>analysis<|message|>need weather<|end|>" + _harmony(PARIS) + _harmony(ROME), None),
}


@pytest.mark.parametrize("parser", sorted(PARSERS))
def test_parser_finds_the_calls_and_keeps_the_rest_as_content(parser: str) -> None:
    text, content = CASES[parser]
    got_content, calls = PARSERS[parser](text, TOOLS)
    assert got_content == content
    assert [(name, json.loads(args)) for name, args in calls] == [("get_weather", PARIS), ("get_weather", ROME)]
    assert PARSERS[parser]("just text, no calls", TOOLS) == ("just text, no calls", [])


def test_glm45_keeps_string_parameters_as_text() -> None:
    _, calls = PARSERS["glm45"](_glm({"city": "123", "days": "3"}), TOOLS)
    assert json.loads(calls[0][1]) == {"city": "123", "days": 3}


def test_harmony_final_channel_is_the_content() -> None:
    text = "<|channel|>analysis<|message|>hmm<|end|><|start|>assistant<|channel|>final<|message|>Sunny.<|return|>"
    assert PARSERS["openai"](text, TOOLS) == ("Sunny.", [])


def test_hermes_leaves_a_malformed_call_in_the_content() -> None:
    text = "<tool_call>{not json</tool_call>"
    assert PARSERS["hermes"](text, TOOLS) == (text, [])


def test_template_sees_tools_and_call_arguments_as_objects() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(PARIS)}}
    messages = [
        ChatMessage.model_validate(m).for_template()
        for m in [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ]
    ]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == PARIS
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": TOOLS["get_weather"]}}]
    text = ChatTemplate(BUILTIN_CHAT_TEMPLATE, "test").render(messages, {}, tools=tools)
    assert text.startswith("tools: " + json.dumps(tools, ensure_ascii=False) + "\n")
    assert '"arguments": {"city": "Paris", "days": 2}' in text and "tool: sunny\n" in text


@pytest.mark.parametrize(
    "text",
    [
        "Let me check. " + _hermes(PARIS) + "\n" + _hermes(ROME),
        "No call here, only <tool_ca text that looks like a marker's start.",
        _hermes(ROME),
        "Broken: <tool_call>{not json</tool_call> and more",
    ],
)
@pytest.mark.parametrize("size", [1, 3, 7])
def test_auto_stream_gives_the_content_and_calls_of_the_full_response(text: str, size: int) -> None:
    from server.api.tools import ToolCalling, ToolStream
    from server.tokenizer import ByteTokenizer

    calling = ToolCalling("auto", {"get_weather": TOOLS["get_weather"]}, True, ByteTokenizer([256]), parser="hermes")
    ids = list(text.encode()) + [256]
    content, calls = calling.message(text, ids, "stop")
    stream, streamed, deltas = ToolStream(calling), "", []
    for end in range(size, len(text) + size, size):
        final = end >= len(text)
        piece, new = stream.feed(
            text[end - size : end], text[:end], ids if final else ids[:end], "stop" if final else None
        )
        streamed += piece or ""
        deltas += new or []
    assert [(d["function"]["name"], d["function"]["arguments"]) for d in deltas] == [
        (c.name, c.arguments) for c in calls
    ]
    if calls:  # the calls' text never leaks into the content
        assert streamed.strip() == (content or "") and "<tool_call>" not in streamed
    else:
        assert streamed == text == content
    assert stream.finish_reason("stop") == ("tool_calls" if calls else "stop")
