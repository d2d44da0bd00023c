"""Fused CPU loops (``cpu_kernels.c``, built and loaded by :mod:`.cpu_build`) for the engine's per-call work on CPU
tensors: the plan of ``topk_idx`` and its id check; dispatch row packing, with Ascend's per-token int8 and DeepEP's
fp8 quantization; DeepEP's masked placement (this rank's own pairs straight from ``x``), its scales and block
table; the flat (Ascend) placement; combine's return rows, the gather of combine rows into a peer's window, the
weighted fp32 reduction and the flat combine's slot-ordered sum. Each is one pass where the torch code takes
several ops (gather, convert, scale, scatter-add, sorts), and the results are bit-identical to it (the same
roundings in the same order); the torch code stays the path for every other case (other devices, other quantized
rows, rows holding NaN, no compiler). Every wrapper returns False / None where it does not apply, having done
nothing (the packing wrappers' NaN case excepted: see them).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from .cpu_build import DTYPES, disabled, library, unavailable

__all__ = ["DTYPES", "disabled", "library", "unavailable"]  # (the build's, re-exported: callers use this module)


def _cpu(*tensors: torch.Tensor) -> bool:
    return all(t.is_cpu and t.is_contiguous() for t in tensors)


def _inside(index: torch.Tensor, bound: int) -> bool:
    """Whether every value of ``index`` is in ``[0, bound)`` (true when it is empty)."""
    return not index.numel() or 0 <= int(index.min()) <= int(index.max()) < bound


def accumulate(acc: torch.Tensor, x: torch.Tensor, index: torch.Tensor | None, token: torch.Tensor,
               weight: torch.Tensor, zero_first: bool = False) -> bool:  # fmt: skip
    """``acc[token[i]] += weight[i] * x[index[i]]`` (``x[i]`` without ``index``) for i in order, in fp32 (with
    ``zero_first``, ``acc`` is zeroed first): ``acc``
    `[T, hidden]` fp32, ``x`` `[rows, hidden]` (fp32 / bf16 / fp16, rows contiguous), ``index`` / ``token`` `[n]`
    int64, ``weight`` `[n]` fp32. Returns False (nothing done) where the kernels do not apply: the caller runs torch."""
    lib = library()
    if lib is None or x.dtype not in DTYPES or not lib.dep_has_dtype(DTYPES[x.dtype]) or x.dim() != 2:
        return False
    if x.stride(1) != 1 or not _cpu(acc, token, weight) or x.device.type != "cpu" or acc.shape[1] != x.shape[1]:
        return False
    n = token.numel()
    if index is not None and not _cpu(index):
        return False
    if n and int(index.max() if index is not None else n - 1) >= x.shape[0]:
        raise IndexError(f"accumulate: row index past the {x.shape[0]} rows of x")
    if token.dtype != torch.int64 or acc.dtype != torch.float32:
        return False
    weight = weight.float().contiguous()  # (exact: torch multiplies in fp32 too)
    rc = lib.dep_accumulate(acc.data_ptr(), acc.shape[0], acc.shape[1], x.data_ptr(), x.stride(0) * x.element_size(),
                            DTYPES[x.dtype], None if index is None else index.data_ptr(), None, token.data_ptr(),
                            weight.data_ptr(), n, int(zero_first))  # fmt: skip
    return _accumulated(rc, acc)


def accumulate_rows(acc: torch.Tensor, rows: list[tuple[torch.Tensor, torch.Tensor | None]], order: torch.Tensor,
                    token: torch.Tensor, weight: torch.Tensor) -> bool:  # fmt: skip
    """``acc = 0``, then ``acc[token[i]] += weight[i] * y[order[i]]`` for i in order, in fp32, where ``y`` is the
    rows of ``rows`` one after another: each ``(x, index)`` gives ``x[index]`` (``x`` `[*, hidden]` fp32 / bf16 /
    fp16, all of one dtype, rows contiguous; ``index`` `[k]` int64, or None: all of ``x``'s rows). ``acc`` `[T,
    hidden]` fp32; ``order`` / ``token`` `[n]` int64; ``weight`` `[n]` fp32. Returns False (nothing done) where the
    kernels do not apply."""
    lib = library()
    dtypes = {x.dtype for x, _ in rows}
    if lib is None or len(dtypes) > 1 or not _cpu(acc, order, token) or acc.dtype != torch.float32:
        return False
    dtype = dtypes.pop() if dtypes else torch.float32
    if dtype not in DTYPES or not lib.dep_has_dtype(DTYPES[dtype]) or token.dtype != torch.int64:
        return False
    addr = []
    for x, index in rows:
        if x.dim() != 2 or x.shape[1] != acc.shape[1] or x.stride(1) != 1 or not x.is_cpu:
            return False
        at = torch.arange(x.shape[0]) if index is None else index
        if not _inside(at, x.shape[0]):
            raise IndexError(f"accumulate_rows: a row index is outside [0, {x.shape[0]})")
        addr.append(at * (x.stride(0) * x.element_size()) + x.data_ptr())
    y = torch.cat(addr) if addr else torch.empty(0, dtype=torch.int64)
    if not _inside(order, y.numel()):
        raise IndexError(f"accumulate_rows: an order index is outside [0, {y.numel()})")
    at, weight = y[order], weight.float().contiguous()
    rc = lib.dep_accumulate(acc.data_ptr(), acc.shape[0], acc.shape[1], None, 0, DTYPES[dtype], None, at.data_ptr(),
                            token.data_ptr(), weight.data_ptr(), order.numel(), 1)  # fmt: skip
    return _accumulated(rc, acc)


def _accumulated(rc: int, acc: torch.Tensor) -> bool:
    if rc == -3:
        raise MemoryError("accumulate: out of memory")
    if rc:
        raise IndexError(f"accumulate: a token index is outside [0, {acc.shape[0]})")
    return True


def place(rows: torch.Tensor, data_bytes: int, token_off: int, slot_off: int, num_slots: int, recv: torch.Tensor,
          src_info: torch.Tensor, pos: torch.Tensor, counts: torch.Tensor, src: int,
          pairs: torch.Tensor) -> int | None:  # fmt: skip
    """Expand dispatch ``rows`` `[n, row_bytes]` uint8 of source ``src`` into ``recv`` `[L, cap, *]` (``data_bytes``
    per row) and ``src_info`` `[L, cap]` int32 from row ``pos[e]`` of each expert on (``pos`` `[L]` int64 and
    ``counts`` `[L, R]` int64 grow), writing each pair's (row, flat position) into ``pairs`` `[2, >= n * num_slots]`
    int64. Returns the number of pairs, or None where the kernels do not apply (nothing done)."""
    lib = library()
    if lib is None or not _cpu(rows, recv, src_info, pos, counts, pairs) or rows.dtype != torch.uint8:
        return None
    num_local, cap = src_info.shape
    assert recv.numel() * recv.element_size() == num_local * cap * data_bytes
    assert pairs.shape[1] >= rows.shape[0] * num_slots
    k = lib.dep_place(rows.data_ptr(), rows.shape[0], rows.shape[1], data_bytes, token_off, slot_off, num_slots,
                      num_local, cap, counts.shape[1], src, recv.data_ptr(), src_info.data_ptr(), pos.data_ptr(),
                      counts.data_ptr(), pairs[0].data_ptr(), pairs[1].data_ptr())  # fmt: skip
    if k < 0:
        raise ValueError("dispatch rows name a local expert outside the layout" if k == -1 else
                         "dispatch rows exceed an expert's R * N rows")  # fmt: skip
    return int(k)


def ids_ok(ids: torch.Tensor, lo: int, hi: int) -> bool | None:
    """Whether every id of ``ids`` `[n, k]` int64 is in ``[lo, hi)`` with no id >= 0 twice in a row; None where the
    kernels do not apply (the caller checks with torch)."""
    lib = library()
    if lib is None or ids.dtype != torch.int64 or ids.dim() != 2 or not _cpu(ids):
        return None
    return not lib.dep_check_ids(ids.data_ptr(), ids.shape[0], ids.shape[1], lo, hi)


def plan(ids: torch.Tensor, num_local: int, num_ranks: int, rank: int, mask: torch.Tensor,
         per_pair_rows: bool) -> tuple[Any, ...] | None:  # fmt: skip
    """:func:`~.plan.plan_topk`'s parts from valid ``ids`` `[T, K]` int64 (``mask`` `[R]`): (token, slot, dest,
    expert, pairs_per_dest (list), row_token, row_of_pair, rows_per_dest (list), slot_expert `[rows, K]` int32 or
    None), or None where the kernels do not apply."""
    lib = library()
    if lib is None or ids.dtype != torch.int64 or ids.dim() != 2 or not _cpu(ids) or mask.device.type != "cpu":
        return None
    t, k = ids.shape
    p, r = t * k, num_ranks
    buf = torch.empty((6 * p + 2 * r + r * (num_local + t),), dtype=torch.int64)  # pairs, counts, scratch
    slot_expert = None if per_pair_rows else torch.empty((p, k), dtype=torch.int32)
    m = mask.to(torch.uint8).contiguous()
    num_rows, at = ctypes.c_int64(), buf.data_ptr()
    n = lib.dep_plan(ids.data_ptr(), t, k, num_local, r, rank, m.data_ptr(), int(per_pair_rows), at, at + 8 * p,
                     at + 16 * p, at + 24 * p, at + 48 * p, at + 32 * p, at + 40 * p, at + 48 * p + 8 * r,
                     None if slot_expert is None else slot_expert.data_ptr(), at + 48 * p + 16 * r,
                     ctypes.byref(num_rows))  # fmt: skip
    rows, counts = num_rows.value, buf[6 * p : 6 * p + 2 * r].tolist()
    token, slot, dest, expert, row_token, row_of_pair = (buf[i * p : i * p + (rows if i == 4 else n)] for i in range(6))
    table = None if slot_expert is None else slot_expert[:rows]
    return token, slot, dest, expert, counts[:r], row_token, row_of_pair, counts[r:], table


def pack(x: torch.Tensor, row_token: torch.Tensor, slot_expert: torch.Tensor, out: torch.Tensor, token_off: int,
         slot_off: int, streaming: bool) -> bool:  # fmt: skip
    """Dispatch rows without quantization or weights: ``out`` `[n, row_bytes]` uint8 gets the data of ``x[row_token]``
    (``x`` `[T, hidden]`), the token and ``slot_expert`` `[n, K]` int32 (``streaming``: past this core's cache, for
    rows another process reads). False (nothing done) where the kernels do not apply."""
    lib = library()
    if lib is None or not _cpu(x, row_token, slot_expert, out) or row_token.dtype != torch.int64:
        return False
    if slot_expert.dtype != torch.int32 or out.dtype != torch.uint8:
        return False
    n, k = slot_expert.shape
    lib.dep_pack(x.data_ptr(), x.shape[1] * x.element_size(), row_token.data_ptr(), slot_expert.data_ptr(), n, k,
                 out.data_ptr(), out.shape[1], token_off, slot_off, int(streaming))  # fmt: skip
    return True


def _quantized_rows(x: torch.Tensor, row_token: torch.Tensor, slot_expert: torch.Tensor, out: torch.Tensor,
                    name: str) -> ctypes.CDLL | None:  # fmt: skip
    """The library when a quantizing packer applies to these tensors (checked; a token outside ``x`` raises)."""
    lib = library()
    if lib is None or x.dtype not in DTYPES or not lib.dep_has_dtype(DTYPES[x.dtype]) or x.dim() != 2:
        return None
    if not _cpu(x, row_token, slot_expert, out) or row_token.dtype != torch.int64 or slot_expert.dtype != torch.int32:
        return None
    if not _inside(row_token, x.shape[0]):
        raise IndexError(f"{name}: a token is outside [0, {x.shape[0]})")
    return lib


def _packed(rc: int, name: str) -> bool:
    if rc == -3:
        raise MemoryError(f"{name}: out of memory")
    return rc == 0


def pack_int8(x: torch.Tensor, row_token: torch.Tensor, slot_expert: torch.Tensor, weights: torch.Tensor | None,
              out: torch.Tensor, fmt: Any) -> bool:  # fmt: skip
    """Dispatch rows of ``fmt`` (a :class:`~.rows.RowFormat` with per-token int8 quantization) with no smoothing:
    ``out`` `[n, row_bytes]` uint8 gets :func:`~deep_ep_npu.quant.per_token_int8` of ``x[row_token]`` (``x`` `[T,
    hidden]` fp32 / bf16 / fp16), the scale, the token, ``slot_expert`` `[n, K]` int32 and ``weights`` `[n, K]` fp32
    (or None), bit for bit. False where the kernels do not apply (a row holding NaN among them: ``out`` is then
    partly written, the caller's torch code writes all of it)."""
    if weights is not None and (not _cpu(weights) or weights.dtype != torch.float32):
        return False
    if (lib := _quantized_rows(x, row_token, slot_expert, out, "pack_int8")) is None:
        return False
    n, k = slot_expert.shape
    rc = lib.dep_pack_int8(x.data_ptr(), DTYPES[x.dtype], x.shape[1], row_token.data_ptr(), slot_expert.data_ptr(),
                           None if weights is None else weights.data_ptr(), n, k, out.data_ptr(), out.shape[1],
                           fmt.scale_off, fmt.token_off, fmt.slot_off, fmt.weight_off)  # fmt: skip
    return _packed(rc, "pack_int8")


def pack_fp8(x: torch.Tensor, row_token: torch.Tensor, slot_expert: torch.Tensor, out: torch.Tensor,
             fmt: Any) -> bool:  # fmt: skip
    """Dispatch rows of ``fmt`` (a :class:`~.rows.RowFormat` in DeepEP's fp8, scales not rounded, no weights):
    ``out`` `[n, row_bytes]` uint8 gets the e4m3 data and per-128-channel scales of ``x[row_token]`` (``x`` `[T,
    hidden]` fp32 / bf16 / fp16, ``hidden % 128 == 0``: :func:`~deep_ep_npu.quant.scale_for_fp8_` and the cast), the
    token and ``slot_expert`` `[n, K]` int32, bit for bit. False where the kernels do not apply (a group holding NaN /
    Inf among them: ``out`` is then partly written, the caller's torch code writes all of it)."""
    if x.dim() != 2 or x.shape[1] % 128 or (lib := _quantized_rows(x, row_token, slot_expert, out, "pack_fp8")) is None:
        return False
    n, k = slot_expert.shape
    rc = lib.dep_pack_fp8(x.data_ptr(), DTYPES[x.dtype], x.shape[1], row_token.data_ptr(), slot_expert.data_ptr(), n,
                          k, out.data_ptr(), out.shape[1], fmt.scale_off, fmt.token_off, fmt.slot_off)  # fmt: skip
    return _packed(rc, "pack_fp8")


def to_e4m3(x: torch.Tensor) -> torch.Tensor | None:
    """The kernels' float -> float8 e4m3fn cast of ``x`` (fp32, contiguous, CPU) as `torch.uint8` bits, or None
    where the kernels do not apply."""
    lib = library()
    if lib is None or x.dtype != torch.float32 or not _cpu(x):
        return None
    out = torch.empty(x.shape, dtype=torch.uint8)
    lib.dep_to_e4m3(x.data_ptr(), x.numel(), out.data_ptr())
    return out


def gather(x: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> bool:
    """``out[i] = x[index[i]]`` (``x`` `[rows, *]`, ``out`` `[n, *]` contiguous, ``index`` `[n]` int64 < rows) with
    streaming stores (rows another process reads); False (nothing done) where the kernels do not apply."""
    lib = library()
    if lib is None or not _cpu(x, index, out) or index.dtype != torch.int64 or x.dtype != out.dtype:
        return False
    if x.dim() != 2 or out.shape != (index.numel(), x.shape[1]):
        return False
    if not _inside(index, x.shape[0]):
        raise IndexError(f"gather: a row index is outside [0, {x.shape[0]})")
    lib.dep_gather(x.data_ptr(), x.shape[1] * x.element_size(), index.data_ptr(), index.numel(), out.data_ptr())
    return True


def place_scales(rows: torch.Tensor, scale_off: int, pair_row: torch.Tensor, pair_pos: torch.Tensor,
                 scales: torch.Tensor, repeat: bool) -> bool:  # fmt: skip
    """The masked layout's fp32 scales of the pairs :func:`place` placed: pair i (row ``pair_row[i]`` of ``rows``
    `[n, row_bytes]` uint8, flat position ``pair_pos[i]`` = expert * cap + row, `[k]` int64) gets its row's scales
    (at ``scale_off``: one per group, or with ``repeat`` the row's one scale in every group) in ``scales`` `[L, cap,
    groups]` fp32, a transposed view of `[L, groups, cap]` storage (DeepEP's). False (nothing done) where the kernels
    do not apply."""
    lib = library()
    if lib is None or not _cpu(rows, pair_row, pair_pos) or scales.dtype != torch.float32 or not scales.is_cpu:
        return False
    num_local, cap, groups = scales.shape
    if scales.stride() != (groups * cap, 1, cap) or rows.dtype != torch.uint8 or pair_pos.dtype != torch.int64:
        return False
    k = pair_row.numel()
    if not _inside(pair_pos, num_local * cap) or not _inside(pair_row, len(rows)):
        raise IndexError("place_scales: a pair outside the rows or the layout")
    lib.dep_place_scales(rows.data_ptr(), rows.shape[1], scale_off, pair_row.data_ptr(), pair_pos.data_ptr(), k,
                         scales.data_ptr(), cap, groups, int(repeat))  # fmt: skip
    return True


def place_pairs(x: torch.Tensor, token: torch.Tensor, expert: torch.Tensor, recv: torch.Tensor, src_info: torch.Tensor,
                pos: torch.Tensor, counts: torch.Tensor, src: int) -> bool:  # fmt: skip
    """:func:`place` of this rank's own pairs straight from ``x`` `[T, hidden]` (no packed rows): pair i (``token``
    / local ``expert`` `[n]` int64, sorted by (expert, token)) into ``recv`` / ``src_info`` from ``pos[e]`` on.
    False (nothing done) where the kernels do not apply."""
    lib = library()
    if lib is None or not _cpu(x, token, expert, recv, src_info, pos, counts):
        return False
    if token.dtype != torch.int64 or expert.dtype != torch.int64 or x.dtype != recv.dtype:
        return False
    num_local, cap = src_info.shape
    if not _inside(token, x.shape[0]):
        raise IndexError(f"place_pairs: a token is outside [0, {x.shape[0]})")
    rc = lib.dep_place_pairs(x.data_ptr(), x.shape[1] * x.element_size(), token.data_ptr(), expert.data_ptr(),
                             token.numel(), num_local, cap, counts.shape[1], src, recv.data_ptr(),
                             src_info.data_ptr(), pos.data_ptr(), counts.data_ptr())  # fmt: skip
    if rc:
        raise ValueError("own pairs name a local expert outside the layout" if rc == -1 else
                         "own pairs exceed an expert's R * N rows")  # fmt: skip
    return True


def layout_range(counts: torch.Tensor, rank: int, out: torch.Tensor, recv_count: torch.Tensor) -> bool:
    """The masked layout's ``layout_range`` `[L, R]` int64 (``out``) and ``recv_count`` `[L]` int32 from the rows
    placed per (local expert, source) ``counts`` `[L, R]` int64 (this rank's block first, then the other sources by
    rank). False (nothing done) where the kernels do not apply."""
    lib = library()
    if lib is None or not _cpu(counts, out, recv_count) or counts.dtype != torch.int64 or out.dtype != torch.int64:
        return False
    if recv_count.dtype != torch.int32:
        return False
    lib.dep_layout_range(counts.data_ptr(), counts.shape[0], counts.shape[1], rank, out.data_ptr(),
                         recv_count.data_ptr())  # fmt: skip
    return True


def return_rows(layout_range: torch.Tensor, n: int, mask: torch.Tensor) -> tuple[torch.Tensor, list[int]] | int | None:
    """Combine's rows of the flattened `[L * R * N]` expert output per source (by source, expert, row) from
    ``layout_range`` `[L, R]` int64, none to sources masked in ``mask`` `[R]`, and their counts per source; the flat
    index of the first block outside ``[0, R * N)`` when there is one; None where the kernels do not apply."""
    lib = library()
    if lib is None or not _cpu(layout_range) or layout_range.dtype != torch.int64 or not mask.is_cpu:
        return None
    num_local, r = layout_range.shape
    rows = torch.empty((num_local * r * n,), dtype=torch.int64)
    per_src = torch.empty((r,), dtype=torch.int64)
    m = mask.to(torch.uint8).contiguous()
    k = lib.dep_return_rows(layout_range.data_ptr(), num_local, r, n, m.data_ptr(), rows.data_ptr(), per_src.data_ptr())
    return -1 - k if k < 0 else (rows[:k], per_src.tolist())


def place_flat(blocks: list[tuple[int, torch.Tensor]], fmt: Any, scale_bytes: int, weights: bool, counts: torch.Tensor,
               expand_x: torch.Tensor, scales: torch.Tensor, assist: torch.Tensor,
               expand_scales: torch.Tensor) -> int | None:  # fmt: skip
    """The flat layout's placement (:meth:`~.flat.Flat.place_remote`) of dispatch rows ``blocks`` (``(source,
    rows)``: ``rows`` `[n, row_bytes]` uint8 in ``fmt``, a :class:`~.rows.RowFormat`), in one pass: data into
    ``expand_x`` `[cap, *]`, ``scale_bytes`` of scales per row into ``scales`` `[cap, scale_bytes]` uint8 (none when
    0), (source, token, slot) into ``assist`` `[>= 3 cap]` int32 and the slot weights (``weights``) into
    ``expand_scales`` `[cap]` fp32; ``counts`` `[L, R]` int64 gets the pairs per (local expert, source). Returns the
    number of pairs, -1 when they exceed cap (only counts is written), or None where the kernels do not apply."""
    lib = library()
    if lib is None or not _cpu(counts, expand_x, assist) or any(r.dtype != torch.uint8 for _, r in blocks):
        return None
    if not all(_cpu(r) for _, r in blocks):
        return None
    if counts.dtype != torch.int64 or assist.dtype != torch.int32 or (weights and not _cpu(expand_scales)):
        return None
    (num_local, num_ranks), cap = counts.shape, expand_x.shape[0]
    assert expand_x.numel() * expand_x.element_size() >= cap * fmt.data_bytes and assist.numel() >= 3 * cap
    assert not scale_bytes or (scales.is_contiguous() and scales.shape == (cap, scale_bytes))
    table = torch.tensor([[r.data_ptr(), r.shape[0], s] for s, r in blocks], dtype=torch.int64).view(-1, 3).t()
    table = table.contiguous()
    k = lib.dep_place_flat(table[0].data_ptr(), table[1].data_ptr(), table[2].data_ptr(), len(blocks), fmt.row_bytes,
                           fmt.data_bytes, fmt.scale_off, scale_bytes, fmt.token_off, fmt.slot_off, fmt.num_slots,
                           fmt.weight_off if weights else -1, num_local, num_ranks, cap, expand_x.data_ptr(),
                           scales.data_ptr() if scale_bytes else None, assist.data_ptr(),
                           expand_scales.data_ptr() if weights else None, counts.data_ptr())  # fmt: skip
    if k == -1:
        raise ValueError("dispatch rows name a local expert or source outside the layout")
    if k == -3:
        raise MemoryError("place_flat: out of memory")
    return -1 if k == -2 else k
