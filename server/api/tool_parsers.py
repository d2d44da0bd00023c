"""Parsers of a model's own tool-call syntax (``tool_choice: "auto"``), chosen by ``--tool-call-parser`` as vLLM's.

Each reads the output text (special tokens written out) and returns the text outside the calls (the message's
``content``; None when only whitespace) and the calls as ``(name, arguments as JSON text)``:

- ``hermes`` (Qwen2.5, Qwen3, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
- ``deepseek_v3``: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`` then the arguments
  in a json code fence, ``<｜tool▁call▁end｜>`` ... ``<｜tool▁calls▁end｜>``.
- ``glm45`` (GLM-4.5 / 4.6): ``<tool_call>NAME`` then ``<arg_key>K</arg_key><arg_value>V</arg_value>`` pairs,
  ``</tool_call>``; a value is JSON when it parses as JSON and its parameter is not a string, else the text.
- ``openai`` (gpt-oss, harmony): ``<|channel|>commentary to=functions.NAME ... <|message|>ARGS<|call|>``; the
  content is the ``final`` channel's message.

A call whose arguments are not a JSON object is left in the content (the model did not make a call).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable, Mapping
from typing import Any

ParsedCalls = tuple[str | None, list[tuple[str, str]]]
# the parameter schemas of the declared tools, by name (glm45 types its values by them)
ToolSchemas = Mapping[str, Mapping[str, Any]]


def _arguments(value: Any) -> str | None:
    """Arguments as compact JSON text, when they are an object (or JSON text of one)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def _content(parts: list[str]) -> str | None:
    text = "".join(parts).strip()
    return text or None


def _split(text: str, pattern: re.Pattern[str], call: Callable[[re.Match[str]], tuple[str, str] | None]) -> ParsedCalls:
    """Calls where ``pattern`` matches and ``call`` makes one of the match; the rest is content."""
    parts, calls, at = [], [], 0
    for m in pattern.finditer(text):
        made = call(m)
        parts.append(text[at : m.start()] if made else text[at : m.end()])
        if made:
            calls.append(made)
        at = m.end()
    parts.append(text[at:])
    return _content(parts), calls


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def hermes(text: str, tools: ToolSchemas) -> ParsedCalls:
    def call(m: re.Match[str]) -> tuple[str, str] | None:
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = _arguments(obj.get("arguments", obj.get("parameters", {})))
        return None if args is None else (obj["name"], args)

    return _split(text, _HERMES, call)


_DS_BEGIN, _DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
_DS_CALL = re.compile(
    r"<｜tool▁call▁begin｜>\s*(?:function)?\s*<｜tool▁sep｜>\s*([^\n`]+?)\s*\n?\s*```(?:json)?\s*(.*?)\s*```\s*"
    r"(?:<｜tool▁call▁end｜>|$)",
    re.S,
)


def deepseek_v3(text: str, tools: ToolSchemas) -> ParsedCalls:
    start = text.find(_DS_BEGIN)
    calls = [] if start < 0 else [(n, a) for n, raw in _DS_CALL.findall(text, start) if (a := _arguments(raw))]
    if not calls:
        return _content([text]), []
    end = text.find(_DS_END, start)
    return _content([text[:start], "" if end < 0 else text[end + len(_DS_END) :]]), calls


_GLM_CALL = re.compile(r"<tool_call>\s*([^\n<]+?)\s*(?:\n|(?=<arg_key>)|(?=</tool_call>))(.*?)(?:</tool_call>|$)", re.S)
_GLM_ARG = re.compile(r"<arg_key>\s*(.*?)\s*</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def glm45(text: str, tools: ToolSchemas) -> ParsedCalls:
    def call(m: re.Match[str]) -> tuple[str, str] | None:
        name = m.group(1)
        properties = (tools.get(name) or {}).get("properties") or {}
        args: dict[str, Any] = {}
        for key, raw in _GLM_ARG.findall(m.group(2)):
            declared = (properties.get(key) or {}).get("type")
            args[key] = raw
            if declared != "string":
                with contextlib.suppress(json.JSONDecodeError):
                    args[key] = json.loads(raw)
        return name, json.dumps(args, ensure_ascii=False)

    return _split(text, _GLM_CALL, call)


_OAI_CALL = re.compile(
    r"(?:<\|start\|>assistant)?<\|channel\|>\w+\s+to=functions\.([\w.\-]+)[^<]*(?:<\|constrain\|>\s*\w+\s*)?"
    r"<\|message\|>(.*?)(?:<\|call\|>|<\|end\|>|$)",
    re.S,
)
_OAI_FINAL = re.compile(r"<\|channel\|>final<\|message\|>(.*?)(?:<\|return\|>|<\|end\|>|$)", re.S)


def openai(text: str, tools: ToolSchemas) -> ParsedCalls:
    calls = [(name, args) for name, raw in _OAI_CALL.findall(text) if (args := _arguments(raw)) is not None]
    finals = _OAI_FINAL.findall(text)
    if finals:
        return _content(finals), calls
    if "<|channel|>" in text:  # harmony without a final message: only analysis / calls
        return None, calls
    return _content([text]), calls


PARSERS: dict[str, Callable[[str, ToolSchemas], ParsedCalls]] = {
    "hermes": hermes,
    "deepseek_v3": deepseek_v3,
    "glm45": glm45,
    "openai": openai,
}
