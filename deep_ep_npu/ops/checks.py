"""Small argument checks that raise :class:`MoeDistributeError` naming the parameter, the value and what is allowed."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .errors import invalid, null, shape


def tensor(value: object, param: str, dtypes: Iterable[torch.dtype], ndim: int | tuple[int, ...]) -> torch.Tensor:
    """Check a required tensor: not None (161001), one of ``dtypes`` (161002), ``ndim`` dims (561002)."""
    if value is None:
        raise null(param)
    return optional_tensor(value, param, dtypes, ndim)


def optional_tensor(
    value: object, param: str, dtypes: Iterable[torch.dtype], ndim: int | tuple[int, ...]
) -> torch.Tensor | None:
    if value is None:
        return None
    if not isinstance(value, torch.Tensor):
        raise invalid(param, f"must be a torch.Tensor, got {type(value).__name__}")
    dtypes = tuple(dtypes)
    if value.dtype not in dtypes:
        raise invalid(param, f"dtype {value.dtype} not supported, allowed {[str(d) for d in dtypes]}")
    dims = (ndim,) if isinstance(ndim, int) else ndim
    if value.dim() not in dims:
        raise shape(param, f"must have {' or '.join(map(str, dims))} dims, got shape {tuple(value.shape)}")
    return value


def dims(value: torch.Tensor, param: str, expected: tuple[int, ...], what: str) -> None:
    if tuple(value.shape) != tuple(expected):
        raise shape(param, f"shape {tuple(value.shape)} does not match {what} {tuple(expected)}")


def in_range(value: int, param: str, lo: int, hi: int, code: str = "shape") -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise invalid(param, f"must be an int, got {type(value).__name__} {value!r}")
    if not lo <= value <= hi:
        err = shape if code == "shape" else invalid
        raise err(param, f"got {value}, allowed [{lo}, {hi}]")
    return value


def one_of(value: object, param: str, allowed: Iterable[object], why: str = "") -> object:
    allowed = tuple(allowed)
    if value not in allowed:
        raise invalid(param, f"got {value!r}, allowed {list(allowed)}{'; ' + why if why else ''}")
    return value


def expert_ids(ids: torch.Tensor, param: str, num_ids: int, num_tokens: int, max_topk: int = 16) -> int:
    """Check `[Bs, K]` ids: ``0 < K <= max_topk``, values in ``[0, num_ids)``, no id repeated within a row."""
    if ids.shape[0] != num_tokens:
        raise shape(param, f"has {ids.shape[0]} rows but x has {num_tokens} tokens")
    k = ids.shape[1]
    if not 0 < k <= max_topk:
        raise shape(param, f"top-k (dim 1) is {k}, allowed (0, {max_topk}]")
    if ids.numel():
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= num_ids:
            bad = lo if lo < 0 else hi
            raise shape(param, f"contains expert id {bad}, allowed [0, {num_ids}) (moe + zero + copy + const experts)")
        if k > 1:
            srt = ids.sort(dim=1).values
            dup = (srt[:, 1:] == srt[:, :-1]).any(dim=1)
            if bool(dup.any()):
                t = int(dup.nonzero()[0, 0])
                raise shape(param, f"row {t} repeats an expert id ({ids[t].tolist()}); ids must be distinct per token")
    return k


def active_mask(mask: torch.Tensor | None, param: str, num_tokens: int, topk: int) -> None:
    """`x_active_mask`: bool `[Bs]` whose True entries form a prefix, or bool `[Bs, K]`."""
    if mask is None:
        return
    if mask.dim() == 1:
        if mask.shape[0] != num_tokens:
            raise shape(param, f"1D mask has {mask.shape[0]} entries, expected Bs = {num_tokens}")
        n = int(mask.sum())
        if n and not bool(mask[:n].all()):
            raise shape(param, "a 1D mask must mark a prefix of active tokens (all True entries first)")
    elif tuple(mask.shape) != (num_tokens, topk):
        raise shape(param, f"2D mask shape {tuple(mask.shape)} does not match (Bs, K) = ({num_tokens}, {topk})")


def performance_info(value: object, world_size: int) -> torch.Tensor | None:
    """`performance_info`: None or `[W]` `torch.int64`, accumulated in place by the op."""
    perf = optional_tensor(value, "performance_info", (torch.int64,), 1)
    if perf is not None:
        dims(perf, "performance_info", (world_size,), "(ep_world_size,)")
    return perf
