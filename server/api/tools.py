"""Tool calling on ``/v1/chat/completions``: ``tools``, ``tool_choice`` and ``parallel_tool_calls`` as OpenAI's API
takes them, answered as vLLM's server does.

- ``"required"`` and a named ``{"type": "function", "function": {"name": ...}}`` are enforced by a grammar, so the
  calls always name a declared tool and their arguments satisfy its ``parameters``, whatever the model: a named
  choice generates the arguments object itself; ``"required"`` a JSON array of ``{"name", "parameters"}`` objects
  (one or more; exactly one without ``parallel_tool_calls``).
- ``"auto"`` (the default when tools are given) lets the model answer freely and parses its own tool-call syntax
  with ``--tool-call-parser``; it needs ``--enable-auto-tool-choice``, as vLLM.
- ``"none"`` answers in text (the template still sees the tools).

A response with calls has ``message.tool_calls`` (``id``, ``type: "function"``, ``function.name``,
``function.arguments`` as JSON text), ``content`` None (or the text outside the calls, with ``auto``) and
``finish_reason: "tool_calls"``; an output cut by ``max_tokens`` stays text with ``finish_reason: "length"``.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any, Literal

from server.api.errors import APIError
from server.api.protocol import ChatCompletionRequest, NamedToolChoice
from server.api.state import ServingState
from server.api.tool_parsers import PARSERS
from server.engine_api import Tokenizer
from server.structured.compiler import check_json_schema
from server.structured.spec import GrammarError, GrammarSpec

NO_PARAMETERS = {"type": "object", "properties": {}}  # a tool without ``parameters`` takes none


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code="invalid_value")


@dataclasses.dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = dataclasses.field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_dict(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {} if index is None else {"index": index}
        out.update(id=self.id, type="function", function={"name": self.name, "arguments": self.arguments})
        return out


@dataclasses.dataclass
class ToolCalling:
    """How one chat request's output becomes tool calls. ``mode``: ``named`` (``name`` is the tool), ``required``
    or ``auto`` (``parser`` reads the model's syntax)."""

    mode: Literal["named", "required", "auto"]
    schemas: dict[str, dict[str, Any]]  # each declared tool's parameters schema
    parallel: bool
    tokenizer: Tokenizer
    name: str = ""
    parser: str | None = None

    def grammar(self) -> GrammarSpec | None:
        """The grammar enforcing ``named`` / ``required`` (None for ``auto``)."""
        if self.mode == "named":
            return GrammarSpec("json", json.dumps(self.schemas[self.name], sort_keys=True), "tool_choice")
        if self.mode == "required":
            items = [
                {
                    "type": "object",
                    "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
                    "required": ["name", "parameters"],
                }
                for name, schema in self.schemas.items()
            ]
            array = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
            if not self.parallel:
                array["maxItems"] = 1
            return GrammarSpec("json", json.dumps(array, sort_keys=True), "tool_choice")
        return None

    def message(self, text: str, token_ids: list[int], finish_reason: str | None) -> tuple[str | None, list[ToolCall]]:
        """The message's ``content`` and tool calls for a finished output (``text``, its ``token_ids``)."""
        if finish_reason != "stop":  # cut short (length, abort): the calls are incomplete
            return text, []
        if self.mode == "named":
            return None, [ToolCall(self.name, text)]
        if self.mode == "required":
            try:  # complete under the grammar, unless a stop string cut it
                calls = [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in json.loads(text)]
            except (json.JSONDecodeError, TypeError, KeyError):
                return text, []
            return None, calls
        ids = token_ids[:-1] if token_ids and token_ids[-1] in self.tokenizer.eos_token_ids else token_ids
        assert self.parser is not None
        content, found = PARSERS[self.parser](self.tokenizer.decode_with_special(ids), self.schemas)
        calls = [ToolCall(name, args) for name, args in found][: None if self.parallel else 1]
        return (content if calls else text), calls


# parsers whose calls start with a marker written as plain text: with them, "auto" streams the content up to it
STREAMED_MARKERS = {"hermes": "<tool_call>", "glm45": "<tool_call>"}


class ToolStream:
    """One streamed choice's tool calls, as OpenAI streams them: a call's first delta has its ``index``, ``id``,
    ``type`` and ``function.name``, later ones more ``function.arguments`` text. A named call streams its
    arguments as they are generated; ``required`` and ``auto`` calls are known once the output is complete, so they
    come in the last chunk. ``auto`` with ``hermes`` or ``glm45`` streams the content as it comes until the text
    could be a call's start marker (the rest follows at the end: more content when there was no call), with the
    other parsers all content comes at the end."""

    def __init__(self, calling: ToolCalling) -> None:
        self.calling = calling
        self._named: ToolCall | None = None
        self.made_calls = False
        self._marker = STREAMED_MARKERS.get(calling.parser or "") if calling.mode == "auto" else None
        self._final = 0  # characters of the text final so far (the pieces seen)
        self._emitted = 0  # characters of the text streamed as content
        self._held = False  # a call marker was seen: the rest waits for the end

    def feed(
        self, piece: str, text: str, token_ids: list[int], finish_reason: str | None
    ) -> tuple[str | None, list[dict[str, Any]] | None]:
        """The content and tool-call deltas for the next chunk, given its text ``piece`` and the output so far."""
        if self.calling.mode == "named":
            if not piece:
                return None, None
            if self._named is None:
                self._named = ToolCall(self.calling.name, piece)
                return None, [self._named.to_dict(0)]
            return None, [{"index": 0, "function": {"arguments": piece}}]
        self._final += len(piece)
        if finish_reason is None:
            return self._stream_content(text), None
        content, calls = self.calling.message(text, token_ids, finish_reason)
        self.made_calls = bool(calls)
        if self._emitted:  # content already streamed: the rest of it (none after a call's marker)
            content = None if calls else text[self._emitted :] or None
        return content, [c.to_dict(i) for i, c in enumerate(calls)] or None

    def _stream_content(self, text: str) -> str | None:
        marker = self._marker
        if marker is None or self._held:
            return None
        at = text.find(marker, self._emitted, self._final)
        if at >= 0:
            self._held = True
            safe = at
        else:  # hold back an end that could be the start of the marker
            tail = text[max(self._emitted, self._final - len(marker) + 1) : self._final]
            keep = next((len(tail) - i for i in range(len(tail)) if marker.startswith(tail[i:])), 0)
            safe = self._final - keep
        out, self._emitted = text[self._emitted : safe], max(self._emitted, safe)
        return out or None

    def finish_reason(self, finish_reason: str | None) -> str | None:
        called = self._named is not None if self.calling.mode == "named" else self.made_calls
        return "tool_calls" if called and finish_reason == "stop" else finish_reason


def tool_calling(req: ChatCompletionRequest, state: ServingState) -> ToolCalling | None:
    """The request's tool calling (None: it answers in text), its fields checked: a 400 naming the field for a bad
    ``parameters`` schema, a duplicate or unknown tool name, ``tool_choice`` without ``tools``, ``"auto"`` on a
    server started without ``--enable-auto-tool-choice``."""
    choice = req.tool_choice
    if not req.tools:
        if choice is not None and choice != "none":
            raise _bad("tool_choice", f"{_shown(choice)} needs tools (the request has none)")
        return None
    schemas: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(req.tools):
        name, param = tool.function.name, f"tools.{i}.function"
        if name in schemas:
            raise _bad(f"{param}.name", f"{name!r} is declared twice")
        parameters = NO_PARAMETERS if tool.function.parameters is None else tool.function.parameters
        try:
            check_json_schema(parameters, f"{param}.parameters")
        except GrammarError as e:
            raise APIError(400, str(e), param=e.param, code="invalid_value") from None
        schemas[name] = parameters
    if choice is None:
        choice = "auto"
    parallel, tokenizer = req.parallel_tool_calls, state.tokenizer
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in schemas:
            raise _bad(
                "tool_choice.function.name",
                f"{choice.function.name!r} is not a declared tool (declared: {sorted(schemas)})",
            )
        return ToolCalling("named", schemas, parallel, tokenizer, name=choice.function.name)
    if choice == "required":
        return ToolCalling("required", schemas, parallel, tokenizer)
    if choice == "auto":
        config = state.config
        if not config.enable_auto_tool_choice or config.tool_call_parser is None:
            raise _bad(
                "tool_choice",
                '"auto" needs a server started with --enable-auto-tool-choice and '
                '--tool-call-parser (or send "required", "none" or a named tool)',
            )
        return ToolCalling("auto", schemas, parallel, tokenizer, parser=config.tool_call_parser)
    return None


def _shown(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else f"the named tool {choice.function.name!r}"


def template_tools(req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools as the chat template sees them (OpenAI's shape, fields that are None left out)."""
    if not req.tools:
        return None
    return [tool.model_dump(by_alias=True, exclude_none=True) for tool in req.tools]
