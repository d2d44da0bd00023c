"""What a request asks its output to match, before compilation: plain Python, no grammar engine."""

from __future__ import annotations

import dataclasses
from typing import Literal

GrammarKind = Literal["json", "json_object", "regex", "choice", "grammar"]


class GrammarError(ValueError):
    """A schema, regex, choice list or grammar that cannot be compiled; ``param`` is the request field that holds
    it (the HTTP layer answers 400 naming it)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclasses.dataclass(frozen=True)
class GrammarSpec:
    """``kind`` and its ``source``: a JSON schema as JSON text (``json``), a regex (``regex``), a JSON list of
    strings (``choice``), an EBNF grammar (``grammar``), or '' (``json_object``: any JSON object). ``param`` names
    the request field it came from."""

    kind: GrammarKind
    source: str
    param: str

    @property
    def key(self) -> str:
        """Equal keys compile to equal grammars (the compile cache's key)."""
        return f"{self.kind}:{self.source}"
