"""The transformers side of ``bench_decode.py``: the checkpoint both engines load, transformers' ``generate`` as the
baseline, and the weights-read floor of a decode step.

- :func:`make_checkpoint`: a random Qwen3-MoE built with transformers (its own init, seeded) and saved with
  ``save_pretrained`` in the benchmark's dtype; our engine serves the same directory.
- :class:`HFDecode`: greedy ``generate`` of a batch of prompts for a given number of new tokens (``min_new_tokens``
  = ``max_new_tokens``, so every run decodes exactly that many), timed per step through a streamer.
- :meth:`HFDecode.floor_ms`: the time to read, once, every weight a decode step of ``batch`` tokens reads: the
  dense weights (attention, norms, routers, LM head; the embedding rows are negligible) and, per MoE layer, the
  experts its tokens were routed to. The routing is recorded from transformers' own routers during a greedy decode
  of the same shape, step by step; each recorded step's weights are then read (one ``amax`` over an ``int16`` view
  per tensor, the fastest read found here) in turn, so successive steps read different experts, as a real decode
  does. Median over the recorded steps.
"""

from __future__ import annotations

import statistics
import time

import torch


def make_checkpoint(path: str, dtype: torch.dtype, seed: int, **sizes: int) -> None:
    """Save a random Qwen3-MoE of ``sizes`` (HF config fields) to ``path``."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(norm_topk_prob=True, max_position_embeddings=4096, **sizes)
    Qwen3MoeForCausalLM(cfg).to(dtype).save_pretrained(path)


def prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``batch`` random prompts of ``length`` token ids (a fresh seed per run: no prefix-cache hits between runs)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (batch, length), generator=g).tolist()


class HFDecode:
    """The checkpoint at ``path`` in transformers (``torch.get_num_threads()`` threads, this process)."""

    def __init__(self, path: str, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()

    @torch.inference_mode()
    def step_times(self, token_ids: list[list[int]], num_new: int) -> list[float]:
        """Greedy ``generate`` of ``num_new`` tokens after each prompt of ``token_ids``; returns the times (seconds,
        ``time.perf_counter``) at which each step's new tokens came out (the first: after the prefill)."""
        ids = torch.tensor(token_ids)
        clock = _Clock()
        self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_new, min_new_tokens=num_new,
                            do_sample=False, pad_token_id=0, streamer=clock)  # fmt: skip
        return clock.times[1:]  # the first put() is the prompt

    @torch.inference_mode()
    def floor_ms(self, token_ids: list[list[int]], num_steps: int) -> tuple[float, float]:
        """The median time (ms) and size (bytes) of one read of a decode step's weights (see the module doc)."""
        layers = self.model.model.layers
        routed: list[list[torch.Tensor]] = []  # per router call: the experts chosen by its tokens
        batch = len(token_ids)

        def record(module, inputs, output) -> None:  # noqa: ANN001
            if output[2].shape[0] == batch:  # a decode step (the prefill's call has batch * prompt rows)
                routed.append(output[2].unique())

        hooks = [layer.mlp.gate.register_forward_hook(record) for layer in layers]
        try:
            self.step_times(token_ids, num_steps + 1)
        finally:
            for h in hooks:
                h.remove()
        dense = [p for n, p in self.model.named_parameters() if ".experts." not in n and "embed_tokens" not in n]
        steps = [routed[i : i + len(layers)] for i in range(0, len(routed), len(layers))]
        times, sizes = [], []
        for step in steps:
            tensors = list(dense)
            for layer, experts in zip(layers, step, strict=True):
                for e in experts.tolist():
                    tensors += [layer.mlp.experts.gate_up_proj[e], layer.mlp.experts.down_proj[e]]
            t0 = time.perf_counter()
            for t in tensors:
                t.view(torch.int16).amax()
            times.append(time.perf_counter() - t0)
            sizes.append(sum(t.numel() * t.element_size() for t in tensors))
        return statistics.median(times) * 1e3, statistics.median(sizes)


class _Clock:
    """A transformers streamer that records when each ``put()`` (the prompt, then each step's tokens) happens."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass
