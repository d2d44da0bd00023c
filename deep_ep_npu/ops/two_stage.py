"""torch_npu's two-stage MoE distribute ops, with exactly the one-shot ops' results: a setup validates (on every
rank, as the one-shot ops; its own rules: :mod:`.two_stage_rules`), agrees and sends; its teardown waits for the rows,
without communicating: its errors are local and the peers' teardowns still complete."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..backends import InFlight
from ..core import ascend, rules
from ..core.ascend import platform
from ..core.call import FlatDispatch
from ..engine.exchange import check_names, check_status, engine_for, header
from ..engine.rows import DTYPE_CODES
from ..errors import null, shape
from ..sizes import align
from ..transports.agreement import Send
from ..transports.names import resolve_group
from .two_stage_rules import check_setup, keywords, lookup, register

DISPATCH_SETUP, COMBINE_SETUP = "moe_distribute_dispatch_setup", "moe_distribute_combine_setup"
COMBINE_NAMES = ("moe_expert_num", "hidden", "expand_x dtype", "comm_quant_mode", "comm_type", "global_bs")


def moe_distribute_dispatch_setup(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    group_ep: dist.ProcessGroup | str,
    ep_world_size: int,
    ep_rank_id: int,
    moe_expert_num: int,
    *,
    scales: torch.Tensor | None = None,
    x_active_mask: torch.Tensor | None = None,
    expert_shard_type: int = 0,
    shared_expert_num: int = 1,
    shared_expert_rank_num: int = 0,
    quant_mode: int = 0,
    global_bs: int = 0,
    comm_type: int = 0,
    comm_alg: str = "",
    y_dtype: torch.dtype | int | None = None,
    strict: bool | str = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch_npu's ``npu_moe_distribute_dispatch_setup``: validate (on every rank), agree and send the rows of a
    two-stage dispatch; :func:`moe_distribute_dispatch_teardown` receives them.

    Arguments: as :func:`~deep_ep_npu.ops.moe_distribute_dispatch_v2`, plus ``comm_type`` (0 AICPU-SDMA, 1 CCU,
    2 URMA), with the two-stage form's rules: ``comm_alg`` "", no shared experts (``shared_expert_rank_num`` 0,
    ``shared_expert_num`` 0 or 1), ``x_active_mask`` `[Bs]` only, and a quantizing ``quant_mode`` needs ``y_dtype``.
    ``strict="a5"`` adds Ascend 950's ranges (W [2, 384], E (0, 512], H [1024, 8192], Bs (0, 512], K (0, 16]), URMA
    only and the HCCL window (``HCCL_BUFFSIZE``, default 200 MB) its doc requires; ``True`` / "a3" is refused.

    Returns:
        y: `[Bs * (K + S), hs]` (S: shared_expert_num as passed) in ``y_dtype`` (None: x's dtype): the rows as sent,
            pairs stable-sorted by expert id, each its token's (quantized) row; zero past them. ``hs = Align256(H)``
            unquantized, else ``Align512(at + scale bytes)``: 1-byte data, then the scales from byte ``at`` =
            ``Align32(H)`` (2: one fp32), ``Align128(H)`` (3: ceil(H / 128) fp32), ``Align256(H)`` (4: e8m0 ones).
        expand_idx: `[Bs * K]` `torch.int32`: pair (t, k)'s row in its expert's block (the number of earlier sent
            pairs of this rank to that expert); -1 for a pair not sent (undefined on the NPU).
        comm_cmd_info: `[(Bs * (K + S) + E) * 16]` `torch.int32`: the call's key for the teardown (opaque on the NPU).
    """
    engine = engine_for(resolve_group(group_ep, "group_ep"))
    with engine.rejecting(DISPATCH_SETUP):
        rules.in_range(comm_type, "comm_type", 0, 2, code="param")  # before the rules of any algorithm
        rules.one_of(comm_alg, "comm_alg", ("",), "the two-stage ops have no algorithm choice")
        experts = ascend.experts(
            engine.group,
            ep_world_size,
            ep_rank_id,
            moe_expert_num,
            strict=strict,
            expert_shard_type=expert_shard_type,
            shared_expert_num=shared_expert_num,
            shared_expert_rank_num=shared_expert_rank_num,
        )
        call = ascend.dispatch(
            FlatDispatch(
                DISPATCH_SETUP,
                x,
                expert_ids,
                experts,
                global_bs=global_bs,
                x_active_mask=x_active_mask,
                quant=ascend.quant(quant_mode, y_dtype, None, None, x, experts.platform),
                scales=scales,
            )
        )
        (bs, k), h = call.expert_ids.shape, x.shape[1]
        check_setup(DISPATCH_SETUP, strict, experts, comm_type, call.x_active_mask, bs, h, k, global_bs)
        if quant_mode and y_dtype is None:
            why = "torch_npu gives y x's dtype otherwise, which the op rejects"
            raise null("y_dtype", f"quant_mode {quant_mode} needs the quantized dtype ({why})")
    receive = engine.dispatch(call)  # agreed; the payload is on its way
    e, num_local, quant = moe_expert_num, experts.num_local, call.quant
    flat = call.expert_ids.masked_fill(call.expert_ids < 0, e).view(-1)  # pairs not sent (-1) sort last
    order = torch.argsort(flat, stable=True)
    per_expert = torch.bincount(flat, minlength=e + 1)
    first = per_expert.cumsum(0) - per_expert  # each expert's first row in y
    expand_idx = (order.argsort() - first[flat]).masked_fill_(flat == e, -1).to(torch.int32)  # (argsort: y's row)
    n, y_rows = flat.numel() - int(per_expert[e]), bs * (k + shared_expert_num)
    rows = x.index_select(0, order[:n] // k)
    if quant is None:
        y = torch.zeros((y_rows, align(h, 256)), dtype=x.dtype, device=x.device)
        y[:n, :h] = rows
    else:
        at, nbytes = align(h, {2: 32, 3: 128, 4: 256}[quant.mode]), quant.scale_bytes(h)
        y = torch.zeros((y_rows, align(at + nbytes, 512)), dtype=quant.dtype, device=x.device)
        q, scale = quant(rows, None if call.scales is None else call.scales[flat[order[:n]]])  # (S = 0: row e)
        raw = y.view(torch.uint8)
        raw[:n, :h] = q.view(torch.uint8)
        raw[:n, at : at + nbytes] = scale.contiguous().view(torch.uint8).reshape(n, nbytes)
    rows_per_dest = per_expert[:e].view(-1, num_local).sum(1).tolist()
    kw = keywords(
        "quant_mode",
        group_ep,
        ep_world_size,
        ep_rank_id,
        moe_expert_num,
        expert_shard_type,
        shared_expert_num,
        shared_expert_rank_num,
        global_bs,
        comm_type,
        comm_alg,
        quant_mode,
    )
    tensors = {"x": x, "y": y, "expert_ids": expert_ids}
    return y, expand_idx, register("dispatch", engine.group, kw, tensors, receive, (y_rows + e) * 16, rows_per_dest)


def moe_distribute_dispatch_teardown(
    x: torch.Tensor,
    y: torch.Tensor,
    expert_ids: torch.Tensor,
    comm_cmd_info: torch.Tensor,
    group_ep: dist.ProcessGroup | str,
    ep_world_size: int,
    ep_rank_id: int,
    moe_expert_num: int,
    *,
    expert_shard_type: int = 0,
    shared_expert_num: int = 1,
    shared_expert_rank_num: int = 0,
    quant_mode: int = 0,
    global_bs: int = 0,
    expert_token_nums_type: int = 1,
    comm_type: int = 0,
    comm_alg: str = "",
    strict: bool | str = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch_npu's ``npu_moe_distribute_dispatch_teardown``: the rows of the dispatch_setup call ``comm_cmd_info``
    names, which must be given the same x, y, expert_ids and keywords. A = ``(global_bs or Bs * W) * min(L, K)``.

    Returns:
        expand_x: `[A, H]` in y's dtype (not dequantized), laid out as
            :func:`~deep_ep_npu.ops.moe_distribute_dispatch_v2`'s; zero past the received rows.
        dynamic_scales: quant_mode 0-2: `[A]` `torch.float32` (zeros for 0); 3: `[A, ceil(H / 128)]`
            `torch.float32`; 4: `[A, Align2(ceil(H / 32))]` `torch.float8_e8m0fnu`.
        assist_info_for_combine: `[A * 128]` `torch.int32`: ``[0 : E]`` the inclusive prefix sums of the rows per
            (local expert j, source rank r), j-major (the one-shot op's ``ep_recv_counts``); the rest zero.
        expert_token_nums: `[L]` `torch.int64`: rows per local expert (expert_token_nums_type 1) or their inclusive
            cumsum (0; Ascend 950 allows only 1).
    """
    kw = keywords(
        "quant_mode",
        group_ep,
        ep_world_size,
        ep_rank_id,
        moe_expert_num,
        expert_shard_type,
        shared_expert_num,
        shared_expert_rank_num,
        global_bs,
        comm_type,
        comm_alg,
        quant_mode,
    )
    call = lookup("dispatch", comm_cmd_info, kw, {"x": x, "y": y, "expert_ids": expert_ids})
    rules.one_of(expert_token_nums_type, "expert_token_nums_type", (1,) if platform(strict) == "a5" else (0, 1))
    expand_x, scales, _, counts, ep_recv_counts, _, _ = call.wait()
    call.done()
    cap, dev = expand_x.shape[0], expand_x.device
    if quant_mode == 0:
        scales = torch.zeros((cap,), dtype=torch.float32, device=dev)
    assist = torch.zeros((cap * 128,), dtype=torch.int32, device=dev)
    assist[:moe_expert_num] = ep_recv_counts[:moe_expert_num]  # W * L = E (no shared-expert ranks)
    return expand_x, scales, assist, counts.cumsum(0) if expert_token_nums_type == 0 else counts


def moe_distribute_combine_setup(
    expand_x: torch.Tensor,
    expert_ids: torch.Tensor,
    assist_info_for_combine: torch.Tensor,
    group_ep: dist.ProcessGroup | str,
    ep_world_size: int,
    ep_rank_id: int,
    moe_expert_num: int,
    *,
    expert_shard_type: int = 0,
    shared_expert_num: int = 1,
    shared_expert_rank_num: int = 0,
    global_bs: int = 0,
    comm_quant_mode: int = 0,
    comm_type: int = 0,
    comm_alg: str = "",
    strict: bool | str = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch_npu's ``npu_moe_distribute_combine_setup``: validate (on every rank), agree and send the expert outputs
    back: block ``b = j * W + r`` of ``expand_x`` (rows ``[cum[b - 1], cum[b])``, ``cum`` =
    ``assist_info_for_combine[0 : E]``) goes to source rank r. ``comm_quant_mode`` must be 0 (nothing is quantized);
    the other keywords as :func:`moe_distribute_dispatch_setup`.

    Arguments:
        expand_x: `[A', H]` `torch.bfloat16` / `torch.float16` (`torch.float32` here): expert outputs, row-aligned
            with dispatch_teardown's ``expand_x``.
        expert_ids: `[Bs, K]` `torch.int32` (only its shape is used). assist_info_for_combine: dispatch_teardown's.

    Returns:
        quant_expand_x: `[A', Align512(Align32(H) + Align8(H) / 8 * 4)]` `torch.int8`, zero (nothing is quantized).
        comm_cmd_info: `[(A' + W) * 16]` `torch.int32`: the call's key for :func:`moe_distribute_combine_teardown`.
    """
    engine = engine_for(resolve_group(group_ep, "group_ep"))
    with engine.rejecting(COMBINE_SETUP):
        rules.in_range(comm_type, "comm_type", 0, 2, code="param")
        rules.one_of(comm_alg, "comm_alg", ("",), "the two-stage ops have no algorithm choice")
        e = ascend.experts(
            engine.group,
            ep_world_size,
            ep_rank_id,
            moe_expert_num,
            strict=strict,
            expert_shard_type=expert_shard_type,
            shared_expert_num=shared_expert_num,
            shared_expert_rank_num=shared_expert_rank_num,
            combine=True,
        )
        expand_x = rules.tensor(expand_x, "expand_x", ascend.NPU_ACT_DTYPES if strict else rules.ACT_DTYPES, 2)
        ids = rules.tensor(expert_ids, "expert_ids", (torch.int32,) if strict else rules.ID_DTYPES, 2)
        (bs, k), h = ids.shape, expand_x.shape[1]
        global_bs_real = rules.global_bs(global_bs, e.world_size, bs, ascend.MAX_BS)
        check_setup(COMBINE_SETUP, strict, e, comm_type, None, bs, h, k, global_bs)
        rules.in_range(comm_quant_mode, "comm_quant_mode", 0, 2, code="param")
        rules.one_of(comm_quant_mode, "comm_quant_mode", (0,), "the two-stage combine does not quantize (only 0)")
        w, num_local = e.world_size, e.num_local
        assist = rules.tensor(assist_info_for_combine, "assist_info_for_combine", (torch.int32,), 1)
        if assist.numel() < w * num_local:
            raise shape("assist_info_for_combine", f"has {assist.numel()} entries, needs W * L = {w * num_local}")
        cum = assist[: w * num_local].long()
        blocks = cum.diff(prepend=cum.new_zeros(1))
        capacity, total = global_bs_real * min(num_local, k), int(cum[-1])
        if bool((blocks < 0).any()) or total > min(len(expand_x), capacity):
            sums = f"its first W * L = {w * num_local} entries must be dispatch_teardown's prefix sums"
            why = f"non-decreasing, at most expand_x's {len(expand_x)} rows and A = {capacity}"
            raise shape("assist_info_for_combine", f"{sums} ({why}); got a total of {total}")
    dev, me = expand_x.device, e.rank
    block = torch.repeat_interleave(torch.arange(w * num_local, device=dev), blocks, output_size=total)
    order = torch.argsort(block % w * num_local + block // w, stable=True)  # rows by (dest rank, local expert)
    per_dest = blocks.view(num_local, w).sum(0).tolist()
    dest_rows = [order[sum(per_dest[:d]) : sum(per_dest[: d + 1])] for d in range(w)]  # the rows for each rank

    def write(d: int, out: torch.Tensor) -> None:
        torch.index_select(expand_x, 0, dest_rows[d], out=out.view(expand_x.dtype))

    def check(agreement: Any) -> None:
        check_status(agreement)
        check_names(agreement, engine.ep, COMBINE_NAMES, 1 + 2 * w)

    fingerprint = (e.num_moe_experts, h, DTYPE_CODES[expand_x.dtype], comm_quant_mode, comm_type, global_bs)
    shared = header(h * expand_x.dtype.itemsize, (), fingerprint, w)
    counts = [[c, -1] for c in per_dest]
    ticket = engine.collective.send(Send(COMBINE_SETUP, counts, shared, write, check, agree_now=True, device=dev))
    own = expand_x.index_select(0, dest_rows[me])

    def finish() -> list[torch.Tensor]:  # the rows each source rank returned, by source rank
        got = {s: part.view(expand_x.dtype) for s, part in ticket.receive().parts} | {me: own}
        return [got.get(s, own[:0]) for s in range(w)]

    qx = torch.zeros((len(expand_x), align(align(h, 32) + align(h, 8) // 8 * 4, 512)), dtype=torch.int8, device=dev)
    kw = keywords(
        "comm_quant_mode",
        group_ep,
        ep_world_size,
        ep_rank_id,
        moe_expert_num,
        expert_shard_type,
        shared_expert_num,
        shared_expert_rank_num,
        global_bs,
        comm_type,
        comm_alg,
        comm_quant_mode,
    )
    tensors = {"expand_x": expand_x, "quant_expand_x": qx}
    return qx, register("combine", engine.group, kw, tensors, InFlight(finish), (len(qx) + w) * 16, per_dest)


def moe_distribute_combine_teardown(
    expand_x: torch.Tensor,
    quant_expand_x: torch.Tensor,
    expert_ids: torch.Tensor,
    expand_idx: torch.Tensor,
    expert_scales: torch.Tensor,
    comm_cmd_info: torch.Tensor,
    group_ep: dist.ProcessGroup | str,
    ep_world_size: int,
    ep_rank_id: int,
    moe_expert_num: int,
    *,
    x_active_mask: torch.Tensor | None = None,
    shared_expert_x: torch.Tensor | None = None,
    expert_shard_type: int = 0,
    shared_expert_num: int = 1,
    shared_expert_rank_num: int = 0,
    global_bs: int = 0,
    comm_quant_mode: int = 0,
    comm_type: int = 0,
    comm_alg: str = "",
    strict: bool | str = False,
) -> torch.Tensor:
    """torch_npu's ``npu_moe_distribute_combine_teardown``: receive the rows of the combine_setup call
    ``comm_cmd_info`` names (same expand_x, quant_expand_x and keywords) and reduce them, exactly as
    :func:`~deep_ep_npu.ops.moe_distribute_combine_v2`.

    Arguments:
        expert_ids: `[Bs, K]` `torch.int32`; expand_idx: `[Bs * K]` `torch.int32`, dispatch_setup's: pair (t, k) is
            row ``expand_idx[t * K + k]`` of expert ``expert_ids[t, k]``'s returned block; a pair with -1 (not sent)
            adds nothing and its id is not checked.
        expert_scales: `[Bs, K]` `torch.float32` top-k weights.
        x_active_mask: `[Bs]` bool prefix mask: tokens outside it are zero (the 950 kernel ignores it).
        shared_expert_x: `[Bs, H]` (or `[a, b, H]`, a * b = Bs) in expand_x's dtype, added with weight 1 (the
            documented formula; the 950 kernel ignores it).

    Returns:
        x: `[Bs, H]` in expand_x's dtype: ``sum_k expert_scales[t, k] * row(t, k)`` over slots ascending in fp32, plus
        ``shared_expert_x[t]``, one round-to-nearest-even cast.
    """
    kw = keywords(
        "comm_quant_mode",
        group_ep,
        ep_world_size,
        ep_rank_id,
        moe_expert_num,
        expert_shard_type,
        shared_expert_num,
        shared_expert_rank_num,
        global_bs,
        comm_type,
        comm_alg,
        comm_quant_mode,
    )
    call = lookup("combine", comm_cmd_info, kw, {"expand_x": expand_x, "quant_expand_x": quant_expand_x})
    e = moe_expert_num
    ids = rules.tensor(expert_ids, "expert_ids", rules.ID_DTYPES, 2)
    (bs, k), h = ids.shape, expand_x.shape[1]
    idx = rules.tensor(expand_idx, "expand_idx", (torch.int32,), 1)
    rules.dims(idx, "expand_idx", (bs * k,), "(Bs * K,)")
    weights = rules.tensor(expert_scales, "expert_scales", (torch.float32,), 2)
    rules.dims(weights, "expert_scales", (bs, k), "(Bs, K)")
    valid = idx.view(bs, k) >= 0
    if (mask := rules.optional_tensor(x_active_mask, "x_active_mask", (torch.bool,), 1)) is not None:
        rules.prefix_mask(mask, bs)
        valid &= mask.unsqueeze(1)
    shared_x = rules.optional_tensor(shared_expert_x, "shared_expert_x", (expand_x.dtype,), (2, 3))
    if shared_x is not None and (shared_x.numel() != bs * h or shared_x.shape[-1] != h):
        raise shape("shared_expert_x", f"shape {tuple(shared_x.shape)} must be (Bs, H) or (a, b, H) with a*b = Bs")
    token, slot = valid.nonzero(as_tuple=True)
    expert, occurrence = ids[token, slot].long(), idx.view(bs, k)[token, slot].long()
    checked = rules.values_checked(expert) and expert.numel()
    if checked and ((lo := int(expert.min())) < 0 or (hi := int(expert.max())) >= e):
        raise shape("expert_ids", f"a sent pair names expert {lo if lo < 0 else hi}, allowed [0, {e})")
    parts = call.wait()
    per_expert = torch.bincount(expert, minlength=e)
    got, want = [part.shape[0] for part in parts], per_expert.view(ep_world_size, -1).sum(1).tolist()
    unique = torch.unique(expert * (bs * k) + occurrence).numel() == expert.numel()
    if got != want or not unique or bool((occurrence >= per_expert[expert]).any()):
        what = f"expert_ids / expand_idx / x_active_mask route {want} rows to the ranks, which returned {got}"
        raise shape("expand_idx", f"{what}; pass dispatch_setup's expand_idx and the same expert_ids and mask")
    first = per_expert.cumsum(0) - per_expert
    rows = torch.cat(parts).index_select(0, first[expert] + occurrence).float().mul_(weights[token, slot].unsqueeze(1))
    acc = torch.zeros((bs, h), dtype=torch.float32, device=expand_x.device)
    for kk in range(k):  # slot after slot, ascending, as the one-shot combine
        acc.index_add_(0, token[slot == kk], rows[slot == kk])
    if shared_x is not None:
        acc.add_(shared_x.reshape(bs, h).float())
    if mask is not None:
        acc.masked_fill_(~mask.unsqueeze(1), 0.0)
    call.done()
    return acc.to(expand_x.dtype)
