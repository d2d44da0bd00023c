"""Structured output requests: which grammar a request's fields ask for, compiled off the engine loop.

The forms, as vLLM's OpenAI server takes them: ``response_format`` (``text``, ``json_object``, ``json_schema``),
vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``) and its older
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``. A request may use one of them (and
none with a tool choice that constrains the output). A bad schema, regex, choice list or grammar is a 400 naming
the field, before the request reaches the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

from server.api.errors import APIError
from server.api.protocol import SamplingFields
from server.api.state import ServingState
from server.engine_api import SamplingParams
from server.structured.spec import GrammarError, GrammarSpec


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code="invalid_value")


def _json_spec(schema: Any, param: str) -> GrammarSpec:
    """A schema given as an object, a boolean, or JSON text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise _bad(param, f"not valid JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(schema, (dict, bool)):
        raise _bad(param, f"a JSON schema must be an object, got {type(schema).__name__}")
    return GrammarSpec("json", json.dumps(schema, sort_keys=True), param)


def _choice_spec(choices: list[str], param: str) -> GrammarSpec:
    if not choices:
        raise _bad(param, "must list at least one string")
    return GrammarSpec("choice", json.dumps(choices), param)


def _text_spec(kind: str, text: str, param: str) -> GrammarSpec:
    if not text:
        raise _bad(param, "must not be empty")
    return GrammarSpec(kind, text, param)  # type: ignore[arg-type]


def requested_specs(req: SamplingFields) -> list[GrammarSpec]:
    """Every grammar the request's structured-output fields ask for (several is an error the caller reports)."""
    specs = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        specs.append(GrammarSpec("json_object", "", "response_format"))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.json_schema is None:
            raise _bad("response_format.json_schema.schema", "type 'json_schema' needs json_schema.schema")
        specs.append(_json_spec(rf.json_schema.json_schema, "response_format.json_schema.schema"))
    so = req.structured_outputs
    if so is not None:
        given = [name for name in ("json_schema", "regex", "choice", "grammar") if getattr(so, name) is not None]
        given += ["json_object"] if so.json_object else []
        if len(given) != 1:
            named = [{"json_schema": "json"}.get(g, g) for g in given]
            raise _bad(
                "structured_outputs",
                f"give exactly one of json, regex, choice, grammar, json_object; got {named or 'none'}",
            )
        specs.append(_one_spec(given[0], getattr(so, given[0]), "structured_outputs"))
    for name in ("json_schema", "regex", "choice", "grammar"):
        value = getattr(req, f"guided_{'json' if name == 'json_schema' else name}")
        if value is not None:
            specs.append(_one_spec(name, value, f"guided_{'json' if name == 'json_schema' else name}"))
    return specs


def _one_spec(name: str, value: Any, param: str) -> GrammarSpec:
    if name == "json_schema":
        return _json_spec(value, param if param.startswith("guided") else f"{param}.json")
    if name == "json_object":
        return GrammarSpec("json_object", "", f"{param}.json_object")
    if name == "choice":
        return _choice_spec(value, param if param.startswith("guided") else f"{param}.choice")
    return _text_spec(name, value, param if param.startswith("guided") else f"{param}.{name}")


def single_spec(specs: list[GrammarSpec]) -> GrammarSpec | None:
    """The one grammar a request asks for; a 400 when it asks for several."""
    if len(specs) > 1:
        raise _bad(specs[1].param, f"a request takes one structured output; {specs[0].param} is already given")
    return specs[0] if specs else None


async def constrain(
    params: list[SamplingParams], spec: GrammarSpec | None, state: ServingState
) -> list[SamplingParams]:
    """``params`` with ``spec`` compiled into them (in a thread: the event loop and the engine keep running)."""
    if spec is None:
        return params
    try:
        grammar, seconds = await asyncio.to_thread(state.grammars.compile, spec)
    except GrammarError as e:
        raise APIError(400, str(e), param=e.param, code="invalid_value") from None
    state.metrics.on_grammar(spec.kind, seconds)
    return [dataclasses.replace(p, grammar=grammar) for p in params]
