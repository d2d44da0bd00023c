"""Fused CPU loops for the engine's per-call work on CPU tensors (planning, packing, placement, gathers and sums), each
one pass where the torch code takes several ops, with bit-identical results. They are C (``loops.c``), built into
``deep_ep_npu.kernels._cpu`` when the package is installed (nothing compiles at import or run time), behind bindings
that check every argument (``_cpu.c``: a wrong call raises instead of touching memory). The torch code stays the
general path: every wrapper returns False / None where it does not apply, having done nothing (the packers' NaN case
excepted). ``DEEP_EP_NPU_CPU_KERNELS=0`` turns them off, :func:`disabled` for a block; a missing extension warns once
per process, at the first CPU call that would use it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import warnings
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from .. import envs

DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
"""The C side's dtype codes."""
I32, I64, U8, F32 = torch.int32, torch.int64, torch.uint8, torch.float32

_EXTENSION = f"{__package__}._cpu"
try:
    _built: ModuleType | None = importlib.import_module(_EXTENSION)
    _missing = ""
except ImportError as err:
    _built, _missing = None, f"the extension {_EXTENSION} is not built ({err}); reinstall the package: pip install ."
_enabled, _warned = True, False


@functools.cache
def _turned_on() -> bool:
    return envs.cpu_kernels()  # (read once per process)


def library() -> ModuleType | None:
    """The built kernels, or None when they are off or missing (the first call that finds them missing warns)."""
    global _warned
    if not _enabled or not _turned_on():
        return None
    if _built is None and not _warned:
        _warned = True
        warnings.warn(f"deep_ep_npu: CPU tensors take the slower torch code: {_missing}", RuntimeWarning, stacklevel=3)
    return _built


