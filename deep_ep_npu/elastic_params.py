"""``ElasticBuffer.dispatch`` / ``combine`` arguments, validated locally (no communication) by the rules of
:mod:`deep_ep_npu.errors`: every error names the parameter, the value and what is allowed. The buffer then tells the
peers (they raise the same error) before any payload moves."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from . import errors as checks
from . import sizes
from .engine.elastic import Payload, worst_case_rows
from .ep_handle import EPHandle
from .errors import ACT_DTYPES, invalid, null, shape
from .event import EventHandle

MAX_TOPK_V2 = 32  # DeepEP V2's top-k limit
SF_DTYPES = (torch.float32, torch.int32)  # 4-byte scale factors: fp32, or four UE8M0 bytes per int32


@dataclasses.dataclass
class Dispatch:
    """A validated dispatch. ``handle``: the cached handle or None; ``sizes``: the (rows, expand rows) to allocate
    when they are known before the receive (no CPU sync, a cached handle), else None (exact sizes)."""

    x: torch.Tensor
    sf: torch.Tensor | None
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor | None
    stats: torch.Tensor | None
    num_experts: int
    num_max: int
    alignment: int
    do_expand: bool
    zero_padding: bool
    tma_sf: bool
    do_cpu_sync: bool
    handle: EPHandle | None
    handle_copy: bool
    async_finish: bool
    num_sms: int
    num_ranks: int
    sizes: tuple[int, int] | None

    @property
    def num_local(self) -> int:
        return self.num_experts // self.num_ranks

    @property
    def payload(self) -> Payload:
        sf, k = self.sf, self.topk_idx.shape[1]
        return Payload(
            self.x.shape[1], self.x.dtype, 0 if sf is None else sf.shape[1], None if sf is None else sf.dtype, k
        )


@dataclasses.dataclass
class Combine:
    """A validated combine: ``bias`` is the fp32 sum of ``biases`` (or None)."""

    x: torch.Tensor
    handle: EPHandle
    topk_weights: torch.Tensor | None
    bias: torch.Tensor | None
    async_finish: bool
    biases: tuple[torch.Tensor, ...] = ()


def _flag(value: object, param: str) -> bool:
    return checks.flag(value, param)


def _count(value: object, param: str, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise invalid(param, f"must be an int >= {lo}, got {value!r}")
    return value


def _events(previous_event: object, before_epilogue: object, allocate_on_comm_stream: object) -> None:
    for name, event in (("previous_event", previous_event), ("previous_event_before_epilogue", before_epilogue)):
        if event is not None and not isinstance(event, EventHandle):
            got = type(event).__name__
            raise invalid(name, f"must be None or an EventHandle (ElasticBuffer.capture()), got {got}")
    if previous_event is not None and not _flag(allocate_on_comm_stream, "allocate_on_comm_stream"):
        raise invalid("allocate_on_comm_stream", "must be True when previous_event is given (as DeepEP requires)")


def owned_handle(handle: object, owner: object, param: str = "handle") -> EPHandle:
    """``handle`` as an :class:`EPHandle` of the buffer ``owner`` whose dispatch has completed."""
    if not isinstance(handle, EPHandle):
        raise invalid(param, f"must be the EPHandle an ElasticBuffer.dispatch returned, got {type(handle).__name__}")
    state = handle.state
    if not isinstance(state, dict) or state.get("owner") is not owner:
        raise invalid(param, "was returned by another ElasticBuffer (or backend); pass this buffer's handle")
    if state.get("placement") is None:
        raise invalid(param, "its dispatch has not completed: call event.current_stream_wait() first")
    return handle


def split_x(x: object, param: str = "x") -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x`` `[T, H]` (bf16 / fp16 / fp32), or the pre-quantized ``(float8_e4m3fn [T, H], sf [T, S] 4-byte)``."""
    if isinstance(x, tuple):
        if len(x) != 2:
            raise invalid(param, f"a tuple x must be (data, scale factors), got {len(x)} elements")
        data = checks.tensor(x[0], f"{param}[0]", (torch.float8_e4m3fn,), 2)
        sf = checks.tensor(x[1], f"{param}[1]", SF_DTYPES, 2)
        if sf.shape[0] != data.shape[0]:
            raise shape(f"{param}[1]", f"has {sf.shape[0]} rows, the data has {data.shape[0]}")
        return data, sf
    return checks.tensor(x, param, ACT_DTYPES, 2), None


