"""Incremental detokenization: the text built token by token equals one decode of the whole output (byte-level
tokenizer and a byte-level BPE ``tokenizer.json`` trained here, random ids including broken UTF-8), and a long output
is decoded in windows, not over and over (the decoded-token count grows linearly)."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from server.engine_api import Tokenizer
from server.runtime.scheduling.detokenizer import IncrementalDetokenizer
from server.tokenizer import ByteTokenizer, HFTokenizer

TEXTS = ["héllo wörld, ça va? 日本語のテキスト 🙂 " * 3, "the quick brown fox jumps over the lazy dog " * 5]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> HFTokenizer:  # noqa: ANN001
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<eos>"]
    )
    raw.train_from_iterator(TEXTS, trainer)
    path = tmp_path_factory.mktemp("bpe")
    raw.save(str(path / "tokenizer.json"))
    return HFTokenizer(str(path))


def incremental(tokenizer: Tokenizer, ids: Sequence[int]) -> str:
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add(t) for t in ids] + [detok.finish()]
    assert "".join(pieces) == detok.text
    return detok.text


@pytest.mark.parametrize("seed", range(5))
def test_incremental_text_equals_one_decode(bpe: HFTokenizer, seed: int) -> None:
    rng = random.Random(seed)
    byte = ByteTokenizer(eos_token_ids=[256])
    texts = [bpe.encode(t) for t in TEXTS] + [list(t.encode()) for t in TEXTS]
    cases: list[tuple[Tokenizer, list[int]]] = [
        (bpe, [rng.randrange(400) for _ in range(300)]),  # random ids: broken multi-byte characters included
        (byte, [rng.randrange(257) for _ in range(300)]),
        (bpe, texts[0] + texts[1]),
        (byte, texts[2]),
    ]
    for tokenizer, ids in cases:
        assert incremental(tokenizer, ids) == tokenizer.decode(ids)


class CountingTokenizer(ByteTokenizer):
    def __init__(self) -> None:
        super().__init__()
        self.decoded = 0

    def decode(self, token_ids: Sequence[int]) -> str:
        self.decoded += len(token_ids)
        return super().decode(token_ids)


def test_long_output_is_decoded_in_windows() -> None:
    tok = CountingTokenizer()
    ids = list(("añb日" * 1000).encode())  # 8000 tokens, multi-byte characters split across tokens
    assert incremental(tok, ids) == "añb日" * 1000
    assert tok.decoded < 10 * len(ids)  # a re-decode per token would be ~len(ids)**2 / 2 = 32 million
