"""Chat templates rendered as transformers renders them
(https://github.com/huggingface/transformers/blob/v5.24.0/src/transformers/utils/chat_template_utils.py).

Where a checkpoint's template is (:func:`checkpoint_template`): ``chat_template.jinja`` (plus named
``additional_chat_templates/<name>.jinja``) wins over ``tokenizer_config.json``'s ``chat_template`` (a string, or a
list of ``{"name", "template"}``); with several, ``default`` is used. ``--chat-template`` (:func:`read_override`)
replaces it: a file, or the template itself (a value holding ``{``, ``}`` or a newline, as vLLM decides).

:class:`ChatTemplate` renders with jinja2's immutable sandbox and transformers' settings: ``trim_blocks``,
``lstrip_blocks``, ``loopcontrols``, a pass-through ``{% generation %}`` tag, ``tojson`` without HTML escaping,
``raise_exception``, ``strftime_now`` and guarded ``dict`` / ``namespace``; variables ``messages`` (keys whose value
is None dropped, reasoning under both ``reasoning_content`` and ``thinking``), ``tools`` and ``documents`` (None),
``add_generation_prompt``, the tokenizer's named special tokens (``bos_token``, ``eos_token``, ...) and the
request's ``chat_template_kwargs`` that the template reads. A template's own error (``raise_exception``, a bad role
order) is a :class:`ChatTemplateError`, which the HTTP layer answers with 400.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .engine_api import Tokenizer

# The byte-level tokenizer's template (random models, checkpoints without a tokenizer): the tools as one JSON line
# when there are any, one "role: content" line per message (an assistant's tool calls as JSON after its content),
# then "assistant:" when a generation prompt is asked for.
BUILTIN_CHAT_TEMPLATE = (
    "{% if tools %}tools: {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% if m.tool_calls %}{{ m.tool_calls | tojson }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
# Variables the server sets; chat_template_kwargs may not set them.
RESERVED = ("messages", "tools", "documents", "add_generation_prompt", "chat_template", "tokenize")
_REASONING = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered (the template's ``raise_exception``, bad arguments); ``param`` is the
    request field at fault."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def checkpoint_template(model_path: str, tokenizer_config: Mapping[str, Any]) -> str | dict[str, str] | None:
    """The chat template(s) a checkpoint ships: a string, ``{name: template}``, or None."""
    templates: dict[str, str] = {}
    default = os.path.join(model_path, "chat_template.jinja")
    if os.path.isfile(default):
        with open(default, encoding="utf-8") as f:
            templates["default"] = f.read()
    extra = os.path.join(model_path, "additional_chat_templates")
    if os.path.isdir(extra):
        for name in sorted(os.listdir(extra)):
            if name.endswith(".jinja"):
                with open(os.path.join(extra, name), encoding="utf-8") as f:
                    templates[name.removesuffix(".jinja")] = f.read()
    if templates:
        return templates["default"] if list(templates) == ["default"] else templates
    value = tokenizer_config.get("chat_template")
    if isinstance(value, list):
        return {item["name"]: item["template"] for item in value}
    return value if isinstance(value, str) else None


def read_override(value: str) -> str:
    """``--chat-template``: the template itself when it holds ``{``, ``}`` or a newline, else a file to read."""
    if any(c in value for c in "{}\n"):
        return value
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{value!r} is neither a Jinja template nor a readable file ({e.strerror})") from None


def _environment() -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` renders its body (transformers marks assistant tokens)."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """``namespace()`` that refuses underscore-prefixed attributes (no way to CPython internals)."""

        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} starts with an underscore")

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
    ) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals.update(
        raise_exception=raise_exception,
        strftime_now=lambda fmt: datetime.now().strftime(fmt),
        dict=lambda *a, **k: dict(*a, **k),
        namespace=Namespace,
    )
    return env


def _message(message: Mapping[str, Any]) -> dict[str, Any]:
    """As transformers normalises a message: keys whose value is None dropped, reasoning aliased."""
    out = {k: v for k, v in message.items() if v is not None}
    reasoning = next((out[k] for k in _REASONING if k in out), None)
    return out if reasoning is None else {"thinking": reasoning, **out, "reasoning_content": reasoning}


class ChatTemplate:
    """One compiled chat template (``source`` a template, or ``{name: template}`` of which ``default`` is used);
    ``origin`` names where it came from, for errors. Raises ValueError if it does not compile."""

    def __init__(self, source: str | Mapping[str, str], origin: str) -> None:
        import jinja2
        import jinja2.meta

        if not isinstance(source, str):
            if "default" not in source:
                raise ValueError(
                    f"{origin}: several chat templates {sorted(source)} and none named 'default'; "
                    "choose one with --chat-template"
                )
            source = source["default"]
        env = _environment()
        try:
            self._template = env.from_string(source)
            self.variables = jinja2.meta.find_undeclared_variables(env.parse(source))
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ValueError(f"{origin}: the chat template is not valid Jinja (line {e.lineno}: {e.message})") from None
        self.source, self.origin = source, origin

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        special_tokens: Mapping[str, str],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The prompt text of ``messages``. ``continue_final_message`` leaves the last message open (transformers'
        marker method); ``kwargs`` are the request's ``chat_template_kwargs`` (those the template does not read are
        dropped, as vLLM does); ``tools``: the request's tools in OpenAI's shape (None: none)."""
        import jinja2

        chat = [_message(m) for m in messages]
        kwargs = dict(kwargs or {})
        clash = sorted(set(kwargs) & set(RESERVED))
        if clash:
            raise ChatTemplateError("chat_template_kwargs", f"{clash} are set by the server, not by the request")
        if continue_final_message:
            if add_generation_prompt:
                raise ChatTemplateError("continue_final_message", "cannot be combined with add_generation_prompt")
            last = chat[-1].get("content")
            if not isinstance(last, str):
                raise ChatTemplateError("continue_final_message", "the last message has no text content to continue")
            chat[-1] = {**chat[-1], "content": last + _CONTINUE_TAG}
        variables = {**special_tokens, **{k: v for k, v in kwargs.items() if k in self.variables}}
        try:
            text = self._template.render(
                messages=chat,
                tools=list(tools) if tools else None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError("messages", f"the chat template refused the conversation: {e}") from None
        if continue_final_message:
            if _CONTINUE_TAG.strip() not in text:
                raise ChatTemplateError("continue_final_message", "the chat template drops the last message's text")
            cut = text.rindex(_CONTINUE_TAG.strip())
            text = text[:cut] if text[cut : cut + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:cut].rstrip()
        return text


def serving_template(override: str | None, tokenizer: Tokenizer) -> tuple[ChatTemplate | None, str]:
    """The template chat requests use (``override``: ``--chat-template``, else the tokenizer's) and, when there is
    none, why: the one line a chat request is refused with."""
    if override is not None:
        return ChatTemplate(read_override(override), "--chat-template"), ""
    if tokenizer.chat_template is None:
        return None, (
            "chat_template: this model's tokenizer has no chat template (no chat_template.jinja, no "
            "chat_template in tokenizer_config.json), so chat requests cannot be formatted; use "
            "/v1/completions, or start the server with --chat-template (a Jinja file or a template)"
        )
    builtin = tokenizer.chat_template == BUILTIN_CHAT_TEMPLATE
    try:
        origin = "the byte-level tokenizer's built-in template" if builtin else "the checkpoint's chat template"
        return ChatTemplate(tokenizer.chat_template, origin), ""
    except ValueError as e:
        return None, f"chat_template: {e}; start the server with --chat-template to replace it"
