"""DeepEP V2's rules (``ElasticBuffer``): the pre-quantized ``x`` tuple, events, a cached handle's reuse rules and the
combine's rows, on top of :mod:`.rules` (which checks the ids, the weights, the statistics and the sizes)."""

from __future__ import annotations

import dataclasses

import torch

from ..errors import invalid, null, shape
from ..handle import EPHandle, EventHandle
from . import rules
from .call import ExpandCombine, ExpandDispatch

SF_DTYPES = (torch.float32, torch.int32)  # 4-byte scale factors: fp32, or four UE8M0 bytes per int32
NAMES = {"expert_ids": "topk_idx", "expert_scales": "topk_weights", "num_max": "num_max_tokens_per_rank",
         "moe_expert_num": "num_experts", "recv_stats": "cumulative_local_expert_recv_stats"}  # fmt: skip


def split_x(x: object) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x`` `[T, H]` (bf16 / fp16 / fp32), or the pre-quantized ``(float8_e4m3fn [T, H], sf [T, S] 4-byte)``."""
    if not isinstance(x, tuple):
        return rules.activations(x, "x"), None
    if len(x) != 2:
        raise invalid("x", f"a tuple x must be (data, scale factors), got {len(x)} elements")
    data = rules.tensor(x[0], "x[0]", (torch.float8_e4m3fn,), 2)
    sf = rules.tensor(x[1], "x[1]", SF_DTYPES, 2)
    if sf.shape[0] != data.shape[0]:
        raise shape("x[1]", f"has {sf.shape[0]} rows, the data has {data.shape[0]}")
    return data, sf


def events(
    previous_event: object, before_epilogue: object, allocate_on_comm_stream: object, num_sms: object, num_qps: object
) -> None:
    """DeepEP's stream arguments: accepted (there are no streams here), checked."""
    for name, event in (("previous_event", previous_event), ("previous_event_before_epilogue", before_epilogue)):
        if event is not None and not isinstance(event, EventHandle):
            got = type(event).__name__
            raise invalid(name, f"must be None or an EventHandle (ElasticBuffer.capture()), got {got}")
    if previous_event is not None and not rules.flag(allocate_on_comm_stream, "allocate_on_comm_stream"):
        raise invalid("allocate_on_comm_stream", "must be True when previous_event is given (as DeepEP requires)")
    rules.count(num_sms, "num_sms", 0)
    rules.count(num_qps, "num_qps", 0)


def owned_handle(handle: object, owner: object) -> EPHandle:
    """``handle`` as an :class:`EPHandle` of the buffer ``owner`` whose dispatch has completed."""
    if not isinstance(handle, EPHandle):
        raise invalid("handle", f"must be the EPHandle an ElasticBuffer.dispatch returned, got {type(handle).__name__}")
    state = handle.state
    if not isinstance(state, dict) or state.get("owner") is not owner:
        raise invalid("handle", "was returned by another ElasticBuffer (or backend); pass this buffer's handle")
    if state.get("placement") is None:
        raise invalid("handle", "its dispatch has not completed: call event.current_stream_wait() first")
    return handle


