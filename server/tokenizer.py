"""Tokenizers: ``tokenizer.json`` through the ``tokenizers`` package when a checkpoint has one, else byte-level."""

from __future__ import annotations

import os
from collections.abc import Sequence

from .engine_api import Tokenizer


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255; ids >= 256 (special tokens such as EOS) decode to nothing. Needs no files."""

    def __init__(self, eos_token_ids: Sequence[int] = ()) -> None:
        self.eos_token_ids = list(eos_token_ids)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: Sequence[int]) -> str:
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")


class HFTokenizer(Tokenizer):
    """A checkpoint's ``tokenizer.json`` (no special tokens added on encode, skipped on decode)."""

    def __init__(self, path: str, eos_token_ids: Sequence[int] = ()) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        self._tok = _Tokenizer.from_file(path)
        self.eos_token_ids = list(eos_token_ids)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=True)


def load_tokenizer(model_path: str | None, eos_token_ids: Sequence[int]) -> Tokenizer:
    """``model_path/tokenizer.json`` if present, else :class:`ByteTokenizer`; EOS ids from the model config."""
    if model_path is not None:
        path = os.path.join(model_path, "tokenizer.json")
        if os.path.isfile(path):
            return HFTokenizer(path, eos_token_ids)
    return ByteTokenizer(eos_token_ids)
