"""The communication context of CANN's V3 context ops (``Mc2MoeContext``, CANN's
``mc2/common/op_kernel/mc2_moe_context.h``): an `int32` tensor naming one rank of one EP communicator, built by
:func:`create_context` and read back by :func:`context_group`.

Layouts (little-endian, a u64 spans two int32, low word first): ``"old"`` (``update_context``, 2052 int32 = 8208 B:
``u64 epRankId`` @0, ``u64 kfcContextAddr`` @8, ``u64 epHcclBuffer[1024]`` @16) and ``"new"`` (``CommContextManager``,
4100 int32 = 16400 B: ``u32 epRankId`` @0, ``u32 rankSizePerServer`` @4 (0: KFC), ``u64 kfcContextAddr`` @8,
``u64 epHcclBuffer[1024]`` @16, ``u64 hcommHandle[1024]`` @8208, all 0 with KFC). Here ``kfcContextAddr`` is
``CONTEXT_MAGIC << 32 | key`` (``key``: the communicator, from its c10d group name) and ``epHcclBuffer[r]`` is rank
r's window token ``key << 32 | (r + 1)``; unused entries are 0."""

from __future__ import annotations

import weakref
import zlib

import torch
import torch.distributed as dist

from .. import envs
from ..errors import invalid, shape
from ..sizes import ccl_buffer_bytes

CONTEXT_MAGIC = 0x44455043  # "DEPC"
LAYOUTS = {"old": 2052, "new": 4100}  # int32 elements
MAX_RANKS = 1024
_MB = 1 << 20
_GROUPS: dict[int, tuple[weakref.ref[dist.ProcessGroup], int]] = {}  # key -> (group, CCL bytes)
_READ: dict[int, tuple[weakref.ref[torch.Tensor], int, list[int]]] = {}  # id -> (context, version, its words)


def default_ccl_bytes() -> int:
    """The CCL window a communicator has: twice ``HCCL_BUFFSIZE`` MB (default 200; HCCL allocates two windows of that
    size, which is why ``get_low_latency_ccl_buffer_size`` halves its need), in bytes."""
    return 2 * (envs.hccl_buffsize_mb() or 200) * _MB