def unavailable() -> str:
    """ "" when the kernels are in use, else why not."""
    if not _turned_on():
        return "DEEP_EP_NPU_CPU_KERNELS=0"
    return _missing or ("" if _enabled else "turned off by kernels.disabled()")


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Run the torch code instead of the kernels inside this block (this process)."""
    global _enabled
    before, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = before


def _cpu(*tensors: Tensor) -> bool:
    return all(t.is_cpu and t.is_contiguous() for t in tensors)


def _summing(dtype: torch.dtype) -> ModuleType | None:
    """The kernels when the sums and packers take rows of ``dtype``."""
    lib = library() if dtype in DTYPES else None
    return lib if lib is not None and lib.has_dtype(DTYPES[dtype]) else None


def accumulate(
    acc: Tensor, x: Tensor, index: Tensor | None, token: Tensor, weight: Tensor, zero_first: bool = False
) -> bool:
    """``acc[token[i]] += weight[i] * x[index[i]]`` (``x[i]`` without ``index``) for i in order, in fp32 (with
    ``zero_first``, ``acc`` is zeroed first): ``acc`` `[T, hidden]` fp32, ``x`` `[rows, hidden]` fp32 / bf16 / fp16
    (rows contiguous), ``index`` / ``token`` `[n]` int64, ``weight`` `[n]` fp32. IndexError for one out of range."""
    if x.dim() != 2 or x.stride(1) != 1 or not x.is_cpu or acc.shape[1] != x.shape[1] or acc.dtype != F32:
        return False
    if not _cpu(acc, token, weight) or token.dtype != I64:
        return False
    if (index is not None and (not _cpu(index) or index.dtype != I64)) or (lib := _summing(x.dtype)) is None:
        return False
    lib.accumulate(
        acc,
        acc.shape[0],
        acc.shape[1],
        x,
        DTYPES[x.dtype],
        index,
        token,
        weight.float().contiguous(),
        token.numel(),
        int(zero_first),
    )
    return True


def accumulate_rows(
    acc: Tensor, rows: list[tuple[Tensor, Tensor | None]], order: Tensor, token: Tensor, weight: Tensor
) -> bool:
    """``acc = 0``, then ``acc[token[i]] += weight[i] * y[order[i]]`` for i in order, in fp32, where ``y`` is the rows
    of each ``(x, index)`` of ``rows`` one after another: ``x[index]`` (``x`` `[*, hidden]` fp32 / bf16 / fp16, one
    dtype, rows contiguous; ``index`` `[k]` int64, or None: all rows). ``acc`` `[T, hidden]` fp32; ``order`` / ``token``
    `[n]` int64; ``weight`` `[n]` fp32. IndexError for an index, order entry or token out of range."""
    if acc.dtype != F32 or (found := _row_sums(acc, rows, order, token)) is None:
        return False
    lib, dtype = found
    lib.accumulate_rows(
        acc, acc.shape[0], acc.shape[1], DTYPES[dtype], rows, order, token, weight.float().contiguous(), order.numel()
    )
    return True


def sum_tokens(
    out: Tensor, rows: list[tuple[Tensor, Tensor | None]], order: Tensor, token: Tensor, weight: Tensor
) -> bool:
    """:func:`accumulate_rows` into an fp32 zeros tensor, then its cast to ``out`` `[T, hidden]` (fp32 / bf16), in one
    pass over ``out`` (no fp32 `[T, hidden]` tensor): ``out[t]`` = the fp32 sum of ``weight[i] * y[order[i]]`` over
    the i with ``token[i] == t``, in order, rounded once (NaN as torch's CPU cast writes it); 0 for a token without
    any. ``token`` must be non-decreasing. IndexError for an index, order entry or token out of range or order."""
    if out.dtype not in (F32, torch.bfloat16) or (found := _row_sums(out, rows, order, token)) is None:
        return False
    lib, dtype = found
    lib.sum_tokens(
        out,
        out.shape[0],
        out.shape[1],
        DTYPES[out.dtype],
        DTYPES[dtype],
        rows,
        order,
        token,
        weight.float().contiguous(),
        order.numel(),
    )
    return True


def _row_sums(
    out: Tensor, rows: list[tuple[Tensor, Tensor | None]], order: Tensor, token: Tensor
) -> tuple[ModuleType, torch.dtype] | None:
    """The kernels and the rows' dtype when :func:`accumulate_rows` / :func:`sum_tokens` take these tensors."""
    dtypes = {x.dtype for x, _ in rows}
    if len(dtypes) > 1 or not _cpu(out, order, token) or out.dim() != 2 or token.dtype != I64 or order.dtype != I64:
        return None
    for x, index in rows:
        if x.dim() != 2 or x.shape[1] != out.shape[1] or x.stride(1) != 1 or not x.is_cpu:
            return None
        if index is not None and (not _cpu(index) or index.dtype != I64):
            return None
    dtype = dtypes.pop() if dtypes else F32
    lib = _summing(dtype)
    return None if lib is None else (lib, dtype)


def place(
    rows: Tensor,
    data_bytes: int,
    token_off: int,
    slot_off: int,
    num_slots: int,
    recv: Tensor,
    src_info: Tensor,
    pos: Tensor,
    counts: Tensor,
    src: int,
    pairs: Tensor,
) -> int | None:
    """Expand dispatch ``rows`` `[n, row_bytes]` uint8 of source ``src`` into ``recv`` `[L, cap, *]` (``data_bytes``
    per row) and ``src_info`` `[L, cap]` int32 from row ``pos[e]`` of each expert on (``pos`` `[L]` int64 and
    ``counts`` `[L, R]` int64 grow), each pair's (row, flat position) into ``pairs`` `[2, >= n * num_slots]` int64.
    Returns the number of pairs."""
    if not _cpu(rows, recv, src_info, pos, counts, pairs) or rows.dtype != U8 or (lib := library()) is None:
        return None
    n, row_bytes = rows.shape
    return lib.place(
        rows,
        n,
        row_bytes,
        data_bytes,
        token_off,
        slot_off,
        num_slots,
        *_blocks(src, recv, src_info, pos, counts),
        pairs,
    )


def _blocks(src: int, recv: Tensor, src_info: Tensor, pos: Tensor, counts: Tensor) -> tuple[int | Tensor, ...]:
    """The arguments of :func:`place` and :func:`place_pairs` that say where the expert blocks are."""
    num_local, cap = src_info.shape
    return num_local, cap, counts.shape[1], src, recv, src_info, pos, counts


def ids_ok(ids: Tensor, lo: int, hi: int) -> bool | None:
    """Whether every id of ``ids`` `[n, k]` int64 is in ``[lo, hi)`` with no id >= 0 twice in a row."""
    if ids.dtype != I64 or ids.dim() != 2 or not _cpu(ids) or (lib := library()) is None:
        return None
    return lib.check_ids(ids, ids.shape[0], ids.shape[1], lo, hi)


def plan(
    ids: Tensor, num_local: int, num_ranks: int, rank: int, mask: Tensor, per_pair_rows: bool
) -> tuple[Any, ...] | None:
    """:func:`~deep_ep_npu.engine.plan.plan_topk`'s parts from valid ``ids`` `[T, K]` int64 (``mask`` `[R]`): (token,
    slot, dest, expert, pairs_per_dest (list), row_token, row_of_pair, rows_per_dest (list), slot_expert `[rows, K]`
    int32 or None)."""
    if ids.dtype != I64 or ids.dim() != 2 or not _cpu(ids) or not mask.is_cpu or (lib := library()) is None:
        return None
    t, k = ids.shape
    p, r = t * k, num_ranks
    buf = torch.empty((6 * p + 2 * r + r * (num_local + t),), dtype=I64)  # pairs, counts, scratch
    slot_expert = None if per_pair_rows else torch.empty((p, k), dtype=I32)
    n, rows = lib.plan(ids, t, k, num_local, r, rank, mask.to(U8).contiguous(), int(per_pair_rows), buf, slot_expert)
    counts = buf[6 * p : 6 * p + 2 * r].tolist()
    token, slot, dest, expert, row_token, row_of_pair = (buf[i * p : i * p + (rows if i == 4 else n)] for i in range(6))
    table = None if slot_expert is None else slot_expert[:rows]
    return token, slot, dest, expert, counts[:r], row_token, row_of_pair, counts[r:], table


def _packs(x: Tensor, row_token: Tensor, slot_expert: Tensor, out: Tensor) -> bool:
    """Whether a packer takes these tensors."""
    return (
        x.dim() == 2
        and _cpu(x, row_token, slot_expert, out)
        and row_token.dtype == I64
        and (slot_expert.dtype == I32 and out.dtype == U8)
    )


def pack(
    x: Tensor, row_token: Tensor, slot_expert: Tensor, out: Tensor, token_off: int, slot_off: int, streaming: bool
) -> bool:
    """Dispatch rows without quantization or weights: ``out`` `[n, row_bytes]` uint8 gets the data of ``x[row_token]``
    (``x`` `[T, hidden]`), the token and ``slot_expert`` `[n, K]` int32 (``streaming``: past this core's cache, for
    rows another process reads)."""
    if not _packs(x, row_token, slot_expert, out) or (lib := library()) is None:
        return False
    n, k = slot_expert.shape
    lib.pack(
        x,
        x.shape[0],
        x.shape[1] * x.element_size(),
        row_token,
        slot_expert,
        n,
        k,
        out,
        out.shape[1],
        token_off,
        slot_off,
        int(streaming),
    )
    return True


def pack_int8(x: Tensor, row_token: Tensor, slot_expert: Tensor, weights: Tensor | None, out: Tensor, fmt: Any) -> bool:
    """Dispatch rows of ``fmt`` (a :class:`~deep_ep_npu.engine.rows.RowFormat` with per-token int8, no smoothing):
    ``out`` `[n, row_bytes]` uint8 gets :func:`~deep_ep_npu.quant.per_token_int8` of ``x[row_token]`` (``x`` `[T,
    hidden]` fp32 / bf16 / fp16) and its scale, the token, ``slot_expert`` `[n, K]` int32 and ``weights`` `[n, K]`
    fp32 (or None), bit for bit. False also for a row holding NaN, with ``out`` partly written (the torch code writes
    all of it). IndexError for a token outside ``x``."""
    if weights is not None and (not _cpu(weights) or weights.dtype != F32):
        return False
    if not _packs(x, row_token, slot_expert, out) or (lib := _summing(x.dtype)) is None:
        return False
    return lib.pack_int8(*_quantized(x, row_token, slot_expert, out, fmt), weights, fmt.weight_off)


def pack_fp8(x: Tensor, row_token: Tensor, slot_expert: Tensor, out: Tensor, fmt: Any) -> bool:
    """Dispatch rows of ``fmt`` (a :class:`~deep_ep_npu.engine.rows.RowFormat` in DeepEP's fp8, scales not rounded, no
    weights): ``out`` `[n, row_bytes]` uint8 gets the e4m3 data and per-128-channel scales of ``x[row_token]`` (``x``
    `[T, hidden]` fp32 / bf16 / fp16, ``hidden % 128 == 0``: :func:`~deep_ep_npu.quant.scale_for_fp8_` and the cast),
    the token and ``slot_expert`` `[n, K]` int32, bit for bit. False also for a group holding NaN / Inf, with ``out``
    partly written (the torch code writes all of it). IndexError for a token outside ``x``."""
    if x.dim() != 2 or x.shape[1] % 128 or not _packs(x, row_token, slot_expert, out):
        return False
    if (lib := _summing(x.dtype)) is None:
        return False
    return lib.pack_fp8(*_quantized(x, row_token, slot_expert, out, fmt))


def _quantized(x: Tensor, row_token: Tensor, slot_expert: Tensor, out: Tensor, fmt: Any) -> tuple[Tensor | int, ...]:
    """The arguments :func:`pack_int8` and :func:`pack_fp8` share: the tokens, the rows and where their fields sit."""
    (t, hidden), (n, k), where = x.shape, slot_expert.shape, (out.shape[1], fmt.scale_off, fmt.token_off, fmt.slot_off)
    return x, t, DTYPES[x.dtype], hidden, row_token, slot_expert, n, k, out, *where


def to_e4m3(x: Tensor) -> Tensor | None:
    """The kernels' float -> float8 e4m3fn cast of ``x`` (fp32, contiguous, CPU) as `torch.uint8` bits."""
    if x.dtype != F32 or not _cpu(x) or (lib := library()) is None:
        return None
    out = torch.empty(x.shape, dtype=U8)
    lib.to_e4m3(x, x.numel(), out)
    return out


def gather(x: Tensor, index: Tensor, out: Tensor) -> bool:
    """``out[i] = x[index[i]]`` (``x`` `[rows, *]` and ``out`` `[n, *]` with contiguous rows, any row stride:
    e.g. the first columns of wider rows; ``index`` `[n]` int64 < rows) with streaming stores (rows another process
    reads, or rows past this core's cache). IndexError for an index outside ``x``."""
    if not _cpu(index) or index.dtype != I64 or x.dtype != out.dtype or not (x.is_cpu and out.is_cpu):
        return False
    if any(t.dim() != 2 or t.stride(1) != 1 or t.stride(0) < t.shape[1] for t in (x, out)):
        return False
    if out.shape != (index.numel(), x.shape[1]) or (lib := library()) is None:
        return False
    lib.gather(x, x.shape[0], x.shape[1] * x.element_size(), index, index.numel(), out)
    return True


def place_scales(
    rows: Tensor, scale_off: int, pair_row: Tensor, pair_pos: Tensor, scales: Tensor, repeat: bool
) -> bool:
    """The masked layout's fp32 scales of the pairs :func:`place` placed: pair i (row ``pair_row[i]`` of ``rows``
    `[n, row_bytes]` uint8, flat position ``pair_pos[i]`` = expert * cap + row, `[k]` int64) gets its row's scales (at
    ``scale_off``: one per group, or with ``repeat`` one for every group) in ``scales`` `[L, cap, groups]` fp32, a
    transposed view of `[L, groups, cap]` storage (DeepEP's). IndexError for a pair outside the rows or the layout."""
    if not _cpu(rows, pair_row, pair_pos) or scales.dtype != F32 or not scales.is_cpu:
        return False
    num_local, cap, groups = scales.shape
    if scales.stride() != (groups * cap, 1, cap) or rows.dtype != U8 or pair_row.dtype != I64 or pair_pos.dtype != I64:
        return False
    if (lib := library()) is None:
        return False
    lib.place_scales(
        rows,
        rows.shape[0],
        rows.shape[1],
        scale_off,
        pair_row,
        pair_pos,
        pair_row.numel(),
        scales.transpose(1, 2),
        num_local,
        cap,
        groups,
        int(repeat),
    )
    return True


def place_pairs(
    x: Tensor, token: Tensor, expert: Tensor, recv: Tensor, src_info: Tensor, pos: Tensor, counts: Tensor, src: int
) -> bool:
    """:func:`place` of this rank's own pairs straight from ``x`` `[T, hidden]` (no packed rows): pair i (``token``
    / local ``expert`` `[n]` int64, sorted by (expert, token)) into ``recv`` / ``src_info`` from ``pos[e]`` on.
    IndexError for a token outside ``x``."""
    if not _cpu(x, token, expert, recv, src_info, pos, counts) or x.dim() != 2 or x.dtype != recv.dtype:
        return False
    if token.dtype != I64 or expert.dtype != I64 or (lib := library()) is None:
        return False
    row_bytes = x.shape[1] * x.element_size()
    lib.place_pairs(x, x.shape[0], row_bytes, token, expert, token.numel(), *_blocks(src, recv, src_info, pos, counts))
    return True


def layout_range(counts: Tensor, rank: int, out: Tensor, recv_count: Tensor) -> bool:
    """The masked layout's ``layout_range`` `[L, R]` int64 (``out``) and ``recv_count`` `[L]` int32 from the rows
    placed per (local expert, source) ``counts`` `[L, R]` int64 (this rank's block first, then the others by rank)."""
    if not _cpu(counts, out, recv_count) or counts.dtype != I64 or out.dtype != I64 or recv_count.dtype != I32:
        return False
    if (lib := library()) is None:
        return False
    lib.layout_range(counts, counts.shape[0], counts.shape[1], rank, out, recv_count)
    return True


def return_rows(layout_range: Tensor, n: int, mask: Tensor) -> tuple[Tensor, list[int]] | int | None:
    """Combine's rows of the flattened `[L * R * N]` expert output per source (by source, expert, row) from
    ``layout_range`` `[L, R]` int64, none to sources masked in ``mask`` `[R]`, and their counts per source; or the
    flat index of the first block outside ``[0, R * N)``."""
    if not _cpu(layout_range) or layout_range.dtype != I64 or not mask.is_cpu or (lib := library()) is None:
        return None
    num_local, r = layout_range.shape
    rows, per_src = torch.empty((num_local * r * n,), dtype=I64), torch.empty((r,), dtype=I64)
    k = lib.return_rows(layout_range, num_local, r, n, mask.to(U8).contiguous(), rows, per_src)
    return -1 - k if k < 0 else (rows[:k], per_src.tolist())


def place_flat(
    blocks: list[tuple[int, Tensor]],
    fmt: Any,
    scale_bytes: int,
    weights: bool,
    counts: Tensor,
    expand_x: Tensor,
    scales: Tensor,
    assist: Tensor,
    expand_scales: Tensor,
) -> int | None:
    """The flat layout's placement (:meth:`~deep_ep_npu.engine.flat.Flat.place_remote`) of dispatch rows ``blocks``
    (``(source, rows)``: ``rows`` `[n, row_bytes]` uint8 in ``fmt``, a :class:`~deep_ep_npu.engine.rows.RowFormat`):
    data into ``expand_x`` `[cap, *]`, ``scale_bytes`` of scales per row into ``scales`` `[cap, scale_bytes]` uint8
    (none when 0), (source, token, slot) into ``assist`` `[>= 3 cap]` int32, the slot weights (``weights``) into
    ``expand_scales`` `[cap]` fp32, and the pairs per (local expert, source) into ``counts`` `[L, R]` int64. Returns
    the number of pairs, or -1 when they exceed cap (only counts is written)."""
    if not _cpu(counts, expand_x, assist) or any(r.dtype != U8 or not _cpu(r) for _, r in blocks):
        return None
    if counts.dtype != I64 or assist.dtype != I32 or (weights and not _cpu(expand_scales)):
        return None
    if (lib := library()) is None:
        return None
    (num_local, num_ranks), cap = counts.shape, expand_x.shape[0]
    k = lib.place_flat(
        blocks,
        fmt.row_bytes,
        fmt.data_bytes,
        fmt.scale_off,
        scale_bytes,
        fmt.token_off,
        fmt.slot_off,
        fmt.num_slots,
        fmt.weight_off if weights else -1,
        num_local,
        num_ranks,
        cap,
        expand_x,
        scales if scale_bytes else None,
        assist,
        expand_scales if weights else None,
        counts,
    )
    return -1 if k == -2 else k
