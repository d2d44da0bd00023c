"""torch_npu's real two-stage MoE distribute ops on the engine: setup is the send phase, teardown the receive phase.

Dispatch: ``dispatch_setup`` validates (a rank that rejects its input still takes part in the agreement step, so every
rank raises), runs the agreement step, posts the payload (the one-shot dispatch's send phase) and returns ``y`` (the
rows as sent), ``expand_idx`` and ``comm_cmd_info``; ``dispatch_teardown`` waits and returns the received rows in the
one-shot layout. Combine: ``combine_setup`` returns block ``b = j * W + r`` of ``expand_x`` (rows ``[cum[b - 1],
cum[b])`` by ``assist_info_for_combine``'s prefix sums) to source rank r; ``combine_teardown`` waits and reduces
``out[t] = sum_k w[t, k] * row(expert_ids[t, k], expand_idx[t * K + k])`` in fp32, slots ascending as the one-shot
combine. The four ops therefore give exactly the one-shot ops' results.

``comm_cmd_info`` (opaque scratch on the NPU) carries the key of the call in flight: ``[0]`` a marker, ``[1]`` the kind
(1 dispatch, 2 combine), ``[2]`` this process's tag, ``[3]`` the call's serial number, ``[4]`` W, ``[5]`` the rank,
``[16 : 16 + W]`` the rows sent to each rank. A teardown given another call's, a finished call's or another kind's
``comm_cmd_info`` raises. Teardown does not communicate: its errors are local and the peers' teardowns still complete.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import secrets
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from .. import envs
from .. import errors as checks
from ..ep_layout import validate_layout
from ..errors import ACT_DTYPES, MoeDistributeError, invalid, null, shape
from ..event import Completion
from ..group import DTYPE_CODES, STATUS_OK, ep_group
from ..group_names import resolve_group
from ..npu_types import PLATFORM_NAMES, platform, resolve_dtype
from ..params import NPU_ACT_DTYPES, CombineParams, DispatchParams, ValidDispatch
from ..quant import Quant
from ..sizes import align
from .flat import group_or_none, start_dispatch_flat

DISPATCH_SETUP, COMBINE_SETUP = "moe_distribute_dispatch_setup", "moe_distribute_combine_setup"
MARKER, KINDS, TAG = 0x75D15C0, {"dispatch": 1, "combine": 2}, secrets.randbits(31)
MAX_IN_FLIGHT = 64  # calls set up and not torn down; the oldest is dropped beyond this
COMBINE_NAMES = ("moe_expert_num", "hidden", "expand_x dtype", "comm_quant_mode", "comm_type", "global_bs")
_SHARED = ("group_ep", "ep_world_size", "ep_rank_id", "moe_expert_num", "expert_shard_type", "shared_expert_num",
           "shared_expert_rank_num", "global_bs", "comm_type", "comm_alg")  # fmt: skip
_OUTPUTS = ("y", "quant_expand_x")  # setup outputs that teardown takes back
_serial = itertools.count(1)
_IN_FLIGHT: collections.OrderedDict[int, _Call] = collections.OrderedDict()


@dataclasses.dataclass
class _Call:
    """A setup whose teardown has not run: its kind, arguments to match and receive phase."""

    kind: str
    group: dist.ProcessGroup
    args: dict[str, Any]
    tensors: dict[str, tuple[int, tuple[int, ...], torch.dtype]]  # name -> (data_ptr, shape, dtype) at setup
    receive: Completion


def no_algorithm(p: Any) -> None:
    """``comm_type`` in [0, 2] and ``comm_alg`` "": checked first, so an algorithm's own requirements (hierarchy's
    ``expert_scales``, which these ops do not take) are never what an error names."""
    checks.in_range(p.comm_type, "comm_type", 0, 2, code="param")
    checks.one_of(p.comm_alg, "comm_alg", ("",), "the two-stage ops have no algorithm choice")


def two_stage_rules(p: Any, num_tokens: int, hidden: int, topk: int, op: str) -> None:
    """The rules of the two-stage form beyond the one-shot ops' and :func:`no_algorithm` (run first): no shared
    experts, a 1D mask; ``strict="a5"``: Ascend 950's ranges, URMA only, the HCCL window; other platforms refused."""
    plat = platform(p.strict)
    if p.shared_expert_rank_num or p.shared_expert_num > 1:
        why = f"{p.shared_expert_num} / shared_expert_rank_num {p.shared_expert_rank_num}: the two-stage ops "
        name = "shared_expert_rank_num" if p.shared_expert_rank_num else "shared_expert_num"
        raise invalid(name, why + "support no shared experts yet on any platform (pass 0 / 0)")
    if getattr(p, "x_active_mask", None) is not None and p.x_active_mask.dim() != 1:
        raise shape("x_active_mask", f"the two-stage ops take a 1D (Bs,) mask, got {tuple(p.x_active_mask.shape)}")
    if plat is None:
        return
    if plat != "a5":
        raise invalid("strict", f"got {p.strict!r}; the two-stage ops run on Ascend 950 only (their op definitions "
                      "register only ascend950; A2 / A3 are documented as unsupported): use strict='a5'")  # fmt: skip
    name, w = PLATFORM_NAMES[plat], p.ep_world_size
    if p.comm_type != 2:
        raise invalid("comm_type", f"got {p.comm_type}; {name} runs the two-stage ops on URMA only (comm_type 2)")
    checks.in_range(w, "ep_world_size", 2, 384)
    checks.in_range(p.moe_expert_num, "moe_expert_num", 1, 512)
    checks.in_range(hidden, "H (hidden size)", 1024, 8192)
    checks.in_range(num_tokens, "Bs (tokens)", 1, 512)
    checks.in_range(topk, "K (top-k)", 1, min(16, p.moe_expert_num))
    if p.global_bs and not num_tokens * w <= p.global_bs <= 512 * w:
        raise shape("global_bs", f"got {p.global_bs}; allowed 0 or [Bs * W, 512 * W] = [{num_tokens * w}, {512 * w}]")
    max_bs, num_local, factor = (p.global_bs or num_tokens * w) // w, p.moe_expert_num // w, 4  # the 950 doc's factor
    row, comb = align(align(2 * hidden, 32) + 44, 512), align(2 * hidden, 512)
    need = factor * (num_local * max_bs * w * row + topk * max_bs * comb)
    have = envs.hccl_buffsize_mb() or 200  # MB; HCCL's default window
    if have < 2 or have << 20 < need:
        formula = f"{factor} * (L * maxBs * W * Align512(Align32(2H) + 44) + K * maxBs * Align512(2H)) bytes"
        raise shape("HCCL_BUFFSIZE", f"{have} MB is too small for {op} on {name}: at least "
                    f"{max(2, -(-need >> 20))} MB (= {formula})")  # fmt: skip