def create_context(group: dist.ProcessGroup, layout: str = "new", out: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's context of ``group`` (`[2052]` ``"old"`` / `[4100]` ``"new"`` `torch.int32`), written into ``out``
    when given (in place, as ``update_ctx`` does). The communicator's CCL size is :func:`default_ccl_bytes`."""
    if layout not in LAYOUTS:
        raise invalid("layout", f"got {layout!r}; allowed {sorted(LAYOUTS)}")
    w, rank = dist.get_world_size(group), dist.get_rank(group)
    if w > MAX_RANKS:
        raise shape("group", f"has {w} ranks; the context holds at most {MAX_RANKS}")
    key = zlib.crc32(dist.get_process_group_ranks(group).__repr__().encode() + group.group_name.encode()) & 0x7FFFFFFF
    _GROUPS[key] = (weakref.ref(group), default_ccl_bytes())
    words = torch.zeros((LAYOUTS[layout] // 2,), dtype=torch.int64)
    words[0], words[1] = rank, CONTEXT_MAGIC << 32 | key
    words[2 : 2 + w] = (key << 32) + torch.arange(1, w + 1)
    context = words.view(torch.int32)
    if out is None:
        return context
    out.copy_(context)
    _READ.pop(id(out), None)  # (read again at its next use, also an inference tensor's)
    return out


def context_group(context: object) -> tuple[dist.ProcessGroup, int]:
    """The group and CCL bytes that ``context`` names. Raises :class:`~deep_ep_npu.errors.MoeDistributeError` naming
    ``context`` when it is not a context of this process (no communication: the group is unknown)."""
    if not isinstance(context, torch.Tensor) or context.dtype != torch.int32 or context.dim() != 1:
        got = f"{context.dtype} {tuple(context.shape)}" if isinstance(context, torch.Tensor) else type(context).__name__
        raise invalid("context", f"must be a 1-D torch.int32 communication context, got {got}")
    if context.numel() not in LAYOUTS.values():
        raise shape("context", f"has {context.numel()} int32; a context has {sorted(LAYOUTS.values())} (old / new)")
    word = _words(context)[1]
    entry = _GROUPS.get(word & 0xFFFFFFFF) if word >> 32 == CONTEXT_MAGIC else None
    group = entry[0]() if entry else None
    if entry is None or group is None:
        why = "build it with MoeDistributeBuffer / deep_ep_npu.ops.create_context in this process"
        raise invalid("context", f"names no communicator of this process ({why})")
    return group, entry[1]


def _words(context: torch.Tensor) -> list[int]:
    """The u64 words of ``context`` (up to its windows), read once per tensor and per in-place change (its version;
    an inference tensor has none: it is read again only when :func:`create_context` rewrites it): a device context is
    not read back on every call."""
    seen, version = _READ.get(id(context)), -1 if context.is_inference() else context._version
    if seen is None or seen[0]() is not context or seen[1] != version:
        words = context[: 2 * (2 + MAX_RANKS)].cpu().view(torch.int64).tolist()
        _READ[id(context)] = seen = (weakref.ref(context), version, words)
        weakref.finalize(context, _READ.pop, id(context), None)
    return seen[2]


def check_context(context: torch.Tensor, group: dist.ProcessGroup, ep_world_size: object, ep_rank_id: object) -> None:
    """``context`` holds its communicator's windows and was built for this rank; ``ep_world_size`` / ``ep_rank_id``
    match it."""
    words = _words(context)
    key, w, rank, ctx_rank = words[1] & 0xFFFFFFFF, group.size(), group.rank(), words[0] & 0xFFFFFFFF
    if words[2 : 2 + w] != [(key << 32) + r for r in range(1, w + 1)] or any(words[2 + w : 2 + MAX_RANKS]):
        raise invalid("context", f"epHcclBuffer does not hold the {w} windows of its communicator")
    if ctx_rank != rank:
        raise shape("context", f"was built for rank {ctx_rank} of its communicator; this process is rank {rank}")
    if ep_world_size != w:
        raise shape("ep_world_size", f"is {ep_world_size!r} but the context's communicator has {w} ranks")
    if ep_rank_id != rank:
        raise shape("ep_rank_id", f"is {ep_rank_id!r} but the context is rank {rank}'s")


def check_ccl(
    ccl_buffer_size: object,
    have: int,
    world_size: int,
    max_bs: int,
    hidden: int,
    num_local: int,
    topk: int,
    shared: int,
    comm_alg: str,
) -> None:
    """``ccl_buffer_size`` (bytes, the op attribute): within the context's ``have`` bytes and at least what the shapes
    need (the tiling's ``2 * (maxBs * tokDisp * W * L + maxBs * tokComb * (K + S)) + 1 MB``)."""
    if isinstance(ccl_buffer_size, bool) or not isinstance(ccl_buffer_size, int) or ccl_buffer_size < 1:
        raise invalid("ccl_buffer_size", f"must be a positive int (bytes), got {ccl_buffer_size!r}")
    if ccl_buffer_size > have:
        raise shape("ccl_buffer_size", f"{ccl_buffer_size} bytes exceeds the context's CCL buffer ({have} bytes)")
    need = ccl_buffer_bytes(world_size, max_bs, hidden, num_local, topk, shared, comm_alg)
    if ccl_buffer_size < need:
        shapes = f"W={world_size}, max Bs={max_bs}, H={hidden}, L={num_local}, K={topk}, S={shared}"
        raise shape("ccl_buffer_size", f"{ccl_buffer_size} bytes is too small for {shapes}: {need} bytes are needed")
