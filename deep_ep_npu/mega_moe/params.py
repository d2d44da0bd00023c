"""Validated arguments of :func:`deep_ep_npu.mega_moe.mega_moe` (:func:`validate`: pure, first on every rank) and
the agreement step that makes every rank raise the same error (:func:`agree`)."""

import dataclasses
import struct
from typing import Any

import torch
import torch.distributed as dist

from .. import errors as checks
from ..errors import ACT_DTYPES, MAX_TOPK, invalid, shape
from ..group import DTYPE_CODES, STATUS_OK, EPGroup, ep_group
from ..group_names import resolve_group

MAX_WORLD_SIZE = 16  # the A5 PTO MegaMoE kernel: worldSize in [1, 16]
MAX_TOKENS_PER_RANK = 512  # the dispatch op's Bs limit
OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SEGMENT_BY = ("expert", "token")
FP32_MAX = torch.finfo(torch.float32).max  # swiglu_limit is the fused op's fp32 attribute
_FINGERPRINT = ("num_experts", "hidden", "N", "topk", "weight dtype", "out_dtype", "num_max_dispatch_tokens_per_rank",
                "num_segments", "segment_by", "swiglu_limit")  # fmt: skip
AGREE_WIDTH = 1 + len(_FINGERPRINT)  # can_fuse, then the fingerprint


