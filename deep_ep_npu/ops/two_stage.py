"""torch_npu's real two-stage MoE distribute ops on the engine: setup is the send phase, teardown the receive phase.

Dispatch: ``dispatch_setup`` validates (a rank that rejects its input still takes part in the agreement step, so every
rank raises), runs the agreement step, posts the payload (the one-shot dispatch's send phase) and returns ``y`` (the
rows as sent), ``expand_idx`` and ``comm_cmd_info``; ``dispatch_teardown`` waits and returns the received rows in the
one-shot layout. Combine: ``combine_setup`` returns block ``b = j * W + r`` of ``expand_x`` (rows ``[cum[b - 1],
cum[b])`` by ``assist_info_for_combine``'s prefix sums) to source rank r; ``combine_teardown`` waits and reduces
``out[t] = sum_k w[t, k] * row(expert_ids[t, k], expand_idx[t * K + k])`` in fp32, slots ascending as the one-shot
combine. The four ops therefore give exactly the one-shot ops' results.

``comm_cmd_info`` (opaque scratch on the NPU) is a facade over the call in flight (its
:class:`~deep_ep_npu.engine.exchange.InFlight` receive): ``[0]`` a marker, ``[1]`` the kind (1 dispatch, 2 combine),
``[2]`` this process's tag, ``[3]`` the call's serial number, ``[4]`` W, ``[5]`` the rank, ``[16 : 16 + W]`` the rows
sent to each rank. A teardown given another call's, a finished call's or another kind's ``comm_cmd_info`` raises.
Teardown does not communicate: its errors are local and the peers' teardowns still complete.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import secrets
from typing import Any

import torch
import torch.distributed as dist

from .. import envs
from ..core import ascend, rules
from ..core.ascend import PLATFORM_NAMES, platform
from ..core.call import DispatchCall
from ..core.platforms import resolve_dtype
from ..engine.exchange import InFlight, check_names, check_status, engine_for, header
from ..errors import MoeDistributeError, invalid, null, shape
from ..quant import Quant
from ..sizes import align
from ..transports.names import resolve_group

DISPATCH_SETUP, COMBINE_SETUP = "moe_distribute_dispatch_setup", "moe_distribute_combine_setup"
MARKER, KINDS, TAG = 0x75D15C0, {"dispatch": 1, "combine": 2}, secrets.randbits(31)
MAX_IN_FLIGHT = 64  # calls set up and not torn down; the oldest is dropped beyond this
COMBINE_NAMES = ("moe_expert_num", "hidden", "expand_x dtype", "comm_quant_mode", "comm_type", "global_bs")
_OUTPUTS = ("y", "quant_expand_x")  # setup outputs that teardown takes back
_serial = itertools.count(1)


@dataclasses.dataclass
class _Call:
    """A setup whose teardown has not run: its kind, arguments to match and receive phase."""

    kind: str
    group: dist.ProcessGroup
    args: dict[str, Any]
    tensors: dict[str, tuple[int, tuple[int, ...], torch.dtype]]  # name -> (data_ptr, shape, dtype) at setup
    receive: InFlight


_IN_FLIGHT: collections.OrderedDict[int, _Call] = collections.OrderedDict()


def _rules(op: str, strict: object, comm_type: object, comm_alg: object, shared: tuple[object, object],
           mask: object, world: object, experts: object, hidden: int, num_tokens: int, topk: int,
           global_bs: object) -> None:  # fmt: skip
    """The rules of the two-stage form beyond the one-shot ops': ``comm_type`` in [0, 2], ``comm_alg`` "", no shared
    experts, a 1D mask; ``strict="a5"``: Ascend 950's ranges, URMA only, the HCCL window; other platforms refused."""
    plat, (num, ranks) = platform(strict), shared
    if ranks or (isinstance(num, int) and num > 1):
        name = "shared_expert_rank_num" if ranks else "shared_expert_num"
        raise invalid(name, f"{num} / shared_expert_rank_num {ranks}: the two-stage ops support no shared experts "
                      "yet on any platform (pass 0 / 0)")  # fmt: skip
    if isinstance(mask, torch.Tensor) and mask.dim() != 1:
        raise shape("x_active_mask", f"the two-stage ops take a 1D (Bs,) mask, got {tuple(mask.shape)}")
    if plat is None:
        return
    if plat != "a5":
        raise invalid("strict", f"got {strict!r}; the two-stage ops run on Ascend 950 only (their op definitions "
                      "register only ascend950; A2 / A3 are documented as unsupported): use strict='a5'")  # fmt: skip
    name, w, e = PLATFORM_NAMES[plat], rules.in_range(world, "ep_world_size", 2, 384), experts
    if comm_type != 2:
        raise invalid("comm_type", f"got {comm_type}; {name} runs the two-stage ops on URMA only (comm_type 2)")
    rules.in_range(e, "moe_expert_num", 1, 512)
    rules.in_range(hidden, "H (hidden size)", 1024, 8192)
    rules.in_range(num_tokens, "Bs (tokens)", 1, 512)
    rules.in_range(topk, "K (top-k)", 1, min(16, int(e)))  # type: ignore[call-overload]
    if global_bs and not num_tokens * w <= int(global_bs) <= 512 * w:  # type: ignore[call-overload]
        raise shape("global_bs", f"got {global_bs}; allowed 0 or [Bs * W, 512 * W] = [{num_tokens * w}, {512 * w}]")
    max_bs, num_local, factor = (int(global_bs) or num_tokens * w) // w, int(e) // w, 4  # type: ignore[call-overload]
    row, comb = align(align(2 * hidden, 32) + 44, 512), align(2 * hidden, 512)
    need = factor * (num_local * max_bs * w * row + topk * max_bs * comb)  # the 950 doc's factor 4
    have = envs.hccl_buffsize_mb() or 200  # MB; HCCL's default window
    if have < 2 or have << 20 < need:
        formula = f"{factor} * (L * maxBs * W * Align512(Align32(2H) + 44) + K * maxBs * Align512(2H)) bytes"
        raise shape("HCCL_BUFFSIZE", f"{have} MB is too small for {op} on {name}: at least "
                    f"{max(2, -(-need >> 20))} MB (= {formula})")  # fmt: skip


