"""The routed MoE block: router -> ``dispatch`` -> this rank's experts on the grouped layout -> ``combine``
(+ shared experts, computed while the combine is in flight).

Where they can, bf16 experts on the CPU run as :func:`deep_ep_npu.kernels.expert_mm.expert_mm`, at most
``ROWS_PER_EXPERT`` rows per local expert on average (decode): it reads each expert's weights once, in one
sequential stream per thread, ~2-3x faster than torch's matmuls there (benchmarks/bench_decode.py); above that
(prefill) torch's are faster. Otherwise the experts run as one grouped matmul per projection
(``torch._grouped_mm``): no loop over experts and no count read back on the host. Where that is not the fastest, or
not there, they loop over the experts with rows after one read of the offsets: on the CPU when the step has at most
one row per local expert on average (a one-row product runs as ``torch.mv``, which reads the weights ~1.4x faster
than the grouped matmul there), on devices other than CUDA (bf16), and for int8 experts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from deep_ep_npu.kernels.expert_mm import MATMUL_ROWS, ROWS_PER_EXPERT, expert_mm

from .config import ModelConfig
from .ep_comm import ExpertComm
from .layers import DenseMLP
from .quant import Int8Linear


class Router(nn.Module):
    """Top-k routing with the exact semantics of the HF class (each family's ``modeling_*.py`` in transformers 5.24).

    softmax (Qwen2/3-MoE, OLMoE, Mixtral): fp32 softmax -> top-k -> renormalise iff ``norm_topk_prob``.
    sigmoid (DeepSeek-V3, GLM-4.5): sigmoid -> + ``e_score_correction_bias`` (selection only) -> best ``topk_group`` of
    ``n_group`` groups by the sum of each group's top-2 -> top-k -> unbiased scores, renormalised iff
    ``norm_topk_prob`` (+1e-20) -> x ``routed_scaling_factor``.
    topk_softmax (gpt-oss): logits with the router's bias -> top-k -> softmax over the k kept logits.
    The router's parameters are kept in fp32. ``routing_skew`` s > 0 (load tests only, it changes the model):
    each token's top-k experts are drawn without replacement with probability proportional to ``(e + 1) ** -s``
    (Zipf; seeded, so runs repeat), weighted by their softmax probabilities renormalised.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        if cfg.router_bias:
            self.bias = nn.Parameter(torch.empty(cfg.num_experts))
        if cfg.scoring == "sigmoid":
            self.e_score_correction_bias: torch.Tensor
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts))
        self._skew: torch.Generator | None = None

    def _zipf(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``routing_skew`` top-k (see the class doc) for ``logits`` `[num_tokens, E]` fp32."""
        cfg = self.cfg
        if self._skew is None:
            self._skew = torch.Generator(logits.device).manual_seed(1234)
        log_p = -cfg.routing_skew * torch.log(torch.arange(1, cfg.num_experts + 1, device=logits.device).float())
        u = torch.rand(logits.shape, generator=self._skew, device=logits.device).clamp_(min=1e-20)
        idx = torch.topk(log_p - torch.log(-torch.log(u)), cfg.num_experts_per_tok, dim=-1).indices  # Gumbel top-k
        weights = torch.softmax(logits, dim=-1).gather(1, idx)
        return idx, weights / weights.sum(dim=-1, keepdim=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` `[num_tokens, hidden]` -> topk_idx `[num_tokens, k]` `torch.int64`, topk_weights `torch.float32`."""
        cfg = self.cfg
        logits = F.linear(x.float(), self.weight.float(), self.bias.float() if self.cfg.router_bias else None)
        if cfg.routing_skew > 0:
            return self._zipf(logits)
        if cfg.scoring == "topk_softmax":
            top, idx = torch.topk(logits, cfg.num_experts_per_tok, dim=-1)
            return idx, torch.softmax(top, dim=-1)
        if cfg.scoring == "softmax":
            probs = torch.softmax(logits, dim=-1)
            weights, idx = torch.topk(probs, cfg.num_experts_per_tok, dim=-1)
            if cfg.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return idx, weights
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias
        t, per_group = x.shape[0], cfg.num_experts // cfg.n_group
        group_scores = choice.view(t, cfg.n_group, per_group).topk(min(2, per_group), dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=cfg.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
        keep = group_mask[:, :, None].expand(t, cfg.n_group, per_group).reshape(t, cfg.num_experts).bool()
        idx = torch.topk(choice.masked_fill(~keep, float("-inf")), k=cfg.num_experts_per_tok, dim=-1, sorted=False)[1]
        weights = scores.gather(1, idx)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return idx, weights * cfg.routed_scaling_factor


def fused_refusal(cfg: ModelConfig) -> str:
    """Why ``moe_impl='fused'`` cannot run ``cfg``'s experts, or "" (the engine asks before it starts a worker)."""
    if cfg.expert_bias or cfg.swiglu_limit is not None:
        return (
            f"moe_impl='fused' (Buffer.mega_moe) runs plain SwiGLU experts without biases; {cfg.architecture}'s "
            "experts need the unfused path (moe_impl='unfused')"
        )
    return ""


def use_grouped_mm(recv_rows: torch.Tensor, num_experts: int) -> bool:
    """Whether the grouped matmuls run ``recv_rows`` `[num_rows, hidden]` (see the module doc): CUDA with bf16, or
    the CPU with more rows than experts."""
    if recv_rows.device.type == "cuda":
        return recv_rows.dtype == torch.bfloat16
    return recv_rows.device.type == "cpu" and recv_rows.shape[0] > num_experts


def per_expert(
    x: torch.Tensor, offsets: torch.Tensor, fn: Callable[[int, torch.Tensor, torch.Tensor], None]
) -> torch.Tensor:
    """``fn(e, rows of expert e, their output rows)`` for each expert with rows, in the grouped layout (one host
    read of ``offsets``); ``fn`` writes the output rows.

    Arguments:
        x: `[num_rows, hidden]`; offsets: `[num_experts]` with `torch.int32` (see :class:`ExpertComm`).

    Returns:
        `[num_rows, hidden]`, dtype of `x` (padding rows undefined).
    """
    out = torch.empty_like(x)
    begin = 0
    for e, end in enumerate(offsets.tolist()):
        if end > begin:
            fn(e, x[begin:end], out[begin:end])
        begin = end
    return out


def swiglu(gate: torch.Tensor, up: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """``silu(gate) * up``; gpt-oss' clamped form with ``swiglu_limit``: ``gate <= limit``, ``|up| <= limit``,
    ``(up + 1) * gate * sigmoid(swiglu_alpha * gate)``."""
    if cfg.swiglu_limit is None:
        return F.silu(gate) * up
    gate, up = gate.clamp(max=cfg.swiglu_limit), up.clamp(-cfg.swiglu_limit, cfg.swiglu_limit)
    return (up + 1) * (gate * torch.sigmoid(gate * cfg.swiglu_alpha))


def _plus(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y + bias


class LocalExperts(nn.Module):
    """This rank's routed experts, stacked: ``w13`` `[num_local_experts, 2 * I, hidden]` (gate rows first, then up)
    and ``w2`` `[num_local_experts, hidden, I]`, with gpt-oss' biases ``b13`` `[num_local_experts, 2 * I]` and ``b2``
    `[num_local_experts, hidden]`. :meth:`quantize_int8` swaps the weights for int8 ones (biases stay float)."""

    def __init__(self, cfg: ModelConfig, num_local_experts: int) -> None:
        super().__init__()
        self.cfg, self.intermediate = cfg, cfg.moe_intermediate_size
        hidden, inter = cfg.hidden_size, cfg.moe_intermediate_size
        self.w13 = nn.Parameter(torch.empty(num_local_experts, 2 * inter, hidden))
        self.w2 = nn.Parameter(torch.empty(num_local_experts, hidden, inter))
        if cfg.expert_bias:
            self.b13 = nn.Parameter(torch.empty(num_local_experts, 2 * inter))
            self.b2 = nn.Parameter(torch.empty(num_local_experts, hidden))
        self.int8: list[tuple[Int8Linear, Int8Linear]] | None = None

    def quantize_int8(self) -> None:
        """Per-output-channel int8 weights; activations are quantized per token at run time."""
        self.int8 = [(Int8Linear(self.w13[e]), Int8Linear(self.w2[e])) for e in range(self.w13.shape[0])]
        self.w13 = nn.Parameter(self.w13.new_empty(0), requires_grad=False)
        self.w2 = nn.Parameter(self.w2.new_empty(0), requires_grad=False)

    def forward(self, recv_rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """``recv_rows`` `[num_rows, hidden]` grouped by ``offsets`` `[num_local_experts]` `torch.int32` ->
        `[num_rows, hidden]` (padding rows undefined)."""
        if (out := self.kernel(recv_rows, offsets)) is not None:
            return out
        if self.int8 is not None or not use_grouped_mm(recv_rows, offsets.shape[0]):
            return per_expert(recv_rows, offsets, self._expert)
        return self.grouped(recv_rows, offsets)

    def kernel(self, recv_rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor | None:
        """The bf16 experts without biases as two ``expert_mm`` calls (arguments and result as :meth:`forward`), or
        None where they do not run so (see the module doc). An expert with more than ``MATMUL_ROWS`` rows is
        compute-bound: it runs as torch's bf16 matmul (oneDNN) instead, the others on the kernel."""
        if self.int8 is not None or hasattr(self, "b13") or recv_rows.shape[0] > ROWS_PER_EXPERT * len(offsets):
            return None
        heavy = self._heavy(offsets) if recv_rows.shape[0] > MATMUL_ROWS else []
        if (h := expert_mm(recv_rows, self.w13, offsets, max_rows=MATMUL_ROWS)) is None:
            return None
        for e, begin, end in heavy:
            torch.matmul(recv_rows[begin:end], self.w13[e].t(), out=h[begin:end])
        gate, up = h.split(self.intermediate, dim=-1)
        act = swiglu(gate, up, self.cfg).contiguous()
        out = expert_mm(act, self.w2, offsets, max_rows=MATMUL_ROWS)
        assert out is not None  # (the first call ran: so does this one)
        for e, begin, end in heavy:
            torch.matmul(act[begin:end], self.w2[e].t(), out=out[begin:end])
        return out

    @staticmethod
    def _heavy(offsets: torch.Tensor) -> list[tuple[int, int, int]]:
        """(expert, first row, end row) of each expert with more than ``MATMUL_ROWS`` rows (one host read)."""
        ends = offsets.tolist()
        starts = [0, *ends[:-1]]
        return [(e, b, n) for e, (b, n) in enumerate(zip(starts, ends, strict=True)) if n - b > MATMUL_ROWS]

    def grouped(self, recv_rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """The float experts as two grouped matmuls (arguments and result as :meth:`forward`)."""
        b13 = b2 = None
        if hasattr(self, "b13"):  # each row's expert, from the offsets (on the device, no host read)
            rows = torch.arange(recv_rows.shape[0], device=recv_rows.device, dtype=offsets.dtype)
            expert = torch.searchsorted(offsets, rows, right=True).clamp_(max=offsets.shape[0] - 1)
            b13, b2 = self.b13[expert], self.b2[expert]
        h = _plus(torch._grouped_mm(recv_rows, self.w13.transpose(1, 2), offs=offsets), b13)
        gate, up = h.split(self.intermediate, dim=-1)
        return _plus(torch._grouped_mm(swiglu(gate, up, self.cfg), self.w2.transpose(1, 2), offs=offsets), b2)

    def _expert(self, e: int, x: torch.Tensor, out: torch.Tensor) -> None:
        """Local expert ``e`` on its rows ``x`` `[n, hidden]`, written to ``out`` `[n, hidden]` (one row: as
        matrix-vector products, see :mod:`server.models.linear`)."""
        i, cfg = self.intermediate, self.cfg
        b13, b2 = (self.b13[e], self.b2[e]) if hasattr(self, "b13") else (None, None)
        if self.int8 is not None:
            w13, w2 = self.int8[e]
            h = _plus(w13(x), b13)
            out.copy_(_plus(w2(swiglu(h[:, :i], h[:, i:], cfg)), b2))
        elif x.shape[0] == 1 and x.device.type == "cpu":
            h = torch.mv(self.w13[e], x[0]) if b13 is None else torch.addmv(b13, self.w13[e], x[0])
            g = swiglu(h[:i], h[i:], cfg)
            if b2 is None:
                torch.mv(self.w2[e], g, out=out[0])
            else:
                torch.addmv(b2, self.w2[e], g, out=out[0])
        else:
            h = F.linear(x, self.w13[e], b13)
            out.copy_(F.linear(swiglu(h[:, :i], h[:, i:], cfg), self.w2[e], b2))


class SparseMoE(nn.Module):
    """Router + EP dispatch/combine around :class:`LocalExperts` (+ the shared expert: DeepSeek-V3, GLM-4.5,
    Qwen2-MoE with its sigmoid gate)."""

    def __init__(self, cfg: ModelConfig, comm: ExpertComm, moe_index: int = 0) -> None:
        super().__init__()
        self.comm, self.moe_index, self.num_moe_layers = comm, moe_index, len(cfg.moe_layers)
        self.fused = comm.fused  # the fused path (comm.fused_moe) or dispatch -> experts -> combine, fixed here
        self._mega_weights: tuple[torch.Tensor, torch.Tensor] | None = None
        if self.fused and (why := fused_refusal(cfg)):
            raise ValueError(why)
        self.router_name = cfg.router_name
        setattr(self, cfg.router_name, Router(cfg))
        self.experts = LocalExperts(cfg, comm.num_local_experts)
        self.shared_name = cfg.shared_expert_name if cfg.shared_expert_intermediate_size > 0 else None
        if self.shared_name is not None:
            setattr(self, self.shared_name, DenseMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size))
            if cfg.shared_expert_gate:
                self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor, num_tokens_all_ranks: int | None = None) -> torch.Tensor:
        """``x`` `[num_tokens, hidden]` -> `[num_tokens, hidden]`, same dtype (num_tokens may be 0);
        ``num_tokens_all_ranks``: the step's tokens over every EP rank, if known (see :meth:`ExpertComm.dispatch`)."""
        logical, topk_weights = getattr(self, self.router_name)(x)
        topk_idx = self.comm.to_physical(self.moe_index, logical)  # (a placement with replicas: slot ids)
        if self.fused:
            return self._fused(x, topk_idx, topk_weights)
        recv_rows, offsets, handle = self.comm.timed_dispatch(x, topk_idx, num_tokens_all_ranks)
        expert_out = self.experts(recv_rows, offsets)
        shared = (lambda: self._shared(x)) if self.shared_name is not None else None
        out, shared_out = self.comm.timed_combine(expert_out, topk_idx, topk_weights, handle, overlap=shared)
        self.comm.record_load(self.moe_index, self.num_moe_layers, offsets)
        return out if shared_out is None else out + shared_out

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert's output `[num_tokens, hidden]` (Qwen2-MoE: x ``sigmoid(shared_expert_gate(x))``)."""
        assert self.shared_name is not None
        out = getattr(self, self.shared_name)(x)
        if hasattr(self, "shared_expert_gate"):
            out = torch.sigmoid(self.shared_expert_gate(x)) * out
        return out

    def prepare_fused(self) -> None:
        """Lay the loaded expert weights out for ``Buffer.mega_moe`` (w1 `[L, hidden, 2I]`, w2 `[L, I, hidden]`) and
        drop the unfused copies; the loader calls it once on fused layers, after filling the weights."""
        w13, w2 = self.experts.w13.detach(), self.experts.w2.detach()
        self._mega_weights = (w13.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous())
        self.experts.w13 = nn.Parameter(w13.new_empty(0), requires_grad=False)  # (not kept twice)
        self.experts.w2 = nn.Parameter(w2.new_empty(0), requires_grad=False)

    def expert_tensors(self) -> list[torch.Tensor]:
        """This rank's routed-expert weights as held now (the fused layout on fused layers)."""
        return list(self._mega_weights or ()) + list(self.experts.state_dict().values())

    def _fused(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """The fused path (``Buffer.mega_moe``) on the weights :meth:`prepare_fused` laid out."""
        assert self._mega_weights is not None, "prepare_fused() was not called after loading"
        out = self.comm.fused_moe(x, topk_idx, topk_weights, *self._mega_weights)  # type: ignore[attr-defined]
        return out if self.shared_name is None else out + self._shared(x)