@dataclasses.dataclass(frozen=True)
class MegaMoeArgs:
    """One rank's validated call. ``topk_idx`` is int64 with ``-1`` kept (no expert), and -1 in every row outside
    ``x_active_mask`` (whose ``topk_weights`` rows are 0); ``x_active_mask`` `[M]` `torch.bool` (a prefix) or None;
    ``swiglu_limit`` 0.0: no clamp; ``ep`` None: the ops' group; ``transport``: a Buffer's (its shared-memory window on
    one host), None: the collective path."""

    group: dist.ProcessGroup
    world_size: int
    rank: int
    x: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    w1_scale: torch.Tensor | None
    w2_scale: torch.Tensor | None
    num_max_dispatch_tokens_per_rank: int
    num_experts: int
    out_dtype: torch.dtype
    max_output_size: int
    num_segments: int
    segment_by: str
    x_active_mask: torch.Tensor | None = None
    swiglu_limit: float = 0.0
    ep: EPGroup | None = None
    transport: Any = None  # how the pipeline's rows move (a Buffer's engine transport); None: the collective path

    num_tokens = property(lambda self: self.x.shape[0])
    hidden = property(lambda self: self.x.shape[1])
    topk = property(lambda self: self.topk_idx.shape[1])
    num_local_experts = property(lambda self: self.num_experts // self.world_size)
    intermediate = property(lambda self: self.w2.shape[1], doc="N: the FFN size (w1 has 2N columns, gate then up).")
    int8_weights = property(lambda self: self.w1_scale is not None)
    num_active = property(lambda self: self.num_tokens if self.x_active_mask is None else int(self.x_active_mask.sum()))

    def segment_experts(self, s: int) -> range:
        """Local experts computed in segment ``s``: contiguous groups of sizes differing by at most one with
        ``segment_by="expert"``, every local expert with ``"token"``."""
        n, num_local = self.num_segments, self.num_local_experts
        return range(num_local) if self.segment_by == "token" else range(s * num_local // n, (s + 1) * num_local // n)

    def fingerprint(self) -> tuple[int, ...]:
        return (self.num_experts, self.hidden, self.intermediate, self.topk, DTYPE_CODES[self.w1.dtype],
                DTYPE_CODES[self.out_dtype], self.num_max_dispatch_tokens_per_rank, self.num_segments,
                SEGMENT_BY.index(self.segment_by), fp32_bits(self.swiglu_limit))  # fmt: skip


def fp32_bits(value: float) -> int:
    """The IEEE fp32 bit pattern of ``value`` as an int (what the fused op's ``float`` attribute holds)."""
    return struct.unpack("<i", struct.pack("<f", value))[0]


def validate(group: object, x: object, topk_idx: object, topk_weights: object, w1: object, w2: object, *,
             w1_scale: object = None, w2_scale: object = None, num_max_dispatch_tokens_per_rank: int, num_experts: int,
             out_dtype: torch.dtype | None = None, max_output_size: int | None = None, num_segments: int | None = None,
             segment_by: str = "expert", x_active_mask: object = None, swiglu_limit: float | None = None,
             ep: EPGroup | None = None) -> MegaMoeArgs:  # fmt: skip
    """Check every argument (no communication); raise :class:`MoeDistributeError` naming the parameter."""
    pg, nmax = resolve_group(group, "group"), num_max_dispatch_tokens_per_rank
    ep, w, rank = ep or ep_group(pg), dist.get_world_size(pg), dist.get_rank(pg)
    checks.in_range(w, "group world size", 1, MAX_WORLD_SIZE)
    checks.in_range(nmax, "num_max_dispatch_tokens_per_rank", 1, MAX_TOKENS_PER_RANK)
    checks.in_range(num_experts, "num_experts", 1, 1 << 16)
    if num_experts % w:
        raise shape("num_experts", f"{num_experts} is not divisible by the world size {w}")
    num_local = num_experts // w
    x = checks.tensor(x, "x", ACT_DTYPES, 2)
    num_tokens, hidden = x.shape
    if hidden < 1:
        raise shape("x", f"hidden size (dim 1) must be >= 1, got shape {tuple(x.shape)}")
    if num_tokens > nmax:
        raise shape("x", f"has {num_tokens} tokens, more than num_max_dispatch_tokens_per_rank = {nmax}")
    mask = checks.optional_tensor(x_active_mask, "x_active_mask", (torch.bool,), 1)
    active = num_tokens
    if mask is not None:
        if mask.shape[0] != num_tokens:
            raise shape("x_active_mask", f"has {mask.shape[0]} entries; must have M = {num_tokens} (one per token)")
        mask = mask.to(x.device)
        if (active := int(mask.sum())) and not bool(mask[:active].all()):
            raise shape("x_active_mask", "must mark a prefix of active tokens (all True entries first)")
    ids = checks.tensor(topk_idx, "topk_idx", (torch.int32, torch.int64), 2)
    if ids.shape[0] != num_tokens:
        raise shape("topk_idx", f"has {ids.shape[0]} rows but x has {num_tokens} tokens")
    checks.expert_ids(ids[:active], "topk_idx", num_experts, active, MAX_TOPK, no_expert=True)  # active rows only
    idx, topk = ids.long(), ids.shape[1]
    weights = checks.tensor(topk_weights, "topk_weights", (torch.float32,), 2)
    checks.dims(weights, "topk_weights", (num_tokens, topk), "(M, topK)")
    if active < num_tokens:  # rows outside the mask may hold anything: they route nowhere and weigh 0
        idx, weights = idx.clone(), weights.clone()
        idx[active:], weights[active:] = -1, 0.0
    limit = 0.0 if swiglu_limit is None else swiglu_limit
    if isinstance(limit, bool) or not isinstance(limit, int | float) or not 0 <= limit <= FP32_MAX:
        allowed = f"None or a float in [0, {FP32_MAX:.4g}] (0: no clamp)"
        raise invalid("swiglu_limit", f"got {swiglu_limit!r}, allowed {allowed}")
    if (w1_scale is None) != (w2_scale is None):
        both = "w1_scale and w2_scale must be given together (int8 weights) or both be None (float weights)"
        raise invalid("w2_scale" if w2_scale is None else "w1_scale", both)
    int8 = w1_scale is not None
    wdt = (torch.int8,) if int8 else ACT_DTYPES
    why = "int8 because scales are given" if int8 else "bf16/fp16/fp32 (int8 needs w1_scale and w2_scale)"
    for name, t in (("w1", w1), ("w2", w2)):
        if isinstance(t, torch.Tensor) and t.dtype not in wdt:
            raise invalid(name, f"dtype {t.dtype} not allowed here; must be {why}")
    w1, w2 = checks.tensor(w1, "w1", wdt, 3), checks.tensor(w2, "w2", wdt, 3)
    if tuple(w1.shape[:2]) != (num_local, hidden) or w1.shape[2] % 2 or w1.shape[2] == 0:
        want = f"[E_local = {num_local}, K = {hidden}, 2N] (gate then up, 2N > 0)"
        raise shape("w1", f"shape {tuple(w1.shape)} must be {want}")
    n = w1.shape[2] // 2
    checks.dims(w2, "w2", (num_local, n, hidden), "[E_local, N, K]")
    if w1.dtype != w2.dtype:
        raise invalid("w2", f"dtype {w2.dtype} differs from w1's {w1.dtype}")
    scales = (("w1_scale", w1_scale, 2 * n, "[E_local, 2N]"), ("w2_scale", w2_scale, hidden, "[E_local, K]"))
    for name, s, cols, what in scales if int8 else ():
        checks.dims(checks.tensor(s, name, (torch.float32,), 2), name, (num_local, cols), what)
    out_dtype = x.dtype if out_dtype is None else out_dtype
    checks.one_of(out_dtype, "out_dtype", OUT_DTYPES)
    max_output_size = nmax * topk * w if max_output_size is None else max_output_size
    checks.in_range(max_output_size, "max_output_size", 0, 1 << 40)
    if max_output_size < num_tokens * topk:
        why = "the routed-row workspace must hold every (token, expert) pair of this rank"
        raise shape("max_output_size", f"{max_output_size} < M * topK = {num_tokens} * {topk}; {why}")
    checks.one_of(segment_by, "segment_by", SEGMENT_BY)
    most = num_local if segment_by == "expert" else nmax
    num_segments = min(most, 2) if num_segments is None else num_segments  # 2: measured best on the CPU reference
    checks.in_range(num_segments, "num_segments", 1, most)
    return MegaMoeArgs(pg, w, rank, x, idx, weights, w1, w2, w1_scale, w2_scale,  # type: ignore[arg-type]
                       nmax, num_experts, out_dtype, max_output_size, num_segments, segment_by, mask,
                       float(limit), ep)  # fmt: skip


def agree(ep: EPGroup, fingerprint: tuple[int, ...], can_fuse: bool, device: torch.device | None) -> bool:
    """The agreement step of a valid call (a rejected one: ``ep.reject("mega_moe", code, 0, AGREE_WIDTH)``): ranks
    that disagree on a shape raise on every rank. Returns whether every rank can fuse."""
    row = [int(can_fuse), *fingerprint]
    agreement = ep.start_agree("mega_moe", STATUS_OK, [[]] * ep.num_ranks, row, device=device)()
    agreement.check(ep.rank, _FINGERPRINT, offset=1)
    return all(fp[0] for fp in agreement.shared)
