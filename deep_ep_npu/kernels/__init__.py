"""Fused CPU loops for the engine's per-call work on CPU tensors: the plan of ``topk_idx`` and its id check; dispatch
row packing, with Ascend's per-token int8 and DeepEP's fp8 quantization; DeepEP's masked placement (this rank's own
pairs straight from ``x``), its scales and block table; the flat (Ascend) placement; combine's return rows, the
gather of combine rows into a peer's window, the weighted fp32 reduction and the flat combine's slot-ordered sum.

Each is one pass where the torch code takes several ops (gather, convert, scale, scatter-add, sorts), and the results
are bit-identical to it (the same roundings in the same order). The loops are C (``loops.c``), built into the
extension module ``deep_ep_npu.kernels._cpu`` when the package is installed (``setup.py``; nothing compiles at
import or run time), behind bindings that check every argument (``_cpu.c``: a wrong call raises instead of touching
memory it should not). The torch code stays the device-generic path: other devices, other quantized rows, rows
holding NaN. Every wrapper returns False / None where it does not apply, having done nothing (the packing wrappers'
NaN case excepted: see them).

Loading them, turning them off and what happens when they are missing: :mod:`.loader`.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from . import loader
from .loader import disabled, unavailable

__all__ = ["DTYPES", "disabled", "library", "unavailable"]  # (the loader's, re-exported: callers use this package)

DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
"""The C side's dtype codes."""


def library() -> ModuleType | None:
    """The built kernels, or None when they are off or missing (the first call that finds them missing warns)."""
    if not loader.enabled[0] or not loader.turned_on():
        return None
    if loader.built is None:
        loader.missing()
    return loader.built


def _cpu(*tensors: torch.Tensor) -> bool:
    return all(t.is_cpu and t.is_contiguous() for t in tensors)


def _summing(dtype: torch.dtype) -> ModuleType | None:
    """The kernels when they take rows of ``dtype``."""
    lib = library() if dtype in DTYPES else None
    return lib if lib is not None and lib.has_dtype(DTYPES[dtype]) else None


def accumulate(acc: torch.Tensor, x: torch.Tensor, index: torch.Tensor | None, token: torch.Tensor,
               weight: torch.Tensor, zero_first: bool = False) -> bool:  # fmt: skip
    """``acc[token[i]] += weight[i] * x[index[i]]`` (``x[i]`` without ``index``) for i in order, in fp32 (with
    ``zero_first``, ``acc`` is zeroed first): ``acc`` `[T, hidden]` fp32, ``x`` `[rows, hidden]` (fp32 / bf16 /
    fp16, rows contiguous), ``index`` / ``token`` `[n]` int64, ``weight`` `[n]` fp32. Returns False (nothing done)
    where the kernels do not apply: the caller runs torch. Raises IndexError for an index or token out of range."""
    if x.dim() != 2 or x.stride(1) != 1 or x.device.type != "cpu" or acc.shape[1] != x.shape[1]:
        return False
    if not _cpu(acc, token, weight) or token.dtype != torch.int64 or acc.dtype != torch.float32:
        return False
    if index is not None and (not _cpu(index) or index.dtype != torch.int64):
        return False
    if (lib := _summing(x.dtype)) is None:
        return False
    weight = weight.float().contiguous()  # (exact: torch multiplies in fp32 too)
    lib.accumulate(acc, acc.shape[0], acc.shape[1], x, DTYPES[x.dtype], index, token, weight, token.numel(),
                   int(zero_first))  # fmt: skip
    return True