def _no_algorithm(comm_type: object, comm_alg: object) -> None:
    """``comm_type`` in [0, 2] and ``comm_alg`` "": checked first, so an algorithm's own requirements (hierarchy's
    ``expert_scales``, which these ops do not take) are never what an error names."""
    rules.in_range(comm_type, "comm_type", 0, 2, code="param")
    rules.one_of(comm_alg, "comm_alg", ("",), "the two-stage ops have no algorithm choice")


def _register(kind: str, group: dist.ProcessGroup, args: dict, tensors: dict, receive: InFlight, size: int,
              rows_per_dest: list[int], device: torch.device) -> torch.Tensor:  # fmt: skip
    """Keep the call in flight and return its ``comm_cmd_info`` `[size]` int32 (see the module docstring)."""
    serial = next(_serial) & 0x7FFFFFFF
    seen = {k: (t.data_ptr(), tuple(t.shape), t.dtype) for k, t in tensors.items()}
    _IN_FLIGHT[serial] = _Call(kind, group, args, seen, receive)
    while len(_IN_FLIGHT) > MAX_IN_FLIGHT:
        _IN_FLIGHT.popitem(last=False)
    w, rank = dist.get_world_size(group), dist.get_rank(group)
    head = [MARKER, KINDS[kind], TAG, serial, w, rank] + [0] * 10 + rows_per_dest
    cmd = torch.zeros((max(size, len(head)),), dtype=torch.int32, device=device)
    cmd[: len(head)] = torch.tensor(head, dtype=torch.int32)
    _IN_FLIGHT[serial].tensors["comm_cmd_info"] = (cmd.data_ptr(), tuple(cmd.shape), cmd.dtype)
    return cmd


