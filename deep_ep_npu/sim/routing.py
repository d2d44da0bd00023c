"""torch_npu's local MoE routing ops on CPU tensors, for the stand-in (vllm-ascend's AllGather / All2AllV token
dispatchers call them): ``npu_moe_init_routing_v2`` (its dropless mode), ``npu_moe_token_permute`` and
``npu_moe_token_unpermute``. No communication. Semantics as torch_npu documents them (https://www.hiascend.com, the
torch_npu API pages; T tokens, K top-k, flat index ``t * K + k``):

- token_permute: ``sorted_indices = argsort(indices.flatten(), stable)`` (int32), ``permuted = tokens[sorted_indices
  // K]``, the first ``num_out_tokens`` rows (0 / None: all).
- token_unpermute: ``out[t] = sum_k probs[t, k] * permuted[row of (t, k)]`` (rows scattered back by
  ``sorted_indices``; rows dropped by permute add 0; without probs, K = 1), accumulated in fp32, in the rows' dtype.
- init_routing_v2: the (t, k) pairs with an expert id in ``active_expert_range`` (default ``[0, expert_num)``),
  sorted stably by id: ``expanded_x`` their tokens' rows (at most ``active_num`` when > 0); ``expanded_row_idx``
  [T * K] (torch_npu's shape whatever the range keeps): (``row_idx_type`` 0, gather) each expanded row's flat index,
  then the pairs left out (stably by id; what torch_npu leaves there is undocumented, and ``npu_moe_token_unpermute``
  reads only the first ``permuted_tokens.shape[0]``: vllm-ascend's AllGather dispatcher pairs the two), or (1,
  scatter) each flat index's expanded row (-1: dropped); counts per expert of the range
  (``expert_tokens_num_type`` 0 cumsum, 1 count; int64); ``expanded_scale``: ``scale[t]`` per row (``quant_mode``
  -1), or the per-row dynamic int8 scale (``quant_mode`` 1, ``expanded_x`` int8, ``scale`` then the optional smooth
  scales `[E or 1, H]`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..quant import per_token


def _flat_ids(indices: torch.Tensor, name: str) -> tuple[torch.Tensor, int]:
    if not isinstance(indices, torch.Tensor) or indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name}: must be an int32 / int64 tensor, got {getattr(indices, 'dtype', type(indices))}")
    if indices.dim() not in (1, 2):
        raise ValueError(f"{name}: must be 1-D or 2-D, got shape {tuple(indices.shape)}")
    k = 1 if indices.dim() == 1 else indices.shape[1]
    return indices.reshape(-1).long(), k


def npu_moe_token_permute(
    tokens: torch.Tensor, indices: torch.Tensor, num_out_tokens: int | None = None, padded_mode: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(permuted_tokens [n, H] in tokens' dtype, sorted_indices [T * K] int32)`` (module docstring)."""
    if padded_mode:
        raise ValueError("padded_mode: True is not supported (torch_npu supports False only)")
    flat, k = _flat_ids(indices, "indices")
    if tokens.dim() != 2 or tokens.shape[0] * k != flat.numel():
        raise ValueError(f"tokens: shape {tuple(tokens.shape)} does not match indices {tuple(indices.shape)}")
    order = torch.argsort(flat, stable=True)
    n = flat.numel() if not num_out_tokens else min(int(num_out_tokens), flat.numel())
    return tokens.index_select(0, order[:n] // k), order.to(torch.int32)


def npu_moe_token_unpermute(
    permuted_tokens: torch.Tensor,
    sorted_indices: torch.Tensor,
    probs: torch.Tensor | None = None,
    padded_mode: bool = False,
    restore_shape: Sequence[int] | None = None,
) -> torch.Tensor:
    """`[T, H]` in ``permuted_tokens``' dtype (module docstring); ``probs`` `[T, K]` or None."""
    if padded_mode:
        raise ValueError("padded_mode: True is not supported (torch_npu supports False only)")
    flat, _ = _flat_ids(sorted_indices, "sorted_indices")
    k = 1 if probs is None else probs.shape[1]
    if flat.numel() % k or (probs is not None and probs.shape[0] * k != flat.numel()):
        raise ValueError(
            f"probs: shape {tuple(probs.shape) if probs is not None else None} does not match "
            f"{flat.numel()} sorted indices"
        )
    n, hidden = permuted_tokens.shape[0], permuted_tokens.shape[1]
    rows = torch.zeros((flat.numel(), hidden), dtype=torch.float32, device=permuted_tokens.device)
    rows.index_copy_(0, flat[:n], permuted_tokens.float())
    rows = rows.view(-1, k, hidden)
    if probs is not None:
        rows = rows * probs.float().unsqueeze(-1)
    return rows.sum(dim=1).to(permuted_tokens.dtype)


def npu_moe_init_routing_v2(
    x: torch.Tensor,
    expert_idx: torch.Tensor,
    *,
    scale: torch.Tensor | None = None,
    offset: torch.Tensor | None = None,
    active_num: int = -1,
    expert_capacity: int = -1,
    expert_num: int = -1,
    drop_pad_mode: int = 0,
    expert_tokens_num_type: int = 0,
    expert_tokens_num_flag: bool = False,
    quant_mode: int = -1,
    active_expert_range: Sequence[int] = (),
    row_idx_type: int = 0,
    x_dtype: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(expanded_x, expanded_row_idx int32, expert_token_cumsum_or_count int64, expanded_scale fp32)`` (module
    docstring); drop / pad mode, static quantization, key-value counts and MX modes are not simulated (ValueError)."""
    for name, value, ok in (("drop_pad_mode", drop_pad_mode, 0), ("expert_capacity", expert_capacity, -1)):
        if value != ok and not (name == "expert_capacity" and value in (0, -1)):
            raise ValueError(f"{name}: {value!r} is not simulated (dropless mode only: {ok})")
    if expert_tokens_num_type not in (0, 1) or quant_mode not in (-1, 1) or row_idx_type not in (0, 1):
        got = dict(expert_tokens_num_type=expert_tokens_num_type, quant_mode=quant_mode, row_idx_type=row_idx_type)
        raise ValueError(
            f"{got}: the stand-in simulates expert_tokens_num_type 0 / 1, quant_mode -1 / 1, row_idx_type 0 / 1"
        )
    flat, k = _flat_ids(expert_idx, "expert_idx")
    if x.dim() != 2 or x.shape[0] * k != flat.numel():
        raise ValueError(f"x: shape {tuple(x.shape)} does not match expert_idx {tuple(expert_idx.shape)}")
    num = expert_num if expert_num > 0 else int(flat.max()) + 1 if flat.numel() else 0
    lo, hi = (int(active_expert_range[0]), int(active_expert_range[1])) if len(active_expert_range) else (0, num)
    keep = ((flat >= lo) & (flat < hi)).nonzero(as_tuple=True)[0]
    order = keep[torch.argsort(flat[keep], stable=True)]
    if active_num > 0:
        order = order[:active_num]
    rows, src = x.index_select(0, order // k), order
    counts = torch.bincount(flat[order] - lo, minlength=hi - lo)[: hi - lo]
    if expert_tokens_num_type == 0:
        counts = counts.cumsum(0)
    if quant_mode == 1:
        smooth = None if scale is None else scale[(flat[order] - lo).clamp(max=scale.shape[0] - 1)].float()
        rows, out_scale = per_token(rows, smooth)
    else:
        out_scale = scale.float()[order // k] if scale is not None else torch.empty((0,), dtype=torch.float32)
    if row_idx_type == 0:  # [T * K], as torch_npu's: the expanded rows' flat indices, then every other pair's
        rest = torch.ones(flat.numel(), dtype=torch.bool, device=x.device)
        rest[src] = False
        others = rest.nonzero(as_tuple=True)[0]
        row_idx = torch.cat([src, others[torch.argsort(flat[others], stable=True)]]).to(torch.int32)
    else:
        row_idx = torch.full((flat.numel(),), -1, dtype=torch.int32, device=x.device)
        row_idx[src] = torch.arange(src.numel(), dtype=torch.int32, device=x.device)
    return rows, row_idx, counts.to(torch.int64), out_scale.reshape(-1)