def accumulate_rows(acc: torch.Tensor, rows: list[tuple[torch.Tensor, torch.Tensor | None]], order: torch.Tensor,
                    token: torch.Tensor, weight: torch.Tensor) -> bool:  # fmt: skip
    """``acc = 0``, then ``acc[token[i]] += weight[i] * y[order[i]]`` for i in order, in fp32, where ``y`` is the
    rows of ``rows`` one after another: each ``(x, index)`` gives ``x[index]`` (``x`` `[*, hidden]` fp32 / bf16 /
    fp16, all of one dtype, rows contiguous; ``index`` `[k]` int64, or None: all of ``x``'s rows). ``acc`` `[T,
    hidden]` fp32; ``order`` / ``token`` `[n]` int64; ``weight`` `[n]` fp32. Returns False (nothing done) where the
    kernels do not apply. Raises IndexError for an index, order entry or token out of range."""
    dtypes = {x.dtype for x, _ in rows}
    if len(dtypes) > 1 or not _cpu(acc, order, token) or acc.dtype != torch.float32:
        return False
    if token.dtype != torch.int64 or order.dtype != torch.int64:
        return False
    for x, index in rows:
        if x.dim() != 2 or x.shape[1] != acc.shape[1] or x.stride(1) != 1 or not x.is_cpu:
            return False
        if index is not None and (not _cpu(index) or index.dtype != torch.int64):
            return False
    dtype = dtypes.pop() if dtypes else torch.float32
    if (lib := _summing(dtype)) is None:
        return False
    lib.accumulate_rows(acc, acc.shape[0], acc.shape[1], DTYPES[dtype], rows, order, token, weight.float().contiguous(),
                        order.numel())  # fmt: skip
    return True


def place(rows: torch.Tensor, data_bytes: int, token_off: int, slot_off: int, num_slots: int, recv: torch.Tensor,
          src_info: torch.Tensor, pos: torch.Tensor, counts: torch.Tensor, src: int,
          pairs: torch.Tensor) -> int | None:  # fmt: skip
    """Expand dispatch ``rows`` `[n, row_bytes]` uint8 of source ``src`` into ``recv`` `[L, cap, *]` (``data_bytes``
    per row) and ``src_info`` `[L, cap]` int32 from row ``pos[e]`` of each expert on (``pos`` `[L]` int64 and
    ``counts`` `[L, R]` int64 grow), writing each pair's (row, flat position) into ``pairs`` `[2, >= n * num_slots]`
    int64. Returns the number of pairs, or None where the kernels do not apply (nothing done)."""
    if not _cpu(rows, recv, src_info, pos, counts, pairs) or rows.dtype != torch.uint8 or (lib := library()) is None:
        return None
    num_local, cap = src_info.shape
    return lib.place(rows, rows.shape[0], rows.shape[1], data_bytes, token_off, slot_off, num_slots, num_local, cap,
                     counts.shape[1], src, recv, src_info, pos, counts, pairs)  # fmt: skip


def ids_ok(ids: torch.Tensor, lo: int, hi: int) -> bool | None:
    """Whether every id of ``ids`` `[n, k]` int64 is in ``[lo, hi)`` with no id >= 0 twice in a row; None where the
    kernels do not apply (the caller checks with torch)."""
    if ids.dtype != torch.int64 or ids.dim() != 2 or not _cpu(ids) or (lib := library()) is None:
        return None
    return lib.check_ids(ids, ids.shape[0], ids.shape[1], lo, hi)


def plan(ids: torch.Tensor, num_local: int, num_ranks: int, rank: int, mask: torch.Tensor,
         per_pair_rows: bool) -> tuple[Any, ...] | None:  # fmt: skip
    """:func:`~deep_ep_npu.engine.plan.plan_topk`'s parts from valid ``ids`` `[T, K]` int64 (``mask`` `[R]`): (token,
    slot, dest, expert, pairs_per_dest (list), row_token, row_of_pair, rows_per_dest (list), slot_expert `[rows, K]`
    int32 or None), or None where the kernels do not apply."""
    if ids.dtype != torch.int64 or ids.dim() != 2 or not _cpu(ids) or mask.device.type != "cpu":
        return None
    if (lib := library()) is None:
        return None
    t, k = ids.shape
    p, r = t * k, num_ranks
    buf = torch.empty((6 * p + 2 * r + r * (num_local + t),), dtype=torch.int64)  # pairs, counts, scratch
    slot_expert = None if per_pair_rows else torch.empty((p, k), dtype=torch.int32)
    m = mask.to(torch.uint8).contiguous()
    n, rows = lib.plan(ids, t, k, num_local, r, rank, m, int(per_pair_rows), buf, slot_expert)
    counts = buf[6 * p : 6 * p + 2 * r].tolist()
    token, slot, dest, expert, row_token, row_of_pair = (buf[i * p : i * p + (rows if i == 4 else n)] for i in range(6))
    table = None if slot_expert is None else slot_expert[:rows]
    return token, slot, dest, expert, counts[:r], row_token, row_of_pair, counts[r:], table


