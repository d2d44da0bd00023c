"""The served tokenizer's vocabulary as xgrammar sees it, and the tokens a JSON grammar must never allow.

A ``tokenizer.json`` gives the tokens in their encoded form with the vocabulary type xgrammar detects from the file
(byte-level, byte-fallback or raw); its special tokens (``"special": true``) are given as empty strings, so a grammar
never allows them (they are not text). A byte-level tokenizer (random models) is ids 0..255 as bytes, the rest
special. Ids up to the model's ``vocab_size`` (padded vocabularies) count as special too.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import torch

from ..engine_api import Tokenizer

if TYPE_CHECKING:
    import xgrammar


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int) -> xgrammar.TokenizerInfo:
    """The ``xgrammar.TokenizerInfo`` of ``tokenizer`` for a model of ``vocab_size`` logits; its stop tokens are
    the tokenizer's EOS ids."""
    import xgrammar as xgr

    backend = getattr(tokenizer, "backend", None)
    stop = [t for t in tokenizer.eos_token_ids if t < vocab_size]
    if backend is None:
        vocab: list[bytes] = [bytes([i]) for i in range(min(256, vocab_size))]
        vocab += [b""] * (vocab_size - len(vocab))
        return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop)
    encoded = [""] * max(vocab_size, backend.get_vocab_size(with_added_tokens=True))
    for token, i in backend.get_vocab(with_added_tokens=True).items():
        encoded[i] = token
    for added in json.loads(backend.to_str()).get("added_tokens", []):
        if added.get("special") and added["id"] < len(encoded):
            encoded[added["id"]] = ""
    metadata = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
    return xgr.TokenizerInfo(
        encoded[:vocab_size],
        metadata["vocab_type"],
        vocab_size=vocab_size,
        stop_token_ids=stop,
        add_prefix_space=metadata["add_prefix_space"],
    )


def no_control_mask(info: xgrammar.TokenizerInfo) -> torch.Tensor:
    """`[ceil(vocab_size / 32)]` with `torch.int32`: xgrammar's bitmask layout, with the bit of every token whose
    text holds a raw control character (U+0000..U+001F) cleared (stop tokens kept). JSON never needs one (they are
    escaped in strings; whitespace between values is off), and xgrammar lets them into length-bounded strings,
    which ``json.loads`` then refuses: AND-ing this into a JSON grammar's bitmask keeps every output parseable."""
    import xgrammar as xgr

    mask = xgr.allocate_token_bitmask(1, info.vocab_size)[0]
    stop = set(info.stop_token_ids)
    for i, text in enumerate(info.decoded_vocab):
        if i not in stop and any(b < 0x20 for b in text):
            mask[i // 32] &= ~(1 << (i % 32))
    return mask