def _lookup(kind: str, cmd: object, args: dict, tensors: dict) -> tuple[int, _Call]:
    """The call ``cmd`` (a ``comm_cmd_info``) keys, after checking that ``args`` and ``tensors`` are the setup's."""
    op = f"moe_distribute_{kind}_setup"
    t = rules.tensor(cmd, "comm_cmd_info", (torch.int32,), 1)
    head = t[:4].tolist() if t.numel() >= 16 else []
    if not head or head[0] != MARKER or head[2] != TAG:
        raise invalid("comm_cmd_info", f"is not the comm_cmd_info a {op} of this process returned")
    if head[1] != KINDS[kind]:
        other = next(k for k, v in KINDS.items() if v == head[1])
        raise invalid("comm_cmd_info", f"comes from moe_distribute_{other}_setup; pass {op}'s to this teardown")
    call = _IN_FLIGHT.get(head[3])
    if call is None:
        why = f"belongs to {op} call #{head[3]}, which is no longer in flight (torn down already, or one of more than "
        raise invalid("comm_cmd_info", why + f"{MAX_IN_FLIGHT} calls set up without a teardown)")
    tensors = {"comm_cmd_info": t, **tensors}  # whole, as the setup returned it (a slice is refused)
    for name, value in args.items():
        same = resolve_group(value, "group_ep") is call.group if name == "group_ep" else value == call.args[name]
        if not same:
            raise invalid(name, f"is {value!r} but {op} call #{head[3]} (the one comm_cmd_info names) had "
                          f"{call.args[name]!r}; pass the same values, and that call's comm_cmd_info")  # fmt: skip
    for name, value in tensors.items():  # setup's outputs must be the same tensors, its inputs of the same shape
        ptr, size, dtype = call.tensors[name]
        rules.tensor(value, name, (dtype,), len(size))
        if tuple(value.shape) != size or (name in _OUTPUTS and value.data_ptr() != ptr):
            what = "returned by" if name in _OUTPUTS else f"of the shape {size} given to"
            raise invalid(name, f"is not the tensor {what} {op} call #{head[3]} (the one comm_cmd_info names); pass "
                          "that call's tensors and its comm_cmd_info")  # fmt: skip
    return head[3], call


def _receive(serial: int, call: _Call) -> Any:
    """The call's receive phase; a failed one is no longer in flight (a retry could only raise the same error)."""
    try:
        return call.receive.wait()
    except BaseException:
        _IN_FLIGHT.pop(serial, None)
        raise


