"""The one exception type of the library's argument checks, with the aclnn status code of the matching NPU failure, and
the checks themselves: each raises :class:`MoeDistributeError` naming the parameter, the value and what is allowed."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping

import torch

from . import kernels as cpu_kernels

ACLNN_ERR_PARAM_NULLPTR = 161001  # a required tensor or argument is missing (None)
ACLNN_ERR_PARAM_INVALID = 161002  # a dtype or a parameter value is not supported
ACLNN_ERR_INNER_TILING_ERROR = 561002  # a shape, or a value derived from shapes, is out of range (or CCL too small)
_Ndim = int | tuple[int, ...]
ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # activations off the NPU (it takes bf16 / fp16)
MAX_TOPK = 16  # top-k limit of the ops, DeepEP's low-latency kernels and MegaMoE


class MoeDistributeError(ValueError):
    """Invalid input to a MoE distribute op, the Buffer or MegaMoE. ``code`` is the aclnn status the NPU op returns
    for the same input (161001 null, 161002 invalid dtype or parameter, 561002 shape or value); ``param`` names the
    offending parameter."""

    def __init__(self, code: int, param: str, message: str) -> None:
        super().__init__(f"[aclnn {code}] {param}: {message}")
        self.code, self.param, self.detail = code, param, message

    def renamed(self, names: Mapping[str, str]) -> MoeDistributeError:
        """The same error naming the caller's parameter: ``names`` maps the op's parameter names to the caller's."""
        return MoeDistributeError(self.code, names.get(self.param, self.param), self.detail)


invalid = functools.partial(MoeDistributeError, ACLNN_ERR_PARAM_INVALID)  # invalid(param, message)
shape = functools.partial(MoeDistributeError, ACLNN_ERR_INNER_TILING_ERROR)  # shape(param, message)


def null(param: str, what: str = "is required") -> MoeDistributeError:
    return MoeDistributeError(ACLNN_ERR_PARAM_NULLPTR, param, f"must not be None ({what})")


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


def one_of(value: object, param: str, allowed: Iterable[object], why: str = "") -> object:
    if value not in (allowed := tuple(allowed)):
        raise invalid(param, f"got {value!r}, allowed {list(allowed)}{'; ' + why if why else ''}")
    return value


def prefix_mask(mask: torch.Tensor, num_tokens: int) -> int:
    """How many tokens a 1D ``x_active_mask`` `[num_tokens]` bool marks active; it must mark a prefix."""
    if mask.shape[0] != num_tokens:
        raise shape("x_active_mask", f"1D mask has {mask.shape[0]} entries, expected Bs = {num_tokens}")
    if (n := int(mask.sum())) and not bool(mask[:n].all()):
        raise shape("x_active_mask", "a 1D mask must mark a prefix of active tokens (all True entries first)")
    return n


def flag(value: object, param: str) -> bool:
    if not isinstance(value, bool):
        raise invalid(param, f"must be a bool, got {type(value).__name__} {value!r}")
    return value


def expert_ids(ids: object, param: str, num_ids: int, num_tokens: int, max_topk: int, no_expert: bool,
               what: str = "", active: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """The top-k rule: `[num_tokens, K]` int32 / int64, ``0 < K <= max_topk``, every id in ``[0, num_ids)`` (or -1,
    "no expert", when ``no_expert``), no id twice in a row. Checked on the given dtype, before any cast, and only
    where ``active`` (`[num_tokens, K]` bool, None: everywhere) is True: excluded entries may hold anything."""
    t = tensor(ids, param, (torch.int32, torch.int64), 2)
    k = t.shape[1]
    if t.shape[0] != num_tokens:
        raise shape(param, f"has {t.shape[0]} rows but x has {num_tokens} tokens")
    if not 0 < k <= max_topk:
        raise shape(param, f"top-k (dim 1) is {k}, allowed (0, {max_topk}]")
    if active is None and cpu_kernels.ids_ok(t, -1 if no_expert else 0, num_ids):  # (one pass; else as below)
        return t
    if active is not None:  # excluded entries read -1: neither range-checked nor duplicates
        t = t.masked_fill(~active, -1)
    if (vals := t if active is None else t[active]).numel():
        lo, hi, floor = int(vals.min()), int(vals.max()), -1 if no_expert else 0
        if lo < floor or hi >= num_ids:
            allowed = f"[0, {num_ids}){what}" + (" or -1 (no expert)" if no_expert else "")
            raise shape(param, f"contains {lo if lo < floor else hi}, allowed {allowed}")
        if k > 1:
            srt = t.sort(dim=1).values
            dup = ((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)).any(dim=1)
            if bool(dup.any()):
                row = int(dup.nonzero()[0, 0])
                raise shape(
                    param, f"row {row} lists an expert twice ({t[row].tolist()}); ids must be distinct per token"
                )
    return t