def validate_dispatch(c: dict[str, Any], *, num_ranks: int, default_num_max: int, owner: object) -> Dispatch:
    """``c``: the call's ``locals()``."""
    x, sf = split_x(c["x"])
    if x.shape[1] < 1:
        raise shape("x", f"hidden (dim 1) must be >= 1, got shape {tuple(x.shape)}")
    for name in ("async_with_compute_stream", "allocate_on_comm_stream", "do_handle_copy", "do_expand",
                 "do_zero_padding", "use_tma_aligned_col_major_sf"):  # fmt: skip
        _flag(c[name], name)
    _events(c["previous_event"], c["previous_event_before_epilogue"], c["allocate_on_comm_stream"])
    num_sms, _ = _count(c["num_sms"], "num_sms", 0), _count(c["num_qps"], "num_qps", 0)
    do_expand, sync = c["do_expand"], c["do_cpu_sync"]
    if sync is not None:
        _flag(sync, "do_cpu_sync")
    if c["do_zero_padding"] and not do_expand:
        raise invalid("do_zero_padding", "zeroes the expand layout's alignment padding: it needs do_expand=True")
    handle = c["handle"]
    if handle is not None:
        h = owned_handle(handle, owner)
        _cached_rules(c, h, x, sf)
        topk_idx, num_experts, num_max, alignment = h.topk_idx, h.num_experts, h.num_max_tokens_per_rank, \
            h.expert_alignment  # fmt: skip
        sync = False
    else:
        h, sync = None, True if sync is None else sync
        num_experts = c["num_experts"]
        if num_experts is None:
            raise null("num_experts", "pass the total number of experts (or a cached handle)")
        num_experts = _count(num_experts, "num_experts", 1)
        if num_experts % num_ranks:
            raise shape("num_experts", f"{num_experts} is not divisible by num_ranks = {num_ranks}")
        num_max = c["num_max_tokens_per_rank"] if c["num_max_tokens_per_rank"] is not None else default_num_max
        if isinstance(num_max, int) and not isinstance(num_max, bool) and num_max == 0:
            raise invalid("num_max_tokens_per_rank", "is 0: pass it to dispatch or to the ElasticBuffer constructor")
        num_max = _count(num_max, "num_max_tokens_per_rank", 1)
        alignment = _count(1 if c["expert_alignment"] is None else c["expert_alignment"], "expert_alignment", 1)
        topk_idx = checks.expert_ids(c["topk_idx"], "topk_idx", num_experts, x.shape[0], MAX_TOPK_V2, no_expert=True)
        if x.shape[0] > num_max:
            raise shape("x", f"{x.shape[0]} tokens exceed num_max_tokens_per_rank = {num_max} (the same on all ranks)")
    k, num_local = topk_idx.shape[1], num_experts // num_ranks
    weights = checks.shaped(c["topk_weights"], "topk_weights", torch.float32, (x.shape[0], k), "[num_tokens, K]")
    stats = checks.shaped(c["cumulative_local_expert_recv_stats"], "cumulative_local_expert_recv_stats", torch.int32,
                          (num_local,), "[num_local_experts]")  # fmt: skip
    worst = worst_case_rows(num_ranks, num_max, k, num_local, alignment)
    row_bytes = x.shape[1] * x.element_size() + (0 if sf is None else 4 * sf.shape[1]) + 4 * k + 8
    sizes.check_fits(worst[1 if do_expand else 0] * row_bytes, x.device, "num_max_tokens_per_rank",
                     f"recv_x (R * N = {num_ranks * num_max} tokens, K = {k}, hidden = {x.shape[1]})")  # fmt: skip
    known = (h.num_recv_tokens, h.num_expanded_tokens) if h is not None else None if sync else worst
    return Dispatch(x, sf, topk_idx, weights, stats, num_experts, num_max, alignment, do_expand, c["do_zero_padding"],
                    c["use_tma_aligned_col_major_sf"], sync, h, c["do_handle_copy"], c["async_with_compute_stream"],
                    num_sms, num_ranks, known)  # fmt: skip


