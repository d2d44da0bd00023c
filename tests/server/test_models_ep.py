"""Model golden tests at EP 2 and 4: every rank runs its own prompts (one rank none at all) through the MoE layers
over ``deep_ep_npu.Buffer`` (reference backend, fp32, ``use_fp8=False``); logits match transformers within 1e-4."""

from __future__ import annotations

import pytest
import torch

from server.loader import load_model
from server.models.buffer_comm import BufferComm
from tests.support.checkpoints import hf_greedy, load_hf, make_checkpoint
from tests.support.distributed import parallel_launch
from tests.support.paged import SlotCache

PROMPTS = [[5, 9, 17, 3, 44], [7, 8], [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110]]
STEPS = 4


def _rank(info, path: str) -> list[tuple[int, list[list[float]], list[int]]]:  # noqa: ANN001
    """Rank r prefills prompts r, r+W, ... then decodes greedily; returns (prompt index, logits, tokens)."""
    model = load_model(path, lambda cfg: BufferComm(info.group, cfg.num_experts, 16, cfg.hidden_size, "reference"))
    mine = list(range(info.rank, len(PROMPTS), info.world_size))
    cache = SlotCache(model, max(1, len(mine)), 32)
    chunks = [(slot, 0, PROMPTS[i]) for slot, i in enumerate(mine)]
    logits_per, tokens_per = [[] for _ in mine], [[] for _ in mine]
    for _ in range(STEPS):
        logits = cache.run(model, chunks, [True] * len(chunks))
        for j in range(len(mine)):
            logits_per[j].append(logits[j].tolist())  # plain lists: tensors do not survive the result queue
            tokens_per[j].append(int(logits[j].argmax()))
        chunks = [(slot, chunks[slot][1] + len(chunks[slot][2]), [tokens_per[slot][-1]]) for slot in range(len(mine))]
    model.comm.destroy()
    return [(i, logits_per[j], tokens_per[j]) for j, i in enumerate(mine)]


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "mixtral"])
def test_ep_logits_match_transformers(arch: str, tmp_path) -> None:  # noqa: ANN001
    path = make_checkpoint(arch, str(tmp_path / arch))
    hf = load_hf(path)
    golden = [hf_greedy(hf, p, STEPS) for p in PROMPTS]
    for world_size in (2, 4):
        seen = []
        for per_rank in parallel_launch(world_size, _rank, path, timeout=120):
            for i, logits, tokens in per_rank:
                seen.append(i)
                assert tokens == golden[i][0], (world_size, i)
                for ours, ref in zip(logits, golden[i][1], strict=True):
                    torch.testing.assert_close(torch.tensor(ours), ref, atol=1e-4, rtol=0)
        assert sorted(seen) == list(range(len(PROMPTS)))
