"""The routed MoE block: router -> ``dispatch`` -> this rank's experts on the masked layout -> ``combine``
(+ shared experts, computed while the combine is in flight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .ep_comm import ExpertComm
from .layers import DenseMLP
from .quant import Int8Linear


class Router(nn.Module):
    """Top-k routing with the exact semantics of the HF class (``reference/serving.md`` §6, ``checkpoints.md`` §4).

    softmax (Qwen2/3-MoE, OLMoE, Mixtral): fp32 softmax -> top-k -> renormalise iff ``norm_topk_prob``.
    sigmoid (DeepSeek-V3, GLM-4.5): sigmoid -> + ``e_score_correction_bias`` (selection only) -> best ``topk_group`` of
    ``n_group`` groups by the sum of each group's top-2 -> top-k -> unbiased scores, renormalised iff
    ``norm_topk_prob`` (+1e-20) -> x ``routed_scaling_factor``.
    topk_softmax (gpt-oss): logits with the router's bias -> top-k -> softmax over the k kept logits.
    The router's parameters are kept in fp32.
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

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` `[num_tokens, hidden]` -> topk_idx `[num_tokens, k]` `torch.int64`, topk_weights `torch.float32`."""
        cfg = self.cfg
        logits = F.linear(x.float(), self.weight.float(), self.bias.float() if self.cfg.router_bias else None)
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


def swiglu(gate: torch.Tensor, up: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """``silu(gate) * up``; gpt-oss' clamped form with ``swiglu_limit``: ``gate <= limit``, ``|up| <= limit``,
    ``(up + 1) * gate * sigmoid(swiglu_alpha * gate)``."""
    if cfg.swiglu_limit is None:
        return F.silu(gate) * up
    gate, up = gate.clamp(max=cfg.swiglu_limit), up.clamp(-cfg.swiglu_limit, cfg.swiglu_limit)
    return (up + 1) * (gate * torch.sigmoid(gate * cfg.swiglu_alpha))


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

    def forward(self, recv_x: torch.Tensor, recv_count: torch.Tensor) -> torch.Tensor:
        """``recv_x`` `[L, R*N, hidden]`, ``recv_count`` `[L]` int32 -> `[L, R*N, hidden]` (rows past the count are
        uninitialised, as in DeepEP's layout; combine reads only the counted rows)."""
        out = torch.empty_like(recv_x)
        b13, b2 = (self.b13, self.b2) if hasattr(self, "b13") else ([None] * len(recv_count), [None] * len(recv_count))
        for e, n in enumerate(recv_count.tolist()):
            if n == 0:
                continue
            x = recv_x[e, :n]
            if self.int8 is None:
                gate, up = F.linear(x, self.w13[e], b13[e]).split(self.intermediate, dim=-1)
                out[e, :n] = F.linear(swiglu(gate, up, self.cfg), self.w2[e], b2[e])
                continue
            w13, w2 = self.int8[e]
            gate, up = _plus(w13(x), b13[e]).split(self.intermediate, dim=-1)
            out[e, :n] = _plus(w2(swiglu(gate, up, self.cfg)), b2[e])
        return out


def _plus(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y + bias


class SparseMoE(nn.Module):
    """Router + EP dispatch/combine around :class:`LocalExperts` (+ the shared expert: DeepSeek-V3, GLM-4.5,
    Qwen2-MoE with its sigmoid gate)."""

    def __init__(self, cfg: ModelConfig, comm: ExpertComm) -> None:
        super().__init__()
        self.comm = comm
        self.fused = comm.fused  # the fused path (comm.fused_moe) or dispatch -> experts -> combine, fixed here
        self._mega_weights: tuple[torch.Tensor, torch.Tensor] | None = None
        if self.fused and (cfg.expert_bias or cfg.swiglu_limit is not None):
            raise ValueError(f"moe_impl='fused' (Buffer.mega_moe) runs plain SwiGLU experts without biases; "
                             f"{cfg.architecture}'s experts need the unfused path (moe_impl='unfused')")  # fmt: skip
        self.router_name = cfg.router_name
        setattr(self, cfg.router_name, Router(cfg))
        self.experts = LocalExperts(cfg, comm.num_local_experts)
        self.shared_name = cfg.shared_expert_name if cfg.shared_expert_intermediate_size > 0 else None
        if self.shared_name is not None:
            setattr(self, self.shared_name, DenseMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size))
            if cfg.shared_expert_gate:
                self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` `[num_tokens, hidden]` -> `[num_tokens, hidden]`, same dtype (num_tokens may be 0)."""
        topk_idx, topk_weights = getattr(self, self.router_name)(x)
        if self.fused:
            return self._fused(x, topk_idx, topk_weights)
        recv_x, recv_count, handle = self.comm.timed_dispatch(x, topk_idx)
        expert_out = self.experts(recv_x, recv_count)
        shared = (lambda: self._shared(x)) if self.shared_name is not None else None
        out, shared_out = self.comm.timed_combine(expert_out, topk_idx, topk_weights, handle, overlap=shared)
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
