"""Two-batch overlap (``server/models/two_batch.py``) against transformers: prefill chunks and greedy decode steps run
as two micro-batches give the logits of transformers' full-sequence forward within 1e-4 (fp32) and its greedy tokens;
in process on one rank (every expert local; Qwen3-MoE, DeepSeek-V3 with its shared expert and Mixtral), and over
``deep_ep_npu.Buffer`` at EP 2 and 4 (reference backend: each layer's two dispatches and two combines in flight as
the module doc orders them). Also the split itself and the merge of two grouped layouts."""

from __future__ import annotations

import pytest
import torch

from server import LLM, SamplingParams
from server.loader import load_model
from server.models import LocalComm, SeqInput
from server.models.buffer_comm import BufferComm
from server.models.two_batch import MIN_TOKENS, merge, micro_batches
from tests.support.checkpoints import hf_greedy, load_hf, make_checkpoint
from tests.support.distributed import parallel_launch
from tests.support.paged import SlotCache

PROMPTS = [[(7 * i + 3 * j) % 90 + 1 for j in range(1 + (5 * i) % 11)] for i in range(17)]  # 1-11 tokens each
STEPS = 3


def _decode(model, mine: list[int], total_tokens: list[int]) -> list[tuple[int, list[list[float]], list[int]]]:  # noqa: ANN001
    """Prefill prompts ``mine`` then decode greedily, every step as two micro-batches; ``total_tokens[s]``: step s's
    tokens over all ranks."""
    cache = SlotCache(model, max(1, len(mine)), 32)
    chunks = [(slot, 0, PROMPTS[i]) for slot, i in enumerate(mine)]
    logits_per, tokens_per = [[] for _ in mine], [[] for _ in mine]
    for step in range(STEPS):
        seqs = [SeqInput(cache.table(slot), start, tokens) for slot, start, tokens in chunks]
        batch = cache.batch(chunks, [True] * len(chunks))
        batch.micro = micro_batches(seqs, cache.cache.block_size, "cpu", total_tokens[step])
        assert batch.micro is not None
        logits = model(batch, cache.cache)
        for j in range(len(mine)):
            logits_per[j].append(logits[j].tolist())
            tokens_per[j].append(int(logits[j].argmax()))
        chunks = [(slot, chunks[slot][1] + len(chunks[slot][2]), [tokens_per[slot][-1]]) for slot in range(len(mine))]
    return [(i, logits_per[j], tokens_per[j]) for j, i in enumerate(mine)]


def _totals(ranks: list[list[int]]) -> list[int]:
    prefill = sum(len(PROMPTS[i]) for mine in ranks for i in mine)
    return [prefill] + [sum(map(len, ranks))] * (STEPS - 1)


def _rank(info, path: str) -> list:  # noqa: ANN001
    model = load_model(path, lambda cfg: BufferComm(info.group, cfg.num_experts, 64, cfg.hidden_size, "reference"))
    ranks = [list(range(r, len(PROMPTS), info.world_size)) for r in range(info.world_size)]
    out = _decode(model, ranks[info.rank], _totals(ranks))
    model.comm.destroy()
    return out


def _check(results: list, golden: list) -> None:
    seen = []
    for i, logits, tokens in results:
        seen.append(i)
        assert tokens == golden[i][0], i
        for ours, ref in zip(logits, golden[i][1], strict=True):
            torch.testing.assert_close(torch.tensor(ours), ref, atol=1e-4, rtol=0)
    assert sorted(seen) == list(range(len(PROMPTS)))


@pytest.fixture(scope="module")
def golden(tmp_path_factory):  # noqa: ANN001, ANN201
    out = {}
    for arch in ("qwen3_moe", "deepseek_v3", "mixtral"):
        path = make_checkpoint(arch, str(tmp_path_factory.mktemp(arch)))
        hf = load_hf(path)
        out[arch] = path, [hf_greedy(hf, p, STEPS) for p in PROMPTS]
    return out


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "mixtral"])
def test_two_micro_batches_match_transformers_in_process(arch: str, golden) -> None:  # noqa: ANN001
    path, expect = golden[arch]
    model = load_model(path, lambda cfg: LocalComm(cfg.num_experts, 64))
    everything = list(range(len(PROMPTS)))
    _check(_decode(model, everything, _totals([everything])), expect)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_two_micro_batches_match_transformers_at_ep(arch: str, golden) -> None:  # noqa: ANN001
    path, expect = golden[arch]
    for world_size in (2, 4):
        _check([r for per_rank in parallel_launch(world_size, _rank, path, timeout=120) for r in per_rank], expect)


def test_split_halves_the_tokens_and_needs_the_step_size() -> None:
    seqs = [SeqInput([0, 1, 2, 3], 0, [1] * n) for n in (5, 1, 1, 4)]
    assert micro_batches(seqs, 4, "cpu", MIN_TOKENS - 1) is None
    a, b = micro_batches(seqs, 4, "cpu", MIN_TOKENS)  # type: ignore[misc]
    assert (a.num_tokens, b.num_tokens) == (6, 5)
    one = micro_batches(seqs[:1], 4, "cpu", MIN_TOKENS)
    assert one is not None and (one[0].num_tokens, one[1].num_tokens) == (5, 0)
    none = micro_batches([], 4, "cpu", MIN_TOKENS)
    assert none is not None and (none[0].num_tokens, none[1].num_tokens) == (0, 0)


def test_merge_groups_each_experts_rows_of_both_parts() -> None:
    """Expert e's rows of the first part, then of the second; padding dropped; ``wheres`` take each part back."""
    a_rows, a_off = torch.tensor([[1.0], [2.0], [3.0], [-1.0]]), torch.tensor([2, 2, 3], dtype=torch.int32)
    b_rows, b_off = torch.tensor([[4.0], [5.0], [6.0], [-2.0], [-3.0]]), torch.tensor([0, 2, 3], dtype=torch.int32)
    rows, offsets, wheres = merge([(a_rows, a_off), (b_rows, b_off)], 7)
    assert offsets.tolist() == [2, 4, 6]
    assert rows[:6, 0].tolist() == [1.0, 2.0, 4.0, 5.0, 3.0, 6.0]
    assert torch.equal(rows[wheres[0][:3]], a_rows[:3]) and torch.equal(rows[wheres[1][:3]], b_rows[:3])


def test_engine_with_two_batch_overlap_gives_transformers_tokens(golden) -> None:  # noqa: ANN001
    """``two_batch_overlap=True`` through the engine (spawned workers; every step has >= 16 tokens over both
    workers: 17 requests, prefill in chunks of 16 per worker): transformers' greedy tokens."""
    path, expect = golden["qwen3_moe"]
    params = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True)
    engine = dict(max_num_seqs=16, max_num_batched_tokens=16, max_model_len=64)
    with LLM(model=path, ep_size=2, two_batch_overlap=True, **engine) as llm:
        outs = llm.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in outs] == [tokens for tokens, _ in expect]