def cached(c: ExpandDispatch, h: EPHandle, topk_idx: object, do_cpu_sync: object, *settings: object) -> None:
    """DeepEP's rules for reusing a handle: the layout is the handle's, only the values of x and topk_weights may
    change (also x's row format here: the rows' size, which every rank must agree on, is the handle's). ``settings``:
    num_experts, expert_alignment, num_max_tokens_per_rank (None: the handle's) and do_expand as passed."""
    want, sf = h.state["payload"], c.x_sf
    have = (c.x.shape[1], c.x.dtype, 0 if sf is None else sf.shape[1], None if sf is None else sf.dtype)
    if have != (want.hidden, want.x_dtype, want.sf_cols, want.sf_dtype):
        was = f"hidden={want.hidden}, {want.x_dtype}, {want.sf_cols} scale-factor columns ({want.sf_dtype})"
        now = f"hidden={have[0]}, {have[1]}, {have[2]} scale-factor columns ({have[3]})"
        raise invalid("x", f"is {now} but the cached handle's dispatch had {was}: pass x in the handle's format")
    if topk_idx is not None:
        raise invalid("topk_idx", "must be None with a cached handle (the handle's topk_idx is reused)")
    if do_cpu_sync:
        raise invalid("do_cpu_sync", "must be None or False with a cached handle (its shapes are reused)")
    if c.recv_stats is not None:
        raise invalid("cumulative_local_expert_recv_stats", "must be None with a cached handle (nothing is counted)")
    names = ("num_experts", "expert_alignment", "num_max_tokens_per_rank", "do_expand")
    for name, got in zip(names, settings, strict=True):
        want_v = getattr(h, name)
        if (got is not None or name == "do_expand") and (got != want_v or type(got) is not type(want_v)):
            also = "" if name == "do_expand" else " (or None)"
            raise invalid(name, f"is {got!r} but the cached handle's is {want_v!r}; pass {want_v!r}{also}")
    if c.x.shape[0] != h.num_tokens:
        raise shape("x", f"has {c.x.shape[0]} tokens but the cached handle was made for {h.num_tokens}")


def num_max(value: object, default: int) -> int:
    """N: given, else the constructor's (0: neither)."""
    n = value if value is not None else default
    if isinstance(n, int) and not isinstance(n, bool) and n == 0:
        raise invalid("num_max_tokens_per_rank", "is 0: pass it to dispatch or to the ElasticBuffer constructor")
    return rules.count(n, "num_max_tokens_per_rank", 1)


def experts_of(num_experts: object, num_ranks: int, rank: int) -> rules.Experts:
    if num_experts is None:
        raise null("num_experts", "pass the total number of experts (or a cached handle)")
    rules.count(num_experts, "num_experts", 1)
    return rules.plain_experts(num_ranks, rank, num_experts, "num_experts")


def combine(c: ExpandCombine, multiple_reduction: bool, bias: object) -> ExpandCombine:
    """A V2 combine: ``c.handle`` this buffer's (:func:`owned_handle`), ``c.x`` its rows, ``c.expert_scales`` the
    weights to send back (None or per row / slot), ``bias`` None or one or two `[T, hidden]` tensors (added first)."""
    h = c.handle
    x = rules.tensor(c.x, "x", rules.ACT_DTYPES, 2)
    rows = h.num_expanded_tokens if h.do_expand else h.num_recv_tokens
    if x.shape[0] != rows or x.shape[1] < 1:
        what = "expand rows (handle.num_expanded_tokens)" if h.do_expand else "rows (handle.num_recv_tokens)"
        raise shape("x", f"shape {tuple(x.shape)}: must be [{rows}, hidden], the dispatch's {what}")
    if c.expert_scales is not None and h.do_expand and not multiple_reduction:
        raise invalid("topk_weights", "must be None for an expand combine with allow_multiple_reduction=False")
    size, what = ((rows,), "[rows]") if h.do_expand else ((rows, h.num_topk), "[rows, K]")
    weights = rules.shaped(c.expert_scales, "topk_weights", torch.float32, size, what)
    biases = bias if isinstance(bias, tuple) else () if bias is None else (bias,)
    if len(biases) > 2:
        raise invalid("bias", f"takes 0, 1 or 2 tensors, got {len(biases)}")
    for i, b in enumerate(biases):
        name = f"bias[{i}]" if isinstance(bias, tuple) else "bias"
        rules.dims(rules.tensor(b, name, (x.dtype,), 2), name, (h.num_tokens, x.shape[1]), "[num_tokens, hidden]")
    return dataclasses.replace(c, x=x, expert_scales=weights, bias=tuple(biases), multiple_reduction=multiple_reduction)
