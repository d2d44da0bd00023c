"""Tokenizers: a checkpoint's ``tokenizer.json`` through the ``tokenizers`` package, else byte-level.

:class:`HFTokenizer` encodes as transformers 5 does: special tokens (BOS) are added by ``tokenizer.json``'s
post-processor when asked for (completions) and never for a rendered chat, whose template writes them itself.
With a ``tokenizer.json``, transformers 5 ignores ``add_bos_token`` / ``add_eos_token`` of ``tokenizer_config.json``
(the post-processor saved with them is the truth); where the two disagree a warning says so at start-up. The named
special tokens (``bos_token``, ...) come from ``tokenizer_config.json`` (strings or ``AddedToken`` objects), else
``special_tokens_map.json``; the chat template from :func:`server.chat_template.checkpoint_template`.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from typing import Any

from .chat_template import BUILTIN_CHAT_TEMPLATE, checkpoint_template
from .engine_api import Tokenizer

logger = logging.getLogger("server.tokenizer")
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255; ids >= 256 (special tokens such as EOS) decode to nothing. Needs no files. Its
    chat template is :data:`~server.chat_template.BUILTIN_CHAT_TEMPLATE` (``role: content`` lines, then
    ``assistant:``)."""

    chat_template = BUILTIN_CHAT_TEMPLATE

    def __init__(self, eos_token_ids: Sequence[int] = ()) -> None:
        self.eos_token_ids = list(eos_token_ids)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: Sequence[int]) -> str:
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_text(value: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string or an ``AddedToken`` dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer(Tokenizer):
    """The ``tokenizer.json`` of checkpoint ``model_path`` (special tokens skipped on decode); EOS ids are the
    model's ``eos_token_ids`` plus the tokenizer's ``eos_token``."""

    def __init__(self, model_path: str, eos_token_ids: Sequence[int] = ()) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        self._tok = _Tokenizer.from_file(os.path.join(model_path, "tokenizer.json"))
        config = _read_json(os.path.join(model_path, "tokenizer_config.json"))
        legacy = _read_json(os.path.join(model_path, "special_tokens_map.json"))
        named = {name: _token_text(config.get(name, legacy.get(name))) for name in SPECIAL_TOKEN_NAMES}
        self.special_tokens = {name: text for name, text in named.items() if text is not None}
        bos, eos = self.special_tokens.get("bos_token"), self.special_tokens.get("eos_token")
        self.bos_token_id = None if bos is None else self._tok.token_to_id(bos)
        eos_id = None if eos is None else self._tok.token_to_id(eos)
        self.eos_token_ids = list(dict.fromkeys([*eos_token_ids, *([] if eos_id is None else [eos_id])]))
        self.chat_template = checkpoint_template(model_path, config)
        self._warn_if_flags_disagree(config)

    def _warn_if_flags_disagree(self, config: dict[str, Any]) -> None:
        """Warn where ``add_bos_token`` / ``add_eos_token`` disagree with what the post-processor adds."""
        added = self._tok.encode("", add_special_tokens=True).ids
        for flag, name, position in (("add_bos_token", "bos_token", 0), ("add_eos_token", "eos_token", -1)):
            token = self.special_tokens.get(name)
            if flag not in config or token is None:
                continue
            adds = bool(added) and added[position] == self._tok.token_to_id(token)
            if bool(config[flag]) != adds:
                logger.warning(
                    "tokenizer_config.json says %s=%s but tokenizer.json's post-processor %s %s; "
                    "following tokenizer.json, as transformers 5 does",
                    flag,
                    config[flag],
                    "adds" if adds else "does not add",
                    token,
                )

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=True)

    def decode_with_special(self, token_ids: Sequence[int]) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=False)

    @property
    def backend(self) -> Any:
        """The ``tokenizers.Tokenizer`` read from ``tokenizer.json``."""
        return self._tok


# Files of tokenizers this server cannot read without a tokenizer.json (sentencepiece, tiktoken, slow BPE / WordPiece).
OTHER_TOKENIZER_FILES = (
    "tokenizer.model",
    "tiktoken.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer_config.json",
)


def load_tokenizer(model_path: str | None, eos_token_ids: Sequence[int]) -> Tokenizer:
    """``model_path/tokenizer.json`` if present; :class:`ByteTokenizer` for random models and checkpoints that ship
    no tokenizer; EOS ids from the model config. A checkpoint whose tokenizer exists only in another form is refused
    (byte-level ids would be meaningless to it)."""
    if model_path is None:
        return ByteTokenizer(eos_token_ids)
    if os.path.isfile(os.path.join(model_path, "tokenizer.json")):
        return HFTokenizer(model_path, eos_token_ids)
    other = [f for f in OTHER_TOKENIZER_FILES if os.path.isfile(os.path.join(model_path, f))]
    if other:
        raise ValueError(
            f"model={model_path!r} ships a tokenizer as {other} but no tokenizer.json, the only form "
            "this server reads; write one next to it with transformers: AutoTokenizer.from_pretrained("
            "path).save_pretrained(path)"
        )
    return ByteTokenizer(eos_token_ids)
