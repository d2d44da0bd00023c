"""The DeepEP low-latency calls' parameters, validated locally (no communication) by the ops' rules
(:mod:`deep_ep_npu.errors`); on failure the Buffer passes the error's code to the backend's ``abort``."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from . import errors as checks
from . import sizes
from .errors import ACT_DTYPES, MAX_TOPK, invalid, null, shape
from .errors import flag as _flag
from .handle import LowLatencyHandle

QUANT_FORMATS = ("fp8_e4m3", "int8_per_token")


@dataclasses.dataclass
class DispatchArgs:
    """``low_latency_dispatch``'s arguments (plus the group size and the backend's 8-bit format). :meth:`validate`
    returns the validated call, with ``quant`` None (no quantization) or one of ``QUANT_FORMATS``."""

    x: Any
    topk_idx: Any
    num_max_dispatch_tokens_per_rank: Any
    num_experts: Any
    cumulative_local_expert_recv_stats: Any = None
    dispatch_wait_recv_cost_stats: Any = None
    use_fp8: Any = True
    round_scale: Any = False
    use_ue8m0: Any = False
    async_finish: Any = False
    return_recv_hook: Any = False
    quant_format: Any = None
    num_ranks: int = 1
    native_quant_format: str = "fp8_e4m3"
    quant: str | None = None

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.num_ranks

    @property
    def hidden(self) -> int:
        return self.x.shape[1]

    def validate(self) -> DispatchArgs:
        r = self.num_ranks
        check_overlap_flags(self.async_finish, self.return_recv_hook)
        use_fp8, round_scale = _flag(self.use_fp8, "use_fp8"), _flag(self.round_scale, "round_scale")
        if _flag(self.use_ue8m0, "use_ue8m0") and not round_scale:
            raise invalid("use_ue8m0", "use_ue8m0=True requires round_scale=True (UE8M0 scales are powers of two)")
        num_max = _positive_int(self.num_max_dispatch_tokens_per_rank, "num_max_dispatch_tokens_per_rank")
        num_experts = _positive_int(self.num_experts, "num_experts")
        if num_experts % r:
            raise shape("num_experts", f"{num_experts} is not divisible by num_ranks = {r}")
        x = checks.tensor(self.x, "x", ACT_DTYPES, 2)
        hidden = x.shape[1]
        if hidden < 1:
            raise shape("x", f"hidden (dim 1) must be >= 1, got shape {tuple(x.shape)}")
        idx = check_topk_idx(self.topk_idx, x.shape[0], num_max, num_experts)
        if self.quant_format is not None:
            checks.one_of(self.quant_format, "quant_format", QUANT_FORMATS)
        quant = (self.quant_format or self.native_quant_format) if use_fp8 else None
        if quant and hidden % 128:
            raise shape("x", f"hidden = {hidden} must be a multiple of 128 with use_fp8 (per-128-channel scales)")
        if quant and self.use_ue8m0 and hidden % 512:
            raise shape("x", f"hidden = {hidden} must be a multiple of 512 with use_ue8m0 (4 scales per int32)")
        if quant == "int8_per_token" and round_scale:
            raise invalid("round_scale", "is not available with the int8_per_token format (scales are amax / 127)")
        # recv_x [L, R * N, hidden] (L * R = num_experts) and its int32 src_info: refuse what the device cannot hold
        row_bytes = hidden * (1 if quant else x.element_size()) + (4 * hidden // 128 if quant else 0) + 4
        param = "num_experts" if num_experts > num_max else "num_max_dispatch_tokens_per_rank"  # the larger factor
        sizes.check_fits(num_experts * num_max * row_bytes, x.device, param,
                         f"recv_x (num_experts={num_experts} x N={num_max} rows of hidden={hidden})")  # fmt: skip
        stats = self.cumulative_local_expert_recv_stats
        recv_stats = checks.shaped(stats, "cumulative_local_expert_recv_stats", torch.int32, (num_experts // r,), "[L]")
        wait = self.dispatch_wait_recv_cost_stats
        wait_stats = checks.shaped(wait, "dispatch_wait_recv_cost_stats", torch.int64, (r,), "[R]")
        return dataclasses.replace(
            self, x=x, topk_idx=idx, num_max_dispatch_tokens_per_rank=num_max, num_experts=num_experts, quant=quant,
            cumulative_local_expert_recv_stats=recv_stats, dispatch_wait_recv_cost_stats=wait_stats,
        )  # fmt: skip


@dataclasses.dataclass
class CombineArgs:
    """``low_latency_combine``'s arguments (plus the group size); :meth:`validate` returns the validated call
    (``handle`` a :class:`LowLatencyHandle`)."""

    x: Any
    topk_idx: Any
    topk_weights: Any
    handle: Any
    use_logfmt: Any = False
    zero_copy: Any = False
    async_finish: Any = False
    return_recv_hook: Any = False
    out: Any = None
    combine_wait_recv_cost_stats: Any = None
    num_ranks: int = 1

    def validate(self) -> CombineArgs:
        r = self.num_ranks
        check_overlap_flags(self.async_finish, self.return_recv_hook)
        use_logfmt, zero_copy = _flag(self.use_logfmt, "use_logfmt"), _flag(self.zero_copy, "zero_copy")
        if use_logfmt and zero_copy:
            raise invalid("use_logfmt", "use_logfmt and zero_copy cannot both be True (as DeepEP); pick one")
        h = validate_handle(self.handle, r)
        num_max, hidden = h.num_max_dispatch_tokens_per_rank, h.hidden
        x = checks.tensor(self.x, "x", ACT_DTYPES, 3)
        checks.dims(x, "x", (h.src_info.shape[0], r * num_max, hidden), "[L, R * N, hidden] from the handle")
        if use_logfmt and (x.dtype != torch.bfloat16 or hidden % 128):
            why = f"LogFMT encodes bfloat16 rows in 128-channel groups; got {x.dtype}, hidden = {hidden}"
            raise invalid("use_logfmt", why)
        if zero_copy and x.dtype != torch.bfloat16:
            raise invalid("x", f"zero_copy combines the bfloat16 buffer; x must be torch.bfloat16, got {x.dtype}")
        weights = checks.tensor(self.topk_weights, "topk_weights", (torch.float32,), 2)
        idx = check_topk_idx(self.topk_idx, weights.shape[0], num_max, h.num_experts)
        checks.dims(weights, "topk_weights", tuple(idx.shape), "topk_idx's shape")
        out = checks.optional_tensor(self.out, "out", (x.dtype,), 2)
        if out is not None:
            checks.dims(out, "out", (idx.shape[0], hidden), "[num_tokens, hidden]")
        stats = checks.shaped(
            self.combine_wait_recv_cost_stats, "combine_wait_recv_cost_stats", torch.int64, (r,), "[R]"
        )
        return dataclasses.replace(
            self, x=x, topk_idx=idx, topk_weights=weights, handle=h, zero_copy=zero_copy, out=out,
            combine_wait_recv_cost_stats=stats,
        )  # fmt: skip


def _positive_int(value: object, param: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise shape(param, f"must be a positive int, got {value!r}")
    return value


def check_overlap_flags(async_finish: object, return_recv_hook: object) -> None:
    if _flag(async_finish, "async_finish") and _flag(return_recv_hook, "return_recv_hook"):
        raise invalid("async_finish", "async_finish and return_recv_hook cannot both be True (pick one overlap style)")


def check_topk_idx(topk_idx: object, num_tokens: int, num_max: int, num_experts: int) -> torch.Tensor:
    """`[T, K]` int64/int32 ids in ``[-1, num_experts)``, ``0 < K <= 16``, T rows, no expert twice in a row."""
    idx = checks.expert_ids(topk_idx, "topk_idx", num_experts, num_tokens, MAX_TOPK, no_expert=True)
    if idx.shape[0] > num_max:
        msg = f"{idx.shape[0]} tokens exceed num_max_dispatch_tokens_per_rank = {num_max}; raise it (same on all ranks)"
        raise shape("topk_idx", msg)
    return idx


def validate_handle(handle: object, num_ranks: int) -> LowLatencyHandle:
    """``handle`` as a :class:`LowLatencyHandle` (a DeepEP 5-tuple is accepted), its fields checked."""
    if handle is None:
        raise null("handle", "pass the handle returned by low_latency_dispatch")
    if not isinstance(handle, tuple) or len(handle) != 5:
        raise invalid("handle", f"must be the 5-field handle returned by low_latency_dispatch, got {type(handle)}")
    h = handle if isinstance(handle, LowLatencyHandle) else LowLatencyHandle(*handle)
    num_max = _positive_int(h.num_max_dispatch_tokens_per_rank, "handle.num_max_dispatch_tokens_per_rank")
    num_experts = _positive_int(h.num_experts, "handle.num_experts")
    _positive_int(h.hidden, "handle.hidden")
    if num_experts % num_ranks:
        raise shape("handle.num_experts", f"{num_experts} is not divisible by num_ranks = {num_ranks}")
    src_info = checks.tensor(h.src_info, "handle.src_info", (torch.int32,), 2)
    checks.dims(src_info, "handle.src_info", (num_experts // num_ranks, num_ranks * num_max), "[L, R * N]")
    layout_range = checks.tensor(h.layout_range, "handle.layout_range", (torch.int64,), 2)
    checks.dims(layout_range, "handle.layout_range", (num_experts // num_ranks, num_ranks), "[L, R]")
    return h