def pack(x: torch.Tensor, row_token: torch.Tensor, slot_expert: torch.Tensor, out: torch.Tensor, token_off: int,
         slot_off: int, streaming: bool) -> bool:  # fmt: skip
    """Dispatch rows without quantization or weights: ``out`` `[n, row_bytes]` uint8 gets the data of ``x[row_token]``
    (``x`` `[T, hidden]`), the token and ``slot_expert`` `[n, K]` int32 (``streaming``: past this core's cache, for
    rows another process reads). False (nothing done) where the kernels do not apply."""
    if not _cpu(x, row_token, slot_expert, out) or x.dim() != 2 or row_token.dtype != torch.int64:
        return False
    if slot_expert.dtype != torch.int32 or out.dtype != torch.uint8 or (lib := library()) is None:
        return False
    n, k = slot_expert.shape
    lib.pack(x, x.shape[0], x.shape[1] * x.element_size(), row_token, slot_expert, n, k, out, out.shape[1], token_off,
             slot_off, int(streaming))  # fmt: skip
    return True


def _quantizing(x: torch.Tensor, row_token: torch.Tensor, slot_expert: torch.Tensor,
                out: torch.Tensor) -> ModuleType | None:  # fmt: skip
    """The kernels when a quantizing packer applies to these tensors."""
    if x.dim() != 2 or not _cpu(x, row_token, slot_expert, out) or out.dtype != torch.uint8:
        return None
    if row_token.dtype != torch.int64 or slot_expert.dtype != torch.int32:
        return None
    return _summing(x.dtype)


def pack_int8(x: torch.Tensor, row_token: torch.Tensor, slot_expert: torch.Tensor, weights: torch.Tensor | None,
              out: torch.Tensor, fmt: Any) -> bool:  # fmt: skip
    """Dispatch rows of ``fmt`` (a :class:`~deep_ep_npu.engine.rows.RowFormat` with per-token int8 quantization) with
    no smoothing: ``out`` `[n, row_bytes]` uint8 gets :func:`~deep_ep_npu.quant.per_token_int8` of ``x[row_token]``
    (``x`` `[T, hidden]` fp32 / bf16 / fp16), the scale, the token, ``slot_expert`` `[n, K]` int32 and ``weights``
    `[n, K]` fp32 (or None), bit for bit. False where the kernels do not apply (a row holding NaN among them: ``out``
    is then partly written, the caller's torch code writes all of it). Raises IndexError for a token outside ``x``."""
    if weights is not None and (not _cpu(weights) or weights.dtype != torch.float32):
        return False
    if (lib := _quantizing(x, row_token, slot_expert, out)) is None:
        return False
    n, k = slot_expert.shape
    return lib.pack_int8(x, x.shape[0], DTYPES[x.dtype], x.shape[1], row_token, slot_expert, weights, n, k, out,
                         out.shape[1], fmt.scale_off, fmt.token_off, fmt.slot_off, fmt.weight_off)  # fmt: skip


def pack_fp8(x: torch.Tensor, row_token: torch.Tensor, slot_expert: torch.Tensor, out: torch.Tensor,
             fmt: Any) -> bool:  # fmt: skip
    """Dispatch rows of ``fmt`` (a :class:`~deep_ep_npu.engine.rows.RowFormat` in DeepEP's fp8, scales not rounded,
    no weights): ``out`` `[n, row_bytes]` uint8 gets the e4m3 data and per-128-channel scales of ``x[row_token]``
    (``x`` `[T, hidden]` fp32 / bf16 / fp16, ``hidden % 128 == 0``: :func:`~deep_ep_npu.quant.scale_for_fp8_` and
    the cast), the token and ``slot_expert`` `[n, K]` int32, bit for bit. False where the kernels do not apply (a
    group holding NaN / Inf among them: ``out`` is then partly written, the caller's torch code writes all of it).
    Raises IndexError for a token outside ``x``."""
    if x.dim() != 2 or x.shape[1] % 128 or (lib := _quantizing(x, row_token, slot_expert, out)) is None:
        return False
    n, k = slot_expert.shape
    return lib.pack_fp8(x, x.shape[0], DTYPES[x.dtype], x.shape[1], row_token, slot_expert, n, k, out, out.shape[1],
                        fmt.scale_off, fmt.token_off, fmt.slot_off)  # fmt: skip