@dataclasses.dataclass
class SetupParams(DispatchParams):
    """:class:`DispatchParams` of ``dispatch_setup``: the one-shot rules, then the two-stage ones."""

    op: ClassVar[str] = DISPATCH_SETUP
    _: dataclasses.KW_ONLY
    comm_type: Any = 0

    def validate(self) -> ValidDispatch:
        no_algorithm(self)
        v = super().validate()
        two_stage_rules(self, v.x.shape[0], v.x.shape[1], v.topk, DISPATCH_SETUP)
        if self.quant_mode and self.y_dtype is None:
            raise null("y_dtype", f"quant_mode {self.quant_mode} needs the quantized dtype (torch_npu gives y "
                       "x's dtype otherwise, which the op rejects)")  # fmt: skip
        return v


def _register(kind: str, group: dist.ProcessGroup, args: dict, tensors: dict, receive: Completion, size: int,
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
    t = checks.tensor(cmd, "comm_cmd_info", (torch.int32,), 1)
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
        if name == "group_ep":
            pg = resolve_group(value, "group_ep")
            same = pg is call.group
        else:
            same = value == call.args[name]
        if not same:
            raise invalid(name, f"is {value!r} but {op} call #{head[3]} (the one comm_cmd_info names) had "
                          f"{call.args[name]!r}; pass the same values, and that call's comm_cmd_info")  # fmt: skip
    for name, value in tensors.items():  # setup's outputs must be the same tensors, its inputs of the same shape
        ptr, size, dtype = call.tensors[name]
        checks.tensor(value, name, (dtype,), len(size))
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


def dispatch_setup(p: SetupParams) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, expand_idx, comm_cmd_info)`` of :func:`deep_ep_npu.ops.moe_distribute_dispatch_setup`."""
    receive = start_dispatch_flat(p)  # validated (on every rank), agreed; the payload is on its way
    x, ids, w, e = p.x, p.expert_ids.long(), p.ep_world_size, p.moe_expert_num
    (bs, k), dev, s = ids.shape, x.device, p.shared_expert_num
    sent = torch.ones_like(ids, dtype=torch.bool)
    if p.x_active_mask is not None:
        sent &= p.x_active_mask.to(dev).unsqueeze(1)
    flat = torch.where(sent, ids, e).view(-1)  # pairs not sent sort last
    order = torch.argsort(flat, stable=True)
    n = int(sent.sum())
    per_expert = torch.bincount(flat, minlength=e + 1)
    start = torch.cumsum(per_expert, 0) - per_expert
    expand_idx = torch.empty_like(flat)
    expand_idx[order] = torch.arange(flat.numel(), device=dev) - start[flat[order]]
    expand_idx = expand_idx.masked_fill_(~sent.view(-1), -1).to(torch.int32)
    y_dtype = resolve_dtype(p.y_dtype, "y_dtype") or x.dtype
    y = torch.zeros((bs * (k + s), _y_row_elements(p.quant_mode, x.shape[1])), dtype=y_dtype, device=dev)
    rows = x.index_select(0, order[:n] // k)
    if p.quant_mode == 0:
        y[:n, : x.shape[1]] = rows
    else:  # 1-byte data, then the scales at byte Align32(H) (mode 2), Align128(H) (3) or Align256(H) (4)
        smooth = None if p.scales is None else p.scales[flat[order[:n]]]  # row S + e of scales, S = 0 here
        q, scale = Quant(p.quant_mode, y_dtype)(rows, smooth)
        raw = y.view(torch.uint8)
        raw[:n, : x.shape[1]] = q.view(torch.uint8)
        at = align(x.shape[1], {2: 32, 3: 128, 4: 256}[p.quant_mode])
        scale_bytes = scale.reshape(n, scale.numel() // max(n, 1)).contiguous().view(torch.uint8)
        raw[:n, at : at + scale_bytes.shape[1]] = scale_bytes
    rows_per_dest = torch.bincount(flat[sent.view(-1)] // (e // w), minlength=w).tolist()
    args = {name: getattr(p, name) for name in (*_SHARED[1:], "quant_mode")}
    size = (bs * (k + s) + w * (e // w)) * 16
    tensors = {"x": x, "y": y, "expert_ids": p.expert_ids}
    cmd = _register("dispatch", resolve_group(p.group_ep, "group_ep"), args, tensors, receive, size, rows_per_dest, dev)
    return y, expand_idx, cmd


def dispatch_teardown(p: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(expand_x, dynamic_scales, assist_info_for_combine, expert_token_nums)`` of
    :func:`deep_ep_npu.ops.moe_distribute_dispatch_teardown` (``p``: its arguments by name)."""
    args = {name: p[name] for name in (*_SHARED, "quant_mode")}
    serial, call = _lookup("dispatch", p["comm_cmd_info"], args, {k: p[k] for k in ("x", "y", "expert_ids")})
    types = (1,) if platform(p["strict"]) == "a5" else (0, 1)  # Ascend 950 allows only counts
    checks.one_of(p["expert_token_nums_type"], "expert_token_nums_type", types)
    expand_x, scales, _, counts, ep_recv_counts, _, _ = _receive(serial, call)
    _IN_FLIGHT.pop(serial, None)
    cap, num_ranks_experts = expand_x.shape[0], p["moe_expert_num"]  # W * L = E (no shared-expert ranks)
    if p["quant_mode"] == 0:
        scales = torch.zeros((cap,), dtype=torch.float32, device=expand_x.device)
    assist = torch.zeros((cap * 128,), dtype=torch.int32, device=expand_x.device)
    assist[:num_ranks_experts] = ep_recv_counts[:num_ranks_experts]
    if p["expert_token_nums_type"] == 0:
        counts = counts.cumsum(0)
    return expand_x, scales, assist, counts


