"""Compiling a :class:`~.spec.GrammarSpec` for the served tokenizer, with a cache per grammar (driver side).

Called from the HTTP layer in a thread (never on the engine loop: a slow schema delays only its own request).
xgrammar's compiler keeps its own cache of compiled grammars; this one keeps their serialized form, so a repeated
schema costs a dictionary look-up. JSON schemas are checked against their meta-schema first (``jsonschema``), so a
malformed one is refused with the schema validator's message. JSON output is compact (no whitespace beyond the
single spaces after ``,`` and ``:``): vLLM's ``disable_any_whitespace``, without which a model can emit whitespace
forever instead of finishing the value.
"""

from __future__ import annotations

import collections
import json
import re
import threading
import time
from typing import TYPE_CHECKING, Any

from ..engine_api import CompiledGrammar, Tokenizer
from .spec import GrammarError, GrammarSpec
from .vocab import tokenizer_info

if TYPE_CHECKING:
    import xgrammar

_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")  # xgrammar's "[time] file.cc:line: "
CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped first)


def check_json_schema(schema: Any, param: str) -> None:
    """A 400-worthy :class:`GrammarError` unless ``schema`` is a valid JSON schema (object or boolean)."""
    import jsonschema

    if not isinstance(schema, (dict, bool)):
        raise GrammarError(param, f"a JSON schema must be an object, got {type(schema).__name__}")
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        raise GrammarError(param, f"not a valid JSON schema{f' at {where!r}' if where else ''}: {e.message}") from None


class GrammarCache:
    """Compiles grammars for ``tokenizer`` and a model of ``vocab_size`` logits; thread-safe."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_threads: int = 2) -> None:
        self.tokenizer, self.vocab_size, self.max_threads = tokenizer, vocab_size, max_threads
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._has_stop = False
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[str, CompiledGrammar] = collections.OrderedDict()

    def compile(self, spec: GrammarSpec) -> tuple[CompiledGrammar, float]:
        """The compiled grammar of ``spec`` and the seconds compiling it took (0 when it was cached). Raises
        :class:`GrammarError` naming ``spec.param`` when it does not compile."""
        with self._lock:
            hit = self._cache.get(spec.key)
            if hit is not None:
                self._cache.move_to_end(spec.key)
                return hit, 0.0
            if self._compiler is None:
                import xgrammar as xgr

                info = tokenizer_info(self.tokenizer, self.vocab_size)
                self._compiler = xgr.GrammarCompiler(info, max_threads=self.max_threads)
                self._has_stop = bool(info.stop_token_ids)
        if not self._has_stop:
            raise GrammarError(
                spec.param,
                f"this model has no EOS token in its vocabulary (EOS ids "
                f"{self.tokenizer.eos_token_ids}, vocab_size {self.vocab_size}), so a constrained "
                "output could not end",
            )
        start = time.perf_counter()
        compiled = CompiledGrammar(spec.key, self._compile(spec).serialize_json(), spec.kind in ("json", "json_object"))
        seconds = time.perf_counter() - start
        with self._lock:
            self._cache[spec.key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled, seconds

    def _compile(self, spec: GrammarSpec) -> xgrammar.CompiledGrammar:
        c = self._compiler
        assert c is not None
        try:
            if spec.kind == "json":
                schema = json.loads(spec.source)
                check_json_schema(schema, spec.param)
                return c.compile_json_schema(spec.source, any_whitespace=False)
            if spec.kind == "json_object":
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            if spec.kind == "regex":
                return c.compile_regex(spec.source)
            if spec.kind == "choice":
                choices = json.loads(spec.source)
                return c.compile_grammar("root ::= " + " | ".join(json.dumps(s, ensure_ascii=False) for s in choices))
            return c.compile_grammar(spec.source)
        except GrammarError:
            raise
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's errors: the first line says what is wrong
            lines = [line for line in str(e).splitlines() if line.strip()]
            why = _SOURCE_PREFIX.sub("", lines[0]) if lines else type(e).__name__
            raise GrammarError(spec.param, f"cannot compile this {_NAMES[spec.kind]}: {why}") from None


_NAMES = {
    "json": "JSON schema",
    "json_object": "JSON object grammar",
    "regex": "regex",
    "choice": "choice list",
    "grammar": "EBNF grammar",
}
