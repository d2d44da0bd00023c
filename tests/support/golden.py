"""Greedy decoding against transformers: the prompts, transformers' cached greedy tokens and logits (the oracle),
ours through the paged cache of :mod:`tests.support.paged` in one batch, the comparison, and EP 2's rank function."""

from __future__ import annotations

import torch

from server.loader import load_model
from server.models.buffer_comm import BufferComm
from tests.support.paged import SlotCache

PROMPTS = [[5, 9, 17, 3, 44], [7, 8], [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110], [42]]
STEPS = 6
ATOL = 1e-4


@torch.no_grad()
def hf_cached_greedy(model, prompt: list[int], num_steps: int) -> tuple[list[int], list[torch.Tensor]]:  # noqa: ANN001
    """transformers' greedy decoding with its KV cache: tokens and each step's logits `[vocab]`."""
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens, logits = [], []
    for _ in range(num_steps):
        logits.append(out.logits[0, -1].float())
        tokens.append(int(logits[-1].argmax()))
        out = model(torch.tensor([[tokens[-1]]]), cache=out.past_key_values, use_cache=True)
    return tokens, logits


def run_greedy(model, prompt_ids: list[int], num_steps: int) -> list[tuple[list[int], list[list[float]]]]:  # noqa: ANN001
    """Prefill prompts ``prompt_ids`` (indices into PROMPTS) in one batch, then decode greedily in batches: per
    prompt its tokens and each step's logits (as lists, to cross process boundaries)."""
    prompts = [PROMPTS[i] for i in prompt_ids]
    cache = SlotCache(model, max(1, len(prompts)), 32)
    chunks = [(slot, 0, p) for slot, p in enumerate(prompts)]
    out: list[tuple[list[int], list[list[float]]]] = [([], []) for _ in prompts]
    for _ in range(num_steps):
        logits = cache.run(model, chunks, [True] * len(chunks))
        for j in range(len(prompts)):
            out[j][0].append(int(logits[j].argmax()))
            out[j][1].append(logits[j].tolist())
        chunks = [(slot, start + len(ids), [out[slot][0][-1]]) for slot, start, ids in chunks]
    return out


def check_close(name: str, prompt_index: int, ours: tuple[list[int], list], ref: tuple[list[int], list]) -> None:
    assert ours[0] == ref[0], (name, prompt_index)
    for step, (a, b) in enumerate(zip(ours[1], ref[1], strict=True)):
        torch.testing.assert_close(torch.tensor(a), b, atol=ATOL, rtol=0, msg=f"{name} prompt {prompt_index} {step}")


def ep2_rank(info, paths: dict[str, str]) -> dict[str, list]:  # noqa: ANN001
    """Rank r runs prompts r, r+2, ... of every checkpoint; returns {name: [(prompt index, (tokens, logits))]}."""
    out = {}
    mine = list(range(info.rank, len(PROMPTS), info.world_size))
    for name, path in paths.items():
        model = load_model(path, lambda cfg: BufferComm(info.group, cfg.num_experts, 16, cfg.hidden_size, "reference"))
        assert model.comm.num_local_experts == model.cfg.num_experts // 2
        out[name] = list(zip(mine, run_greedy(model, mine, STEPS), strict=True))
        model.comm.destroy()
    return out
