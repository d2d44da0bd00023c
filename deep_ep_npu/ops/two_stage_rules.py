"""What the two-stage ops check beyond the one-shot ops' rules: a setup's arguments (:func:`check_setup`), and that a
teardown repeats its setup's, found by the ``comm_cmd_info`` the setup returned (:func:`register` at the setup,
:func:`lookup` at the teardown). Compared: torch_npu's keywords (:data:`KEYWORDS` and the quant mode), not ``strict``:
the real ops take no such argument, so a teardown's ``strict`` only sets its own platform limits (dispatch_teardown's
``expert_token_nums_type``).

``comm_cmd_info`` (`torch.int32`, opaque scratch on the NPU): ``[0]`` a marker, ``[1]`` the kind (1 dispatch,
2 combine), ``[2]`` this process's tag, ``[3]`` the call's serial number, ``[4]`` W, ``[5]`` the rank, ``[16 : 16 + W]``
the rows sent to each rank. A teardown given another call's, a finished call's or another kind's raises.
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
from ..backends import InFlight
from ..core import rules
from ..core.ascend import PLATFORM_NAMES
from ..core.call import Experts
from ..errors import invalid, shape
from ..sizes import align
from ..transports.names import resolve_group

MARKER, KINDS, TAG = 0x75D15C0, {"dispatch": 1, "combine": 2}, secrets.randbits(31)
MAX_IN_FLIGHT = 64  # calls set up and not torn down; the oldest is dropped beyond this
OUTPUTS = ("y", "quant_expand_x")  # setup outputs that the teardown takes back (the same tensors)
KEYWORDS = ("group_ep", "ep_world_size", "ep_rank_id", "moe_expert_num", "expert_shard_type", "shared_expert_num",
            "shared_expert_rank_num", "global_bs", "comm_type", "comm_alg")  # fmt: skip
_serial = itertools.count(1)


def check_setup(
    op: str, strict: object, e: Experts, comm_type: int, mask: object, bs: int, h: int, k: int, global_bs: int
) -> None:
    """A setup's rules beyond the one-shot ops': no shared experts, a 1D mask; ``strict="a5"``: Ascend 950's ranges,
    URMA only, the HCCL window; other platforms refused."""
    if sr := e.shared_expert_rank_num:  # (shared_expert_num > 1 without shared-expert ranks: refused by experts())
        why = "the two-stage ops support no shared experts yet on any platform (pass 0 / 0)"
        raise invalid("shared_expert_rank_num", f"{e.shared_expert_num} / shared_expert_rank_num {sr}: {why}")
    if isinstance(mask, torch.Tensor) and mask.dim() != 1:
        raise shape("x_active_mask", f"the two-stage ops take a 1D (Bs,) mask, got {tuple(mask.shape)}")
    if e.platform is None:
        return
    if e.platform != "a5":
        why = "their op definitions register only ascend950; A2 / A3 are documented as unsupported"
        raise invalid("strict", f"got {strict!r}; the two-stage ops run on Ascend 950 only ({why}): use strict='a5'")
    name, w = PLATFORM_NAMES["a5"], rules.in_range(e.world_size, "ep_world_size", 2, 384)
    if comm_type != 2:
        raise invalid("comm_type", f"got {comm_type}; {name} runs the two-stage ops on URMA only (comm_type 2)")
    rules.in_range(e.num_moe_experts, "moe_expert_num", 1, 512)
    rules.in_range(h, "H (hidden size)", 1024, 8192)
    rules.in_range(bs, "Bs (tokens)", 1, 512)
    rules.in_range(k, "K (top-k)", 1, min(16, e.num_moe_experts))
    if global_bs and not bs * w <= int(global_bs) <= 512 * w:
        raise shape("global_bs", f"got {global_bs}; allowed 0 or [Bs * W, 512 * W] = [{bs * w}, {512 * w}]")
    max_bs, num_local = (int(global_bs) or bs * w) // w, e.num_moe_experts // w
    row, comb = align(align(2 * h, 32) + 44, 512), align(2 * h, 512)
    need = 4 * (num_local * max_bs * w * row + k * max_bs * comb)  # the 950 doc's formula
    have = envs.hccl_buffsize_mb() or 200  # MB; HCCL's default window
    if have < 2 or have << 20 < need:
        formula = "4 * (L * maxBs * W * Align512(Align32(2H) + 44) + K * maxBs * Align512(2H)) bytes"
        why = f"at least {max(2, -(-need >> 20))} MB (= {formula})"
        raise shape("HCCL_BUFFSIZE", f"{have} MB is too small for {op} on {name}: {why}")


def keywords(quant: str, *values: Any) -> dict[str, Any]:
    """What a teardown must repeat from its setup, by name: the values of :data:`KEYWORDS`, in order, then the quant
    mode (named ``quant``)."""
    return dict(zip((*KEYWORDS, quant), values, strict=True))


@dataclasses.dataclass
class Call:
    """A setup whose teardown has not run; ``tensors``: name -> (data_ptr, shape, dtype) at the setup."""

    serial: int
    group: dist.ProcessGroup
    args: dict[str, Any]
    tensors: dict[str, tuple[int, tuple[int, ...], torch.dtype]]
    receive: InFlight

    def wait(self) -> Any:
        """The receive phase; a failed one is no longer in flight (a retry could only raise the same error)."""
        try:
            return self.receive.wait()
        except BaseException:
            self.done()
            raise

    def done(self) -> None:
        _IN_FLIGHT.pop(self.serial, None)


_IN_FLIGHT: collections.OrderedDict[int, Call] = collections.OrderedDict()


def register(
    kind: str, group: dist.ProcessGroup, args: dict, tensors: dict, receive: InFlight, size: int, rows_per_dest: list
) -> torch.Tensor:
    """Keep a setup's call in flight; returns its ``comm_cmd_info`` `[size]`, on the device of its first tensor."""
    serial = next(_serial) & 0x7FFFFFFF
    w, rank = dist.get_world_size(group), dist.get_rank(group)
    head = torch.tensor([MARKER, KINDS[kind], TAG, serial, w, rank, *[0] * 10, *rows_per_dest], dtype=torch.int32)
    cmd = torch.zeros((max(size, len(head)),), dtype=torch.int32, device=next(iter(tensors.values())).device)
    cmd[: len(head)] = head
    seen = {name: (t.data_ptr(), tuple(t.shape), t.dtype) for name, t in {**tensors, "comm_cmd_info": cmd}.items()}
    _IN_FLIGHT[serial] = Call(serial, group, args, seen, receive)
    while len(_IN_FLIGHT) > MAX_IN_FLIGHT:
        _IN_FLIGHT.popitem(last=False)
    return cmd


def lookup(kind: str, cmd: object, args: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Call:
    """The call ``cmd`` (a ``comm_cmd_info``) keys, after checking that ``args`` and ``tensors`` are its setup's: the
    same values, the same output tensors, inputs of the same shapes."""
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
    which = f"{op} call #{head[3]} (the one comm_cmd_info names)"
    for name, value in args.items():
        same = resolve_group(value, name) is call.group if name == "group_ep" else value == call.args[name]
        if not same:
            why = f"is {value!r} but {which} had {call.args[name]!r}"
            raise invalid(name, f"{why}; pass the same values, and that call's comm_cmd_info")
    for name, value in {"comm_cmd_info": t, **tensors}.items():  # comm_cmd_info whole: a slice is refused
        ptr, size, dtype = call.tensors[name]
        rules.tensor(value, name, (dtype,), len(size))
        if tuple(value.shape) != size or (name in OUTPUTS and value.data_ptr() != ptr):
            what = "returned by" if name in OUTPUTS else f"of the shape {size} given to"
            raise invalid(name, f"is not the tensor {what} {which}; pass that call's tensors and its comm_cmd_info")
    return call