def _y_row_elements(quant_mode: int, hidden: int) -> int:
    """hs: the elements of one ``y`` row (torch_npu's output size)."""
    h32 = align(hidden, 32)
    return {0: align(align(2 * hidden, 32), 512) // 2, 1: align(h32, 512), 2: align(h32 + 4, 512),
            3: align(align(hidden, 128) + -(-hidden // 128) * 4, 512),
            4: align(align(hidden, 256) + align(-(-hidden // 32), 2), 512)}[quant_mode]  # fmt: skip


# fmt: off
def moe_distribute_dispatch_setup(
    x: torch.Tensor, expert_ids: torch.Tensor, group_ep: dist.ProcessGroup | str, ep_world_size: int,
    ep_rank_id: int, moe_expert_num: int, *, scales: torch.Tensor | None = None,
    x_active_mask: torch.Tensor | None = None, expert_shard_type: int = 0, shared_expert_num: int = 1,
    shared_expert_rank_num: int = 0, quant_mode: int = 0, global_bs: int = 0, comm_type: int = 0, comm_alg: str = "",
    y_dtype: torch.dtype | int | None = None, strict: bool | str = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # fmt: on
    """torch_npu's ``npu_moe_distribute_dispatch_setup``: the send phase of a two-stage dispatch (same arguments,
    plus ``strict``). Validation (on every rank) and the agreement step run here, and the rows leave.

    Notation: W = ep_world_size, E = moe_expert_num, L = E / W, K = top-k, S = shared_expert_num as passed,
    ``hs`` = the row size torch_npu gives ``y`` for ``quant_mode``: 0 ``Align256(H)``, 1 ``Align512(Align32(H))``,
    2 ``Align512(Align32(H) + 4)``, 3 ``Align512(Align128(H) + ceil(H / 128) * 4)``, 4 ``Align512(Align256(H) +
    Align2(ceil(H / 32)))``.

    Arguments: as :func:`~deep_ep_npu.ops.moe_distribute_dispatch_v2`, with these rules of the two-stage form on every platform:
    ``comm_type`` in [0, 2] (0 AICPU-SDMA, 1 CCU, 2 URMA), ``comm_alg`` "", no shared experts
    (``shared_expert_rank_num`` 0, ``shared_expert_num`` 0 or 1), ``x_active_mask`` `[Bs]` bool only, and a quantizing
    ``quant_mode`` needs ``y_dtype``. ``strict="a5"``: also Ascend 950's ranges (W [2, 384], E (0, 512], H [1024,
    8192], Bs (0, 512], K (0, 16]), URMA only (``comm_type`` 2) and the HCCL window (``HCCL_BUFFSIZE``, default
    200 MB) of at least ``4 * (L * maxBs * W * Align512(Align32(2H) + 44) + K * maxBs * Align512(2H))`` bytes (the
    950 doc's rule); ``True`` / "a3" is refused: the op definitions register only Ascend 950.

    Returns:
        y: `[Bs * (K + S), hs]` with ``y_dtype`` (x's dtype when None): the rows as sent, pairs sorted by expert id
            (stable), row i the (quantized) copy of its token; with quant_mode 2 the fp32 scale sits at byte
            ``Align32(H)`` of the row. Rows of pairs not sent (outside ``x_active_mask``) and the tail are zero.
        expand_idx: `[Bs * K]` `torch.int32`: for pair (t, k), the number of earlier sent pairs of this rank routed to
            the same expert (its row in that expert's block); -1 for a pair not sent (ours: undefined on the NPU).
        comm_cmd_info: `[(Bs * (K + S) + W * L) * 16]` `torch.int32`: the key of this call (pass it to
            :func:`moe_distribute_dispatch_teardown`; opaque on the NPU).
    """
    engine = engine_for(group_ep if isinstance(group_ep, dist.ProcessGroup) else resolve_group(group_ep, "group_ep"))
    try:
        _no_algorithm(comm_type, comm_alg)
        experts = ascend.experts(engine.group, ep_world_size, ep_rank_id, moe_expert_num, strict=strict,
                                 expert_shard_type=expert_shard_type, shared_expert_num=shared_expert_num,
                                 shared_expert_rank_num=shared_expert_rank_num, comm_alg=comm_alg)  # fmt: skip
        call = rules.dispatch(DispatchCall(
            DISPATCH_SETUP, "flat", x, expert_ids, experts, global_bs=global_bs, x_active_mask=x_active_mask,
            quant=(quant_mode, y_dtype, None, None), scales=scales, comm_alg=comm_alg,
        ))  # fmt: skip
        _rules(DISPATCH_SETUP, strict, comm_type, comm_alg, (shared_expert_num, shared_expert_rank_num),
               x_active_mask, ep_world_size, moe_expert_num, x.shape[1], x.shape[0], expert_ids.shape[1], global_bs)
        if quant_mode and y_dtype is None:
            raise null("y_dtype", f"quant_mode {quant_mode} needs the quantized dtype (torch_npu gives y x's dtype "
                       "otherwise, which the op rejects)")  # fmt: skip
    except MoeDistributeError as err:
        engine.reject(DISPATCH_SETUP, err.code)
        raise
    receive = engine.dispatch(call)  # validated (on every rank), agreed; the payload is on its way
    ids, w, e, s = expert_ids.long(), ep_world_size, moe_expert_num, shared_expert_num
    (bs, k), dev = ids.shape, x.device
    sent = torch.ones_like(ids, dtype=torch.bool)
    if x_active_mask is not None:
        sent &= x_active_mask.to(dev).unsqueeze(1)
    flat = torch.where(sent, ids, e).view(-1)  # pairs not sent sort last
    order = torch.argsort(flat, stable=True)
    n = int(sent.sum())
    per_expert = torch.bincount(flat, minlength=e + 1)
    start = torch.cumsum(per_expert, 0) - per_expert
    expand_idx = torch.empty_like(flat)
    expand_idx[order] = torch.arange(flat.numel(), device=dev) - start[flat[order]]
    expand_idx = expand_idx.masked_fill_(~sent.view(-1), -1).to(torch.int32)
    out_dtype = resolve_dtype(y_dtype, "y_dtype") or x.dtype
    y = torch.zeros((bs * (k + s), _y_row_elements(quant_mode, x.shape[1])), dtype=out_dtype, device=dev)
    rows = x.index_select(0, order[:n] // k)
    if quant_mode == 0:
        y[:n, : x.shape[1]] = rows
    else:  # 1-byte data, then the scales at byte Align32(H) (mode 2), Align128(H) (3) or Align256(H) (4)
        smooth = None if scales is None else scales[flat[order[:n]]]  # row S + e of scales, S = 0 here
        q, scale = Quant(quant_mode, out_dtype)(rows, smooth)
        raw = y.view(torch.uint8)
        raw[:n, : x.shape[1]] = q.view(torch.uint8)
        at = align(x.shape[1], {2: 32, 3: 128, 4: 256}[quant_mode])
        scale_bytes = scale.reshape(n, scale.numel() // max(n, 1)).contiguous().view(torch.uint8)
        raw[:n, at : at + scale_bytes.shape[1]] = scale_bytes
    rows_per_dest = torch.bincount(flat[sent.view(-1)] // (e // w), minlength=w).tolist()
    args = dict(ep_world_size=w, ep_rank_id=ep_rank_id, moe_expert_num=e, expert_shard_type=expert_shard_type,
                shared_expert_num=s, shared_expert_rank_num=shared_expert_rank_num, global_bs=global_bs,
                comm_type=comm_type, comm_alg=comm_alg, quant_mode=quant_mode)  # fmt: skip
    size = (bs * (k + s) + w * (e // w)) * 16
    tensors = {"x": x, "y": y, "expert_ids": expert_ids}
    return y, expand_idx, _register("dispatch", engine.group, args, tensors, receive, size, rows_per_dest, dev)


# fmt: off
def moe_distribute_dispatch_teardown(
    x: torch.Tensor, y: torch.Tensor, expert_ids: torch.Tensor, comm_cmd_info: torch.Tensor,
    group_ep: dist.ProcessGroup | str, ep_world_size: int, ep_rank_id: int, moe_expert_num: int, *,
    expert_shard_type: int = 0, shared_expert_num: int = 1, shared_expert_rank_num: int = 0, quant_mode: int = 0,
    global_bs: int = 0, expert_token_nums_type: int = 1, comm_type: int = 0, comm_alg: str = "",
    strict: bool | str = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # fmt: on
    """torch_npu's ``npu_moe_distribute_dispatch_teardown``: wait for the rows of the dispatch_setup call that
    ``comm_cmd_info`` names (same x, y, expert_ids and keywords, else a clear error) and return them. A = ``global_bs
    * min(L, K)`` (``global_bs`` or Bs * W). No communication: its errors are local.

    Returns:
        expand_x: `[A, H]` in y's dtype (quantized rows are not dequantized): rows by local expert, then source rank,
            then the source's order, as :func:`~deep_ep_npu.ops.moe_distribute_dispatch_v2`; rows past the received total are zero.
        dynamic_scales: `[A]` `torch.float32` (quant_mode 0-2; zeros for 0), `[A, ceil(H / 128)]` (3), `[A,
            Align2(ceil(H / 32))]` `torch.float8_e8m0fnu` (4): the rows' scales.
        assist_info_for_combine: `[A * 128]` `torch.int32`: ``[0 : W * L]`` the inclusive prefix sum of the rows per
            (local expert j, source rank r), j-major (the one-shot op's ``ep_recv_counts``); the rest zero.
        expert_token_nums: `[L]` `torch.int64`: rows per local expert (expert_token_nums_type 1) or their inclusive
            cumsum (0; Ascend 950 allows only 1).
    """
    args = dict(group_ep=group_ep, ep_world_size=ep_world_size, ep_rank_id=ep_rank_id, moe_expert_num=moe_expert_num,
                expert_shard_type=expert_shard_type, shared_expert_num=shared_expert_num,
                shared_expert_rank_num=shared_expert_rank_num, global_bs=global_bs, comm_type=comm_type,
                comm_alg=comm_alg, quant_mode=quant_mode)  # fmt: skip
    serial, call = _lookup("dispatch", comm_cmd_info, args, {"x": x, "y": y, "expert_ids": expert_ids})
    types = (1,) if platform(strict) == "a5" else (0, 1)  # Ascend 950 allows only counts
    rules.one_of(expert_token_nums_type, "expert_token_nums_type", types)
    expand_x, scales, _, counts, ep_recv_counts, _, _ = _receive(serial, call)
    _IN_FLIGHT.pop(serial, None)
    cap, num_experts = expand_x.shape[0], moe_expert_num  # W * L = E (no shared-expert ranks)
    if quant_mode == 0:
        scales = torch.zeros((cap,), dtype=torch.float32, device=expand_x.device)
    assist = torch.zeros((cap * 128,), dtype=torch.int32, device=expand_x.device)
    assist[:num_experts] = ep_recv_counts[:num_experts]
    return expand_x, scales, assist, counts.cumsum(0) if expert_token_nums_type == 0 else counts


# fmt: off
def moe_distribute_combine_setup(
    expand_x: torch.Tensor, expert_ids: torch.Tensor, assist_info_for_combine: torch.Tensor,
    group_ep: dist.ProcessGroup | str, ep_world_size: int, ep_rank_id: int, moe_expert_num: int, *,
    expert_shard_type: int = 0, shared_expert_num: int = 1, shared_expert_rank_num: int = 0, global_bs: int = 0,
    comm_quant_mode: int = 0, comm_type: int = 0, comm_alg: str = "", strict: bool | str = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    # fmt: on
    """torch_npu's ``npu_moe_distribute_combine_setup``: send the expert outputs back. Block ``b = j * W + r`` of
    ``expand_x`` (rows ``[cum[b - 1], cum[b])``, ``cum`` = ``assist_info_for_combine[0 : W * L]``) goes to source
    rank r. Validation (on every rank) and the agreement step run here. ``comm_quant_mode`` must be 0 (the two-stage
    combine does not quantize); the other rules as :func:`moe_distribute_dispatch_setup`.

    Arguments:
        expand_x: `[A', H]` `torch.bfloat16` / `torch.float16` (`torch.float32` here): expert outputs, row-aligned
            with dispatch_teardown's ``expand_x``.
        expert_ids: `[Bs, K]` `torch.int32`: this rank's top-k ids (only its shape is used here).
        assist_info_for_combine: dispatch_teardown's output, unchanged.

    Returns:
        quant_expand_x: `[A', Align512(Align32(H) + Align8(H) / 8 * 4)]` `torch.int8`, zero (nothing is quantized).
        comm_cmd_info: `[(A' + W) * 16]` `torch.int32`: the key of this call (pass it to
            :func:`moe_distribute_combine_teardown`).
    """
    engine = engine_for(group_ep if isinstance(group_ep, dist.ProcessGroup) else resolve_group(group_ep, "group_ep"))
    try:
        _no_algorithm(comm_type, comm_alg)
        e = ascend.experts(engine.group, ep_world_size, ep_rank_id, moe_expert_num, strict=strict,
                           expert_shard_type=expert_shard_type, shared_expert_num=shared_expert_num,
                           shared_expert_rank_num=shared_expert_rank_num, comm_alg=comm_alg, combine=True)  # fmt: skip
        expand_x = rules.tensor(expand_x, "expand_x", ascend.NPU_ACT_DTYPES if strict else rules.ACT_DTYPES, 2)
        ids = rules.tensor(expert_ids, "expert_ids", (torch.int32,) if strict else rules.ID_DTYPES, 2)
        _rules(COMBINE_SETUP, strict, comm_type, comm_alg, (shared_expert_num, shared_expert_rank_num), None,
               ep_world_size, moe_expert_num, expand_x.shape[1], ids.shape[0], ids.shape[1], global_bs)
        rules.in_range(comm_quant_mode, "comm_quant_mode", 0, 2, code="param")
        rules.one_of(comm_quant_mode, "comm_quant_mode", (0,), "the two-stage combine does not quantize (only 0)")
        w, num_local = e.world_size, e.num_local
        assist = rules.tensor(assist_info_for_combine, "assist_info_for_combine", (torch.int32,), 1)
        if assist.numel() < w * num_local:
            raise shape("assist_info_for_combine", f"has {assist.numel()} entries, needs W * L = {w * num_local}")
        cum = assist[: w * num_local].long()
        blocks = cum.diff(prepend=cum.new_zeros(1))
        capacity, total = (global_bs or ids.shape[0] * w) * min(num_local, ids.shape[1]), int(cum[-1])
        if bool((blocks < 0).any()) or total > min(expand_x.shape[0], capacity):
            raise shape("assist_info_for_combine", f"its first W * L = {w * num_local} entries must be dispatch_"
                        f"teardown's prefix sums (non-decreasing, at most expand_x's {expand_x.shape[0]} rows and "
                        f"A = {capacity}); got a total of {total}")  # fmt: skip
    except MoeDistributeError as err:
        engine.reject(COMBINE_SETUP, err.code)
        raise
    dev, me = expand_x.device, e.rank
    block = torch.repeat_interleave(torch.arange(w * num_local, device=dev), blocks, output_size=total)
    order = torch.argsort(block % w * num_local + block // w, stable=True)  # rows by (dest rank, local expert)
    per_dest = blocks.view(num_local, w).sum(0).tolist()
    starts = [sum(per_dest[:d]) for d in range(w)]
    width = expand_x.shape[1] * expand_x.dtype.itemsize
    fingerprint = (e.num_moe_experts, expand_x.shape[1], {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}[
        expand_x.dtype], comm_quant_mode, comm_type, global_bs)  # fmt: skip

    def write(d: int, out: torch.Tensor) -> None:
        torch.index_select(expand_x, 0, order[starts[d] : starts[d] + per_dest[d]], out=out.view(expand_x.dtype))

    def check(agreement: Any) -> None:
        check_status(agreement)
        check_names(agreement, engine.ep, COMBINE_NAMES, 1 + 2 * w)

    counts = [[c, -1] for c in per_dest]
    token = engine.collective.send(COMBINE_SETUP, counts, header(width, (), fingerprint, w), write, check,
                                   agree_now=True, device=dev)  # fmt: skip
    own = expand_x.index_select(0, order[starts[me] : starts[me] + per_dest[me]])

    def finish() -> list[torch.Tensor]:  # the rows each source rank returned, by source rank
        _, parts, _ = engine.collective.receive(token)
        got = {s: rows.view(expand_x.dtype) for s, rows in parts} | {me: own}
        return [got.get(s, own[:0]) for s in range(w)]

    h = expand_x.shape[1]
    qx = torch.zeros((expand_x.shape[0], align(align(h, 32) + align(h, 8) // 8 * 4, 512)), dtype=torch.int8, device=dev)
    args = dict(ep_world_size=w, ep_rank_id=ep_rank_id, moe_expert_num=moe_expert_num,
                expert_shard_type=expert_shard_type, shared_expert_num=shared_expert_num,
                shared_expert_rank_num=shared_expert_rank_num, global_bs=global_bs, comm_type=comm_type,
                comm_alg=comm_alg, comm_quant_mode=comm_quant_mode)  # fmt: skip
    tensors = {"expand_x": expand_x, "quant_expand_x": qx}
    return qx, _register("combine", engine.group, args, tensors, InFlight(finish), (expand_x.shape[0] + w) * 16,
                         per_dest, dev)  # fmt: skip


# fmt: off
def moe_distribute_combine_teardown(
    expand_x: torch.Tensor, quant_expand_x: torch.Tensor, expert_ids: torch.Tensor, expand_idx: torch.Tensor,
    expert_scales: torch.Tensor, comm_cmd_info: torch.Tensor, group_ep: dist.ProcessGroup | str, ep_world_size: int,
    ep_rank_id: int, moe_expert_num: int, *, x_active_mask: torch.Tensor | None = None,
    shared_expert_x: torch.Tensor | None = None, expert_shard_type: int = 0, shared_expert_num: int = 1,
    shared_expert_rank_num: int = 0, global_bs: int = 0, comm_quant_mode: int = 0, comm_type: int = 0,
    comm_alg: str = "", strict: bool | str = False,
) -> torch.Tensor:
    # fmt: on
    """torch_npu's ``npu_moe_distribute_combine_teardown``: wait for the rows of the combine_setup call that
    ``comm_cmd_info`` names (same expand_x, quant_expand_x and keywords) and reduce them. No communication: its
    errors are local.

    Arguments:
        expert_ids: `[Bs, K]` `torch.int32` and expand_idx `[Bs * K]` `torch.int32` (dispatch_setup's output): pair
            (t, k)'s row is row ``expand_idx[t * K + k]`` of expert ``expert_ids[t, k]``'s returned block; pairs with
            ``expand_idx`` -1 (not sent) add nothing and their ids are not checked.
        expert_scales: `[Bs, K]` `torch.float32` top-k weights.
        x_active_mask: `[Bs]` bool prefix mask: tokens outside it are zero (the 950 kernel ignores it).
        shared_expert_x: `[Bs, H]` (or `[a, b, H]`, a * b = Bs) in expand_x's dtype, added with weight 1 (the
            documented formula; the 950 kernel ignores it).

    Returns:
        x: `[Bs, H]` in expand_x's dtype: ``sum_k expert_scales[t, k] * row(t, k)`` over slots ascending in fp32, plus
        ``shared_expert_x[t]``, one round-to-nearest-even cast; exactly :func:`~deep_ep_npu.ops.moe_distribute_combine_v2`'s result.
    """
    args = dict(group_ep=group_ep, ep_world_size=ep_world_size, ep_rank_id=ep_rank_id, moe_expert_num=moe_expert_num,
                expert_shard_type=expert_shard_type, shared_expert_num=shared_expert_num,
                shared_expert_rank_num=shared_expert_rank_num, global_bs=global_bs, comm_type=comm_type,
                comm_alg=comm_alg, comm_quant_mode=comm_quant_mode)  # fmt: skip
    serial, call = _lookup("combine", comm_cmd_info, args, {"expand_x": expand_x, "quant_expand_x": quant_expand_x})
    e, w = moe_expert_num, ep_world_size
    ids = rules.tensor(expert_ids, "expert_ids", rules.ID_DTYPES, 2)
    (bs, k), h, dev = ids.shape, expand_x.shape[1], expand_x.device
    idx = rules.tensor(expand_idx, "expand_idx", (torch.int32,), 1)
    rules.dims(idx, "expand_idx", (bs * k,), "(Bs * K,)")
    weights = rules.tensor(expert_scales, "expert_scales", (torch.float32,), 2)
    rules.dims(weights, "expert_scales", (bs, k), "(Bs, K)")
    active, valid = bs, idx.view(bs, k).long() >= 0
    if (mask := rules.optional_tensor(x_active_mask, "x_active_mask", (torch.bool,), 1)) is not None:
        active = rules.prefix_mask(mask, bs)
        valid &= mask.unsqueeze(1)
    shared_x = rules.optional_tensor(shared_expert_x, "shared_expert_x", (expand_x.dtype,), (2, 3))
    if shared_x is not None:
        if shared_x.numel() != bs * h or shared_x.shape[-1] != h:
            raise shape("shared_expert_x", f"shape {tuple(shared_x.shape)} must be (Bs, H) or (a, b, H) with a*b = Bs")
        shared_x = shared_x.reshape(bs, h)
    token, slot = valid.nonzero(as_tuple=True)
    expert, occurrence = ids[token, slot].long(), idx.view(bs, k)[token, slot].long()
    if expert.numel() and ((lo := int(expert.min())) < 0 or (hi := int(expert.max())) >= e):
        raise shape("expert_ids", f"a sent pair names expert {lo if lo < 0 else hi}, allowed [0, {e})")
    parts = _receive(serial, call)
    per_expert = torch.bincount(expert, minlength=e)
    got, want = [part.shape[0] for part in parts], per_expert.view(w, e // w).sum(1).tolist()
    start = torch.cumsum(per_expert, 0) - per_expert
    unique = torch.unique(expert * (bs * k) + occurrence).numel() == expert.numel()
    if got != want or not unique or (expert.numel() and bool((occurrence >= per_expert[expert]).any())):
        raise shape("expand_idx", f"expert_ids / expand_idx / x_active_mask route {want} rows to the ranks, which "
                    f"returned {got}; pass dispatch_setup's expand_idx and the same expert_ids and mask")  # fmt: skip
    rows = torch.cat(parts).index_select(0, start[expert] + occurrence).float().mul_(weights[token, slot].unsqueeze(1))
    acc = torch.zeros((bs, h), dtype=torch.float32, device=dev)
    for kk in torch.unique(slot).tolist():  # slot after slot, ascending, as the one-shot combine
        sel = (slot == kk).nonzero(as_tuple=True)[0]
        acc.index_add_(0, token[sel], rows[sel])
    if shared_x is not None:
        acc.add_(shared_x.float())
    acc[active:] = 0.0
    _IN_FLIGHT.pop(serial, None)
    return acc.to(expand_x.dtype)