def _cached_rules(c: dict[str, Any], h: EPHandle, x: torch.Tensor, sf: torch.Tensor | None) -> None:
    """DeepEP's rules for reusing a handle: the layout is the handle's, only the values of x and topk_weights may
    change (also x's row format here: the rows' size, which every rank must agree on, is the handle's)."""
    want = h.state["payload"]
    have = (x.shape[1], x.dtype, 0 if sf is None else sf.shape[1], None if sf is None else sf.dtype)
    if have != (want.hidden, want.x_dtype, want.sf_cols, want.sf_dtype):
        was = f"hidden={want.hidden}, {want.x_dtype}, {want.sf_cols} scale-factor columns ({want.sf_dtype})"
        now = f"hidden={have[0]}, {have[1]}, {have[2]} scale-factor columns ({have[3]})"
        raise invalid("x", f"is {now} but the cached handle's dispatch had {was}: pass x in the handle's format")
    if c["topk_idx"] is not None:
        raise invalid("topk_idx", "must be None with a cached handle (the handle's topk_idx is reused)")
    if c["do_cpu_sync"]:
        raise invalid("do_cpu_sync", "must be None or False with a cached handle (its shapes are reused)")
    if c["cumulative_local_expert_recv_stats"] is not None:
        raise invalid("cumulative_local_expert_recv_stats", "must be None with a cached handle (nothing is counted)")
    for name, want in (("num_experts", h.num_experts), ("expert_alignment", h.expert_alignment),
                       ("num_max_tokens_per_rank", h.num_max_tokens_per_rank), ("do_expand", h.do_expand)):  # fmt: skip
        if name != "do_expand" and c[name] is None:
            continue
        if c[name] != want or type(c[name]) is not type(want):
            also = "" if name == "do_expand" else " (or None)"
            raise invalid(name, f"is {c[name]!r} but the cached handle's is {want!r}; pass {want!r}{also}")
    if x.shape[0] != h.num_tokens:
        raise shape("x", f"has {x.shape[0]} tokens but the cached handle was made for {h.num_tokens}")


def validate_combine(c: dict[str, Any], *, owner: object, allow_multiple_reduction: bool) -> Combine:
    h = owned_handle(c["handle"], owner)
    x = checks.tensor(c["x"], "x", ACT_DTYPES, 2)
    rows = h.num_expanded_tokens if h.do_expand else h.num_recv_tokens
    if x.shape[0] != rows or x.shape[1] < 1:
        what = "expand rows (handle.num_expanded_tokens)" if h.do_expand else "rows (handle.num_recv_tokens)"
        raise shape("x", f"shape {tuple(x.shape)}: must be [{rows}, hidden], the dispatch's {what}")
    _flag(c["async_with_compute_stream"], "async_with_compute_stream")
    _events(c["previous_event"], c["previous_event_before_epilogue"], c["allocate_on_comm_stream"])
    _count(c["num_sms"], "num_sms", 0), _count(c["num_qps"], "num_qps", 0)
    weights = c["topk_weights"]
    if weights is not None and h.do_expand and not allow_multiple_reduction:
        raise invalid("topk_weights", "must be None for an expand combine with allow_multiple_reduction=False")
    size = (rows,) if h.do_expand else (rows, h.num_topk)
    weights = checks.shaped(weights, "topk_weights", torch.float32, size, "[rows]" if h.do_expand else "[rows, K]")
    bias = c["bias"]
    biases = bias if isinstance(bias, tuple) else () if bias is None else (bias,)
    if len(biases) > 2:
        raise invalid("bias", f"takes 0, 1 or 2 tensors, got {len(biases)}")
    total = None
    for i, b in enumerate(biases):
        name = "bias" if not isinstance(bias, tuple) else f"bias[{i}]"
        b = checks.tensor(b, name, (x.dtype,), 2)
        checks.dims(b, name, (h.num_tokens, x.shape[1]), "[num_tokens, hidden]")
        total = b.float() if total is None else total + b.float()
    return Combine(x, h, weights, total, c["async_with_compute_stream"], tuple(biases))