def to_e4m3(x: torch.Tensor) -> torch.Tensor | None:
    """The kernels' float -> float8 e4m3fn cast of ``x`` (fp32, contiguous, CPU) as `torch.uint8` bits, or None
    where the kernels do not apply."""
    if x.dtype != torch.float32 or not _cpu(x) or (lib := library()) is None:
        return None
    out = torch.empty(x.shape, dtype=torch.uint8)
    lib.to_e4m3(x, x.numel(), out)
    return out


def gather(x: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> bool:
    """``out[i] = x[index[i]]`` (``x`` `[rows, *]`, ``out`` `[n, *]` contiguous, ``index`` `[n]` int64 < rows) with
    streaming stores (rows another process reads); False (nothing done) where the kernels do not apply. Raises
    IndexError for an index outside ``x``."""
    if not _cpu(x, index, out) or index.dtype != torch.int64 or x.dtype != out.dtype or x.dim() != 2:
        return False
    if out.shape != (index.numel(), x.shape[1]) or (lib := library()) is None:
        return False
    lib.gather(x, x.shape[0], x.shape[1] * x.element_size(), index, index.numel(), out)
    return True


def place_scales(rows: torch.Tensor, scale_off: int, pair_row: torch.Tensor, pair_pos: torch.Tensor,
                 scales: torch.Tensor, repeat: bool) -> bool:  # fmt: skip
    """The masked layout's fp32 scales of the pairs :func:`place` placed: pair i (row ``pair_row[i]`` of ``rows``
    `[n, row_bytes]` uint8, flat position ``pair_pos[i]`` = expert * cap + row, `[k]` int64) gets its row's scales
    (at ``scale_off``: one per group, or with ``repeat`` the row's one scale in every group) in ``scales`` `[L, cap,
    groups]` fp32, a transposed view of `[L, groups, cap]` storage (DeepEP's). False (nothing done) where the kernels
    do not apply. Raises IndexError for a pair outside the rows or the layout."""
    if not _cpu(rows, pair_row, pair_pos) or scales.dtype != torch.float32 or not scales.is_cpu:
        return False
    num_local, cap, groups = scales.shape
    if scales.stride() != (groups * cap, 1, cap) or rows.dtype != torch.uint8:
        return False
    if pair_row.dtype != torch.int64 or pair_pos.dtype != torch.int64 or (lib := library()) is None:
        return False
    lib.place_scales(rows, rows.shape[0], rows.shape[1], scale_off, pair_row, pair_pos, pair_row.numel(),
                     scales.transpose(1, 2), num_local, cap, groups, int(repeat))  # fmt: skip
    return True


def place_pairs(x: torch.Tensor, token: torch.Tensor, expert: torch.Tensor, recv: torch.Tensor, src_info: torch.Tensor,
                pos: torch.Tensor, counts: torch.Tensor, src: int) -> bool:  # fmt: skip
    """:func:`place` of this rank's own pairs straight from ``x`` `[T, hidden]` (no packed rows): pair i (``token``
    / local ``expert`` `[n]` int64, sorted by (expert, token)) into ``recv`` / ``src_info`` from ``pos[e]`` on.
    False (nothing done) where the kernels do not apply. Raises IndexError for a token outside ``x``."""
    if not _cpu(x, token, expert, recv, src_info, pos, counts) or x.dim() != 2:
        return False
    if token.dtype != torch.int64 or expert.dtype != torch.int64 or x.dtype != recv.dtype:
        return False
    if (lib := library()) is None:
        return False
    num_local, cap = src_info.shape
    lib.place_pairs(x, x.shape[0], x.shape[1] * x.element_size(), token, expert, token.numel(), num_local, cap,
                    counts.shape[1], src, recv, src_info, pos, counts)  # fmt: skip
    return True


def layout_range(counts: torch.Tensor, rank: int, out: torch.Tensor, recv_count: torch.Tensor) -> bool:
    """The masked layout's ``layout_range`` `[L, R]` int64 (``out``) and ``recv_count`` `[L]` int32 from the rows
    placed per (local expert, source) ``counts`` `[L, R]` int64 (this rank's block first, then the other sources by
    rank). False (nothing done) where the kernels do not apply."""
    if not _cpu(counts, out, recv_count) or counts.dtype != torch.int64 or out.dtype != torch.int64:
        return False
    if recv_count.dtype != torch.int32 or (lib := library()) is None:
        return False
    lib.layout_range(counts, counts.shape[0], counts.shape[1], rank, out, recv_count)
    return True


def return_rows(layout_range: torch.Tensor, n: int, mask: torch.Tensor) -> tuple[torch.Tensor, list[int]] | int | None:
    """Combine's rows of the flattened `[L * R * N]` expert output per source (by source, expert, row) from
    ``layout_range`` `[L, R]` int64, none to sources masked in ``mask`` `[R]`, and their counts per source; the flat
    index of the first block outside ``[0, R * N)`` when there is one; None where the kernels do not apply."""
    if not _cpu(layout_range) or layout_range.dtype != torch.int64 or not mask.is_cpu or (lib := library()) is None:
        return None
    num_local, r = layout_range.shape
    rows = torch.empty((num_local * r * n,), dtype=torch.int64)
    per_src = torch.empty((r,), dtype=torch.int64)
    k = lib.return_rows(layout_range, num_local, r, n, mask.to(torch.uint8).contiguous(), rows, per_src)
    return -1 - k if k < 0 else (rows[:k], per_src.tolist())


def place_flat(blocks: list[tuple[int, torch.Tensor]], fmt: Any, scale_bytes: int, weights: bool, counts: torch.Tensor,
               expand_x: torch.Tensor, scales: torch.Tensor, assist: torch.Tensor,
               expand_scales: torch.Tensor) -> int | None:  # fmt: skip
    """The flat layout's placement (:meth:`~deep_ep_npu.engine.flat.Flat.place_remote`) of dispatch rows ``blocks``
    (``(source, rows)``: ``rows`` `[n, row_bytes]` uint8 in ``fmt``, a :class:`~deep_ep_npu.engine.rows.RowFormat`),
    in one pass: data into ``expand_x`` `[cap, *]`, ``scale_bytes`` of scales per row into ``scales`` `[cap,
    scale_bytes]` uint8 (none when 0), (source, token, slot) into ``assist`` `[>= 3 cap]` int32 and the slot weights
    (``weights``) into ``expand_scales`` `[cap]` fp32; ``counts`` `[L, R]` int64 gets the pairs per (local expert,
    source). Returns the number of pairs, -1 when they exceed cap (only counts is written), or None where the kernels
    do not apply."""
    if not _cpu(counts, expand_x, assist) or any(r.dtype != torch.uint8 or not _cpu(r) for _, r in blocks):
        return None
    if counts.dtype != torch.int64 or assist.dtype != torch.int32 or (weights and not _cpu(expand_scales)):
        return None
    if (lib := library()) is None:
        return None
    (num_local, num_ranks), cap = counts.shape, expand_x.shape[0]
    k = lib.place_flat(blocks, fmt.row_bytes, fmt.data_bytes, fmt.scale_off, scale_bytes, fmt.token_off, fmt.slot_off,
                       fmt.num_slots, fmt.weight_off if weights else -1, num_local, num_ranks, cap, expand_x,
                       scales if scale_bytes else None, assist, expand_scales if weights else None, counts)  # fmt: skip
    return -1 if k == -2 else k
