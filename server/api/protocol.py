"""OpenAI request models (``/v1/completions``, ``/v1/chat/completions``, vLLM's ``/tokenize`` and ``/detokenize``).

Values are validated strictly (no string-to-number coercion), so a bad type is a 400 naming the field. Fields this
server does not know are accepted and ignored, as vLLM does (:func:`unknown_fields` lists them for a warning).
Fields it knows but does not support (``functions``, ``best_of`` > ``n``, ...) are accepted at their defaults and
refused otherwise (:meth:`SamplingFields.unsupported`). Structured output (``response_format``, vLLM's
``structured_outputs`` and ``guided_*``) and tools are modelled here and turned into grammars by
:mod:`server.api.structured` and :mod:`server.api.tools`.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from server.engine_api import MAX_LOGPROBS

MAX_N = 128  # the most samples one request may ask for (OpenAI's limit for chat)


class Lenient(BaseModel):
    """Strict types; unknown fields kept in ``model_extra`` (then ignored)."""

    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(Lenient):
    include_usage: bool = False


class JsonSchemaFormat(Lenient):
    """``response_format.json_schema``: OpenAI's ``name``, ``description``, ``schema`` and ``strict``."""

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Lenient):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(Lenient):
    """vLLM's ``structured_outputs``: one of ``json`` (a schema), ``regex``, ``choice``, ``grammar`` (EBNF) or
    ``json_object``."""

    json_schema: dict[str, Any] | bool | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class FunctionDefinition(Lenient):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Lenient):
    """A function tool; its ``parameters`` is a JSON schema of the arguments (absent: no arguments)."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(Lenient):
    name: str


class NamedToolChoice(Lenient):
    type: Literal["function"] = "function"
    function: FunctionName


class SamplingFields(Lenient):
    """Fields shared by both endpoints: vLLM's sampling names plus OpenAI's ``n``, ``stream`` and ``user``. A null
    sampling value means its default."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int | None = Field(None, ge=1, le=MAX_N)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    user: str | None = None
    # known, supported only at these values (vLLM's defaults)
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # structured output (server.api.structured): OpenAI's, vLLM's, and vLLM's older spellings
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted and ignored: xgrammar serves every request
    # prefill/decode disaggregation (SGLang's fields; python -m server.router sets them)
    bootstrap_host: str | None = Field(None, min_length=1)
    bootstrap_port: int | None = Field(None, ge=1, le=65535)
    bootstrap_room: int | str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def num_samples(self) -> int:
        return self.n or 1

    def unsupported(self) -> tuple[str, str] | None:
        """``(field, why)`` for the first field set to a value this server does not support, else None."""
        if self.min_tokens:
            return "min_tokens", "only 0 is supported"
        if self.include_stop_str_in_output:
            return "include_stop_str_in_output", "only false is supported"
        if not self.skip_special_tokens:
            return "skip_special_tokens", "only true is supported"
        return None


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: ``prompt`` is a string, a list of token ids, or a batch of either (one choice per
    prompt and sample: ``index = prompt_index * n + sample_index``)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None
    tools: Any = None  # refused: tools need the chat endpoint
    tool_choice: Any = None

    def unsupported(self) -> tuple[str, str] | None:
        for name in ("tools", "tool_choice"):
            if getattr(self, name) is not None:
                return name, "tool calling needs /v1/chat/completions (a chat template renders the tools)"
        if self.best_of is not None and self.best_of != self.num_samples:
            return "best_of", f"only best_of == n ({self.num_samples}) is supported, got {self.best_of}"
        if self.suffix:
            return "suffix", "suffixes (insertion) are not supported"
        return super().unsupported()


class TextPart(Lenient):
    type: Literal["text"]
    text: str


class ChatMessage(Lenient):
    """One message; fields beyond these (``reasoning_content``, ``tool_calls``, ...) reach the chat template too
    (so they are not reported as unknown)."""

    extras_are_used: ClassVar[bool] = True

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template sees it: text parts joined by newlines (as vLLM does for templates
        that read ``content`` as a string), fields that are None left out, an assistant's tool-call ``arguments``
        given as JSON text turned into objects (as vLLM does: templates iterate over them)."""
        out = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            out["content"] = "\n".join(part.text for part in self.content)
        calls = out.get("tool_calls")
        if isinstance(calls, list):
            out["tool_calls"] = [_call_for_template(c) for c in calls]
        return out


def _call_for_template(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


class ChatTemplateFields(Lenient):
    """How ``messages`` become a prompt (vLLM's names): ``add_generation_prompt`` appends the assistant header;
    ``continue_final_message`` leaves the last message open instead; ``add_special_tokens`` adds the tokenizer's
    (e.g. BOS) around the rendered text (off: the template writes them); ``chat_template_kwargs`` are extra template
    variables (e.g. ``enable_thinking``). A per-request ``chat_template`` is refused (the server's is
    ``--chat-template``)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None


class ChatCompletionRequest(ChatTemplateFields, SamplingFields):
    """``POST /v1/chat/completions``; ``max_completion_tokens`` is OpenAI's newer name for ``max_tokens``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    functions: list[Any] | None = None
    function_call: Any = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.functions:
            return "functions", "the deprecated functions are not supported; send tools"
        if self.function_call not in (None, "none", "auto"):
            return "function_call", "the deprecated function_call is not supported; send tool_choice"
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "needs logprobs: true"
        if self.chat_template is not None:
            return "chat_template", "a per-request chat template is not accepted; start the server with --chat-template"
        return super().unsupported()


class TokenizeRequest(ChatTemplateFields):
    """vLLM's ``POST /tokenize``: ``prompt`` (text; ``add_special_tokens`` defaults to true) or ``messages`` (after
    the chat template, exactly as a chat request; ``add_special_tokens`` defaults to false)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # type: ignore[assignment]
    return_token_strs: bool = False


class DetokenizeRequest(Lenient):
    """vLLM's ``POST /detokenize``."""

    model: str | None = None
    tokens: list[int]


def unknown_fields(req: BaseModel, prefix: str = "") -> list[str]:
    """Paths of the fields of ``req`` (and of its nested requests) that no model declares, e.g. ``metadata`` or
    ``stream_options.foo`` (a message's extra fields go to the chat template: not unknown)."""
    found = [] if getattr(req, "extras_are_used", False) else [prefix + name for name in req.model_extra or {}]
    for name in type(req).model_fields:
        value = getattr(req, name)
        items = value if isinstance(value, list) else [value]
        for item in items:
            if isinstance(item, BaseModel):
                found += unknown_fields(item, f"{prefix}{name}{'[]' if isinstance(value, list) else ''}.")
    return list(dict.fromkeys(found))