@dataclasses.dataclass
class CombineSetupParams(CombineParams):
    """The arguments of ``combine_setup`` (``ep_send_counts`` / ``expert_scales`` unused: None)."""

    _: dataclasses.KW_ONLY
    comm_type: Any = 0


def combine_setup(p: CombineSetupParams) -> tuple[torch.Tensor, torch.Tensor]:
    """``(quant_expand_x, comm_cmd_info)`` of :func:`deep_ep_npu.ops.moe_distribute_combine_setup`."""
    try:
        no_algorithm(p)
        layout = validate_layout(p)
        expand_x = checks.tensor(p.expand_x, "expand_x", NPU_ACT_DTYPES if p.strict else ACT_DTYPES, 2)
        ids = checks.tensor(p.expert_ids, "expert_ids", (torch.int32,) if p.strict else (torch.int32, torch.int64), 2)
        two_stage_rules(p, ids.shape[0], expand_x.shape[1], ids.shape[1], COMBINE_SETUP)
        checks.in_range(p.comm_quant_mode, "comm_quant_mode", 0, 2, code="param")
        checks.one_of(p.comm_quant_mode, "comm_quant_mode", (0,), "the two-stage combine does not quantize (only 0)")
        w, num_local = layout.world_size, layout.num_local_experts
        assist = checks.tensor(p.assist_info_for_combine, "assist_info_for_combine", (torch.int32,), 1)
        if assist.numel() < w * num_local:
            raise shape("assist_info_for_combine", f"has {assist.numel()} entries, needs W * L = {w * num_local}")
        cum = assist[: w * num_local].long()
        blocks = cum.diff(prepend=cum.new_zeros(1))
        capacity = (p.global_bs or ids.shape[0] * w) * min(num_local, ids.shape[1])
        total = int(cum[-1])
        if bool((blocks < 0).any()) or total > min(expand_x.shape[0], capacity):
            raise shape("assist_info_for_combine", f"its first W * L = {w * num_local} entries must be dispatch_"
                        f"teardown's prefix sums (non-decreasing, at most expand_x's {expand_x.shape[0]} rows and "
                        f"A = {capacity}); got a total of {total}")  # fmt: skip
    except MoeDistributeError as err:
        if (ep := group_or_none(p.group_ep, "group_ep")) is not None:
            ep.reject(COMBINE_SETUP, err.code, 1, len(COMBINE_NAMES))
        raise
    ep, dev, me = ep_group(layout.group), expand_x.device, layout.rank
    block = torch.repeat_interleave(torch.arange(w * num_local, device=dev), blocks, output_size=total)
    order = torch.argsort(block % w * num_local + block // w, stable=True)  # rows by (dest rank, local expert)
    per_dest = blocks.view(num_local, w).sum(0).tolist()
    fingerprint = (layout.num_moe_experts, expand_x.shape[1], DTYPE_CODES[expand_x.dtype], p.comm_quant_mode,
                   p.comm_type, p.global_bs)  # fmt: skip
    finish_agree = ep.start_agree(COMBINE_SETUP, STATUS_OK, [[c] for c in per_dest], fingerprint, device=dev)
    lo = sum(per_dest[:me])
    own = expand_x.index_select(0, order[lo : lo + per_dest[me]])
    send = expand_x.index_select(0, torch.cat([order[:lo], order[lo + per_dest[me] :]])).view(torch.uint8)
    agreement = finish_agree()
    agreement.check(me, COMBINE_NAMES)
    recv_rows = [0 if src == me else c[0] for src, c in enumerate(agreement.counts)]
    width = expand_x.shape[1] * expand_x.dtype.itemsize
    recv = torch.empty((sum(recv_rows), width), dtype=torch.uint8, device=dev)
    transfer = ep.transfer(recv, send, recv_rows, [0 if d == me else c for d, c in enumerate(per_dest)], COMBINE_SETUP)

    def finish() -> list[torch.Tensor]:  # the rows each source rank returned, by source rank
        transfer.wait()
        parts = list(recv.view(expand_x.dtype).split(recv_rows))
        parts[me] = own
        return parts

    h = expand_x.shape[1]
    qx = torch.zeros((expand_x.shape[0], align(align(h, 32) + align(h, 8) // 8 * 4, 512)), dtype=torch.int8, device=dev)
    args = {name: getattr(p, name) for name in (*_SHARED[1:], "comm_quant_mode")}
    cmd = _register("combine", layout.group, args, {"expand_x": expand_x, "quant_expand_x": qx}, Completion(finish),
                    (expand_x.shape[0] + w) * 16, per_dest, dev)  # fmt: skip
    return qx, cmd


def combine_teardown(p: dict[str, Any]) -> torch.Tensor:
    """``x`` `[Bs, H]` of :func:`deep_ep_npu.ops.moe_distribute_combine_teardown` (``p``: its arguments by name)."""
    args = {name: p[name] for name in (*_SHARED, "comm_quant_mode")}
    serial, call = _lookup("combine", p["comm_cmd_info"], args, {k: p[k] for k in ("expand_x", "quant_expand_x")})
    expand_x, e, w = p["expand_x"], p["moe_expert_num"], p["ep_world_size"]
    ids = checks.tensor(p["expert_ids"], "expert_ids", (torch.int32, torch.int64), 2)
    (bs, k), h, dev = ids.shape, expand_x.shape[1], expand_x.device
    idx = checks.tensor(p["expand_idx"], "expand_idx", (torch.int32,), 1)
    checks.dims(idx, "expand_idx", (bs * k,), "(Bs * K,)")
    weights = checks.tensor(p["expert_scales"], "expert_scales", (torch.float32,), 2)
    checks.dims(weights, "expert_scales", (bs, k), "(Bs, K)")
    active = bs
    valid = idx.view(bs, k).long() >= 0
    if (mask := checks.optional_tensor(p["x_active_mask"], "x_active_mask", (torch.bool,), 1)) is not None:
        active = checks.prefix_mask(mask, bs)
        valid &= mask.unsqueeze(1)
    shared_x = checks.optional_tensor(p["shared_expert_x"], "shared_expert_x", (expand_x.dtype,), (2, 3))
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
    got = [part.shape[0] for part in parts]
    want = per_expert.view(w, e // w).sum(1).tolist()
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
