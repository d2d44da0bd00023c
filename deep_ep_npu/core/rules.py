"""The one rule set: every check of a call's arguments, raising :class:`~deep_ep_npu.errors.MoeDistributeError` that
names the parameter (the front-end's name), the value and what is allowed. Pure (no communication): a front-end that
catches the error tells its peers (``Backend.reject``) so that every rank raises. The primitives come first, then the
calls' rules; the Ascend ops' platform rules are :mod:`.ascend`, a fused call's :mod:`.fused`."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from typing import overload

import torch

from .. import envs, kernels
from ..errors import invalid, null, shape
from ..handle import LowLatencyHandle
from ..quant import INT8_PER_TOKEN, Quant, deepep_fp8
from ..sizes import align
from .call import ExpandDispatch, Experts, MaskedCombine, MaskedDispatch

ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # activations off the NPU (it takes bf16 / fp16)
ID_DTYPES = (torch.int32, torch.int64)
MAX_TOPK = 16  # top-k limit of the ops, DeepEP's low-latency kernels and MegaMoE
QUANT_FORMATS = ("fp8_e4m3", "int8_per_token")  # DeepEP's use_fp8 formats (quant_format)
PLATFORM_NAMES = {"a2": "Atlas A2", "a3": "Atlas A3", "a5": "Ascend 950 (A5)"}  # a2: named in errors, not a strict
_Ndim = int | tuple[int, ...]


def tensor(value: object, param: str, dtypes: Iterable[torch.dtype], ndim: _Ndim) -> torch.Tensor:
    """A required tensor: not None (161001), one of ``dtypes`` (161002), ``ndim`` dims (561002)."""
    if value is None:
        raise null(param)
    if not isinstance(value, torch.Tensor):
        raise invalid(param, f"must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype not in (dtypes := tuple(dtypes)):
        raise invalid(param, f"dtype {value.dtype} not supported, allowed {[str(d) for d in dtypes]}")
    if value.dim() not in (dims_ := (ndim,) if isinstance(ndim, int) else ndim):
        raise shape(param, f"must have {' or '.join(map(str, dims_))} dims, got shape {tuple(value.shape)}")
    return value


def optional_tensor(value: object, param: str, dtypes: Iterable[torch.dtype], ndim: _Ndim) -> torch.Tensor | None:
    """None, or a tensor as :func:`tensor` requires."""
    return None if value is None else tensor(value, param, dtypes, ndim)


def shaped(value: object, param: str, dtype: torch.dtype, size: tuple[int, ...], what: str) -> torch.Tensor | None:
    """None, or a ``dtype`` tensor of shape ``size`` (``what`` names it)."""
    t = optional_tensor(value, param, (dtype,), len(size))
    if t is not None:
        dims(t, param, size, what)
    return t


def dims(value: torch.Tensor, param: str, expected: tuple[int, ...], what: str) -> None:
    if tuple(value.shape) != tuple(expected):
        raise shape(param, f"shape {tuple(value.shape)} does not match {what} {tuple(expected)}")


def in_range(value: object, param: str, lo: int, hi: int, code: str = "shape") -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise invalid(param, f"must be an int, got {type(value).__name__} {value!r}")
    if not lo <= value <= hi:
        raise (shape if code == "shape" else invalid)(param, f"got {value}, allowed [{lo}, {hi}]")
    return value


def count(value: object, param: str, lo: int, code: str = "param") -> int:
    """An int ``>= lo`` (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise (shape if code == "shape" else invalid)(param, f"must be an int >= {lo}, got {value!r}")
    return value


def global_bs(value: object, num_ranks: int, num_tokens: int, max_bs: int) -> int:
    """``global_bs``: 0 (every rank has the same Bs) or max(Bs) * W (a multiple of W, at least this rank's Bs * W,
    at most ``max_bs`` * W); returns global_bs_real, ``value or num_tokens * num_ranks``."""
    g = in_range(value, "global_bs", 0, max_bs * num_ranks)
    if g % num_ranks:
        raise shape("global_bs", f"{g} is not a multiple of ep_world_size {num_ranks} (pass max Bs x W)")
    if g and num_tokens > g // num_ranks:
        raise shape("global_bs", f"{g} / W = {g // num_ranks} is below this rank's Bs {num_tokens}")
    return g or num_tokens * num_ranks


def one_of(value: object, param: str, allowed: Iterable[object], why: str = "") -> object:
    if value not in (allowed := tuple(allowed)):
        raise invalid(param, f"got {value!r}, allowed {list(allowed)}{'; ' + why if why else ''}")
    return value


def flag(value: object, param: str) -> bool:
    if not isinstance(value, bool):
        raise invalid(param, f"must be a bool, got {type(value).__name__} {value!r}")
    return value


def platform_feature(plat: str | None, param: str, value: object, owners: tuple[str, ...], allowed: str) -> None:
    """Under a strict platform ``plat`` (:mod:`.ascend`) that is not one of ``owners`` (the platforms whose docs list
    ``value``), raise 161002 naming where ``value`` belongs and what ``plat`` allows."""
    if plat is None or plat in owners:
        return
    what = f"an {' / '.join(PLATFORM_NAMES[o] for o in owners)} feature" if owners else "a value no platform documents"
    why = f"got {value!r}, {what}: not on {PLATFORM_NAMES[plat]} (strict={plat!r}), which allows {allowed}"
    raise invalid(param, why + ("; accepted without strict" if not owners else ""))


def values_checked(t: torch.Tensor) -> bool:
    """Whether the checks that read ``t``'s values run (:func:`deep_ep_npu.envs.check_values`: on CPU tensors unless
    ``DEEP_EP_NPU_CHECK_VALUES=0``, on a device only with ``=1``). Without them a bad value is not reported: the
    call's results are undefined (rows routed wrong or dropped, an indexing error on this rank, or the peers'
    :class:`~deep_ep_npu.EPRankFailure` when this rank fails before the exchange)."""
    policy = envs.check_values()
    return t.device.type == "cpu" if policy is None else policy


def prefix_mask(mask: torch.Tensor, num_tokens: int) -> None:
    """A 1D ``x_active_mask`` `[num_tokens]` bool; it must mark a prefix (checked by :func:`values_checked`)."""
    if mask.shape[0] != num_tokens:
        raise shape("x_active_mask", f"1D mask has {mask.shape[0]} entries, expected Bs = {num_tokens}")
    if values_checked(mask) and (n := int(mask.sum())) and not bool(mask[:n].all()):
        raise shape("x_active_mask", "a 1D mask must mark a prefix of active tokens (all True entries first)")


def expert_ids(
    ids: object,
    param: str,
    num_ids: int,
    num_tokens: int,
    max_topk: int,
    no_expert: bool,
    what: str = "",
    active: torch.Tensor | None = None,
) -> torch.Tensor:
    """The top-k rule: `[num_tokens, K]` int32 / int64, ``0 < K <= max_topk``, every id in ``[0, num_ids)`` (or -1,
    "no expert", when ``no_expert``), no id twice in a row. Checked on the given dtype, before any cast, and only
    where ``active`` (`[num_tokens, K]` bool, None: everywhere) is True: excluded entries may hold anything. The ids'
    values are checked only where :func:`values_checked` says (their shape and dtype always)."""
    t = tensor(ids, param, ID_DTYPES, 2)
    k = t.shape[1]
    if t.shape[0] != num_tokens:
        raise shape(param, f"has {t.shape[0]} rows but x has {num_tokens} tokens")
    if not 0 < k <= max_topk:
        raise shape(param, f"top-k (dim 1) is {k}, allowed (0, {max_topk}]")
    if not (checked := values_checked(t)) or active is None and kernels.ids_ok(t, -1 if no_expert else 0, num_ids):
        return t if active is None else t.masked_fill(~active, -1)  # (ids_ok: one pass; else as below)
    if active is not None:  # excluded entries read -1: neither range-checked nor duplicates
        t = t.masked_fill(~active, -1)
    if checked and (vals := t if active is None else t[active]).numel():
        lo, hi, floor = int(vals.min()), int(vals.max()), -1 if no_expert else 0
        if lo < floor or hi >= num_ids:
            allowed = f"[0, {num_ids}){what}" + (" or -1 (no expert)" if no_expert else "")
            raise shape(param, f"contains {lo if lo < floor else hi}, allowed {allowed}")
        if k > 1:
            srt = t.sort(dim=1).values
            dup = ((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)).any(dim=1)
            if bool(dup.any()):
                row = int(dup.nonzero()[0, 0])
                why = f"row {row} lists an expert twice ({t[row].tolist()}); ids must be distinct per token"
                raise shape(param, why)
    return t


def fits(num_bytes: int, device: torch.device, param: str, what: str) -> None:
    """Refuse ``num_bytes`` (``what``) beyond the memory of ``device`` (a GPU's / NPU's total, else the host's):
    a clear error instead of the allocator's."""
    if device.type in ("cuda", "npu"):
        have = int(getattr(torch, device.type).mem_get_info(device)[1])
    else:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if num_bytes > have:
        raise shape(param, f"{what} needs {num_bytes} bytes, more than the {have} bytes of {device}")


def plain_experts(num_ranks: int, rank: int, value: object, param: str) -> Experts:
    """DeepEP's layout: ``value`` routed experts (a positive int divisible by the ranks), ``value / R`` per rank in
    rank order."""
    n = count(value, param, 1, code="shape")
    if n % num_ranks:
        raise shape(param, f"{n} is not divisible by num_ranks = {num_ranks}")
    per = n // num_ranks
    return Experts(num_ranks, rank, n, per, per, num_ranks, rank, tuple(range(num_ranks)), scales_experts=n)


def activations(x: object, param: str = "x") -> torch.Tensor:
    """`[T, hidden]` bf16 / fp16 / fp32, hidden >= 1."""
    t = tensor(x, param, ACT_DTYPES, 2)
    if t.shape[1] < 1:
        raise shape(param, f"hidden (dim 1) must be >= 1, got shape {tuple(t.shape)}")
    return t


def overlap_flags(async_finish: object, return_recv_hook: object) -> None:
    finish, hook = flag(async_finish, "async_finish"), flag(return_recv_hook, "return_recv_hook")
    if finish and hook:
        raise invalid("async_finish", "async_finish and return_recv_hook cannot both be True (pick one overlap style)")


def deepep_quant(
    use_fp8: object, round_scale: object, use_ue8m0: object, quant_format: object, native: str
) -> Quant | None:
    """DeepEP's ``use_fp8`` / ``round_scale`` / ``use_ue8m0`` and our ``quant_format`` (``native``: the backend's):
    the rows' format, None (x's dtype), DeepEP's fp8 (:func:`~deep_ep_npu.quant.deepep_fp8`) or
    :data:`~deep_ep_npu.quant.INT8_PER_TOKEN`."""
    use_fp8, rounded = flag(use_fp8, "use_fp8"), flag(round_scale, "round_scale")
    if flag(use_ue8m0, "use_ue8m0") and not rounded:
        raise invalid("use_ue8m0", "use_ue8m0=True requires round_scale=True (UE8M0 scales are powers of two)")
    if quant_format is not None:
        one_of(quant_format, "quant_format", QUANT_FORMATS)
    if not use_fp8:
        return None
    if (quant_format or native) == "fp8_e4m3":
        return deepep_fp8(rounded, bool(use_ue8m0))
    if rounded:
        raise invalid("round_scale", "is not available with the int8_per_token format (scales are amax / 127)")
    return INT8_PER_TOKEN


@overload
def dispatch(c: MaskedDispatch) -> MaskedDispatch: ...
@overload
def dispatch(c: ExpandDispatch) -> ExpandDispatch: ...
def dispatch(c: MaskedDispatch | ExpandDispatch) -> MaskedDispatch | ExpandDispatch:
    """A masked or expand ``c`` checked (the flat layout's rules: :func:`.ascend.dispatch`)."""
    e, n, names, masked = c.experts, c.num_max, c.names, isinstance(c, MaskedDispatch)
    x, ids = c.x, c.expert_ids  # (x checked by the front-end: V2 also takes a pre-quantized tuple)
    quant = c.quant if isinstance(c, MaskedDispatch) else None
    if not isinstance(c, ExpandDispatch) or c.cached is None:
        param = names.get("expert_ids", "expert_ids")
        ids = expert_ids(ids, param, e.num_moe_experts, x.shape[0], MAX_TOPK if masked else 32, True)
        if x.shape[0] > n:
            what = f"{x.shape[0]} tokens exceed {names['num_max']} = {n}"
            raise shape(param if masked else "x", f"{what}; raise it (same on all ranks)")
    k, hidden, num_local, w = ids.shape[1], x.shape[1], e.num_local, e.world_size
    weights_param, stats_shape = names.get("expert_scales", "expert_scales"), "[L]" if masked else "[num_local_experts]"
    weights = shaped(c.expert_scales, weights_param, torch.float32, (x.shape[0], k), "[num_tokens, K]")
    stats = shaped(c.recv_stats, names["recv_stats"], torch.int32, (num_local,), stats_shape)
    if quant is not None and hidden % 128:
        raise shape("x", f"hidden = {hidden} must be a multiple of 128 with use_fp8 (per-128-channel scales)")
    if quant is not None and quant.ue8m0 and hidden % 512:
        raise shape("x", f"hidden = {hidden} must be a multiple of 512 with use_ue8m0 (4 scales per int32)")
    if isinstance(c, MaskedDispatch):  # recv_x [L, R * N, hidden] and its int32 src_info
        row_bytes = hidden * (1 if quant else x.element_size()) + (4 * hidden // 128 if quant else 0) + 4
        rows, what = e.num_moe_experts * n, f"recv_x (num_experts={e.num_moe_experts} x N={n} rows of hidden={hidden})"
        param = names["moe_expert_num"] if e.num_moe_experts > n else names["num_max"]
        wait = shaped(c.wait_stats, names["wait_stats"], torch.int64, (w,), "[R]")
        fits(rows * row_bytes, x.device, param, what)
        return dataclasses.replace(c, expert_ids=ids, expert_scales=weights, recv_stats=stats, wait_stats=wait)
    # DeepEP V2's worst case (no CPU sync): R * N rows, expanded: align(R * N * min(K, L) + (a - 1) * L, a)
    row_bytes = hidden * x.element_size() + (0 if c.x_sf is None else 4 * c.x_sf.shape[1]) + 4 * k + 8
    rows = align(w * n * min(k, num_local) + (c.alignment - 1) * num_local, c.alignment) if c.do_expand else w * n
    fits(rows * row_bytes, x.device, names["num_max"], f"recv_x (R * N = {w * n} tokens, K = {k}, hidden = {hidden})")
    return dataclasses.replace(c, expert_ids=ids, expert_scales=weights, recv_stats=stats)


def masked_handle(handle: object, num_ranks: int) -> LowLatencyHandle:
    """``handle`` as a :class:`LowLatencyHandle` (a DeepEP 5-tuple is accepted), its fields checked."""
    if handle is None:
        raise null("handle", "pass the handle returned by low_latency_dispatch")
    if not isinstance(handle, tuple) or len(handle) != 5:
        raise invalid("handle", f"must be the 5-field handle returned by low_latency_dispatch, got {type(handle)}")
    h = handle if isinstance(handle, LowLatencyHandle) else LowLatencyHandle(*handle)
    num_max = count(h.num_max_dispatch_tokens_per_rank, "handle.num_max_dispatch_tokens_per_rank", 1, code="shape")
    n = count(h.num_experts, "handle.num_experts", 1, code="shape")
    count(h.hidden, "handle.hidden", 1, code="shape")
    if n % num_ranks:
        raise shape("handle.num_experts", f"{n} is not divisible by num_ranks = {num_ranks}")
    src_info = tensor(h.src_info, "handle.src_info", (torch.int32,), 2)
    dims(src_info, "handle.src_info", (n // num_ranks, num_ranks * num_max), "[L, R * N]")
    layout_range = tensor(h.layout_range, "handle.layout_range", (torch.int64,), 2)
    dims(layout_range, "handle.layout_range", (n // num_ranks, num_ranks), "[L, R]")
    return h


def combine(c: MaskedCombine) -> MaskedCombine:
    """A masked combine checked (flat: :func:`.ascend.combine`; expand: :func:`.elastic.combine`)."""
    h, names = c.handle, c.names
    r, num_max, hidden = c.experts.world_size, h.num_max_dispatch_tokens_per_rank, h.hidden
    x = tensor(c.x, "x", ACT_DTYPES, 3)
    dims(x, "x", (h.src_info.shape[0], r * num_max, hidden), "[L, R * N, hidden] from the handle")
    if c.logfmt and (x.dtype != torch.bfloat16 or hidden % 128):
        why = f"LogFMT encodes bfloat16 rows in 128-channel groups; got {x.dtype}, hidden = {hidden}"
        raise invalid("use_logfmt", why)
    if c.zero_copy and x.dtype != torch.bfloat16:
        raise invalid("x", f"zero_copy combines the bfloat16 buffer; x must be torch.bfloat16, got {x.dtype}")
    weights = tensor(c.expert_scales, names["expert_scales"], (torch.float32,), 2)
    ids = expert_ids(c.expert_ids, names["expert_ids"], h.num_experts, weights.shape[0], MAX_TOPK, True)
    if ids.shape[0] > num_max:
        what = f"{ids.shape[0]} tokens exceed num_max_dispatch_tokens_per_rank = {num_max}"
        raise shape(names["expert_ids"], f"{what}; raise it (same on all ranks)")
    dims(weights, names["expert_scales"], tuple(ids.shape), "topk_idx's shape")
    out = shaped(c.out, "out", x.dtype, (ids.shape[0], hidden), "[num_tokens, hidden]")
    wait = shaped(c.wait_stats, names["wait_stats"], torch.int64, (r,), "[R]")
    return dataclasses.replace(c, x=x, expert_ids=ids.long(), expert_scales=weights, out=out, wait_stats=wait)
