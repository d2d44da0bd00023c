"""The stand-in of vllm-ascend's fused MegaMoE op ``torch.ops._C_ascend.dispatch_ffn_combine`` (CPU tensors).

:func:`register` defines the op with vllm-ascend's schema (:data:`SCHEMA`) and its CPU kernel,
:func:`dispatch_ffn_combine`: the reference MegaMoE pipeline (:mod:`deep_ep_npu.engine.pipeline`, numerics in
:mod:`deep_ep_npu.engine.ffn`) over the group ``group`` names (a :func:`deep_ep_npu.sim.hccl_comm_name`, or a c10d
group name). What it takes, as the op:

- ``x`` `[M, K]` `torch.bfloat16` / `torch.float16`, M <= 512; ``expert_idx`` `[M, topK]` `torch.int32`, ids in
  ``[0, E_local * W)`` (no -1); ``probs`` `[M, topK]` `torch.float32`; ``out`` `[M, K]` in x's dtype;
  ``expert_token_nums`` `torch.int32` with E_local elements: set to the rows each local expert received.
- weights: one-item lists ``[w1]`` `[E_local, K, 2N]` / ``[w2]`` `[E_local, N, K]`, or E_local-long lists of
  `[K, 2N]` / `[N, K]` (w1's 2N columns: gate, then up); either `torch.int8`, with ``scale1`` / ``scale2`` the int64
  Fixpipe words of the fp32 per-channel scales (`[E_local, 2N]` / `[E_local, K]`, whole or per expert; decoded by
  :func:`deep_ep_npu.backends.ascend_mega.fixpipe_scale_value`), or x's dtype (scales unused). int32 (packed int4,
  the W4A8 kernel) is not simulated; ``bias1`` / ``bias2`` are ignored (vllm-ascend passes them to W4A8 only).
- ``x_active_mask`` `[M]` `torch.bool` or None: an inactive token is not dispatched, its ids and probs are not checked
  and its output row is 0. ``swiglu_limit``: the SwiGLU clamp when > 0 (gate <= L, |up| <= L; 0 or less: none; the
  schema default clamps at 1e6). With float weights both are ignored (vllm-ascend's bf16 adapter does not pass them).
- ``max_output_size``: the routed-row workspace, >= M * topK.

Errors raise :class:`deep_ep_npu.errors.MoeDistributeError` on every rank: one agreement step first exchanges each
rank's status and M (the largest M is ``num_max_dispatch_tokens_per_rank``), then the pipeline's own checks run.
"""

from __future__ import annotations

import torch

from ..backends.ascend_mega import fixpipe_scale_value
from ..core.call import FFN
from ..core.rules import tensor as checked
from ..engine.exchange import check_status, engine_for
from ..engine.pipeline import run
from ..errors import MoeDistributeError, invalid, shape
from ..mega_moe import prepare
from ..transports.agreement import STATUS_OK
from ..transports.names import resolve_group
from .custom_op import CustomOp

SCHEMA = (
    "dispatch_ffn_combine(Tensor x, Tensor[] weight1, Tensor[] weight2, Tensor expert_idx, Tensor[] scale1, "
    "Tensor[] scale2, Tensor[] bias1, Tensor[] bias2, Tensor probs, str group, int max_output_size, Tensor(a!) out, "
    "Tensor(b!) expert_token_nums, Tensor? x_active_mask=None, float swiglu_limit=1000000.0) "
    "-> (Tensor(a!) out, Tensor(b!) expert_token_nums)"
)
MAX_TOKENS = 512  # the op's per-rank token cap (vllm-ascend's dispatch_ffn_combine capacity)


def _stack(tensors: list[torch.Tensor], param: str, dtype: torch.dtype, inner: int) -> torch.Tensor:
    """A weight list as one `[E_local, ...]` tensor: one item with ``inner + 1`` dims, or E_local items of ``inner``."""
    if not tensors:
        raise shape(param, "is an empty list; pass [w] with w [E_local, ...] or one tensor per local expert")
    for t in tensors:
        if t.dtype != dtype:
            raise invalid(param, f"dtype {t.dtype} differs from {param}[0]'s {dtype}; every item needs the same")
    want = inner + 1 if len(tensors) == 1 else inner
    if any(t.dim() != want for t in tensors):
        dims = [t.dim() for t in tensors]
        raise shape(param, f"items have {dims} dims; a one-item list needs {inner + 1}, an E_local-long one {inner}")
    return tensors[0] if len(tensors) == 1 else torch.stack(tensors)


def _scales(words: list[torch.Tensor], param: str, num_local: int, cols: int) -> torch.Tensor:
    """Int64 Fixpipe scale words -> `[E_local, cols]` `torch.float32` per-channel scales."""
    if any(w.dtype != torch.int64 for w in words) or not words:
        raise invalid(param, f"must be int64 Fixpipe scale words (got {[str(w.dtype) for w in words]})")
    flat = torch.cat([w.reshape(-1) for w in words])
    if flat.numel() != num_local * cols:
        raise shape(param, f"holds {flat.numel()} scales, expected E_local * {cols} = {num_local * cols}")
    return fixpipe_scale_value(flat).reshape(num_local, cols)


def _weights(
    x: torch.Tensor, weight1: list[torch.Tensor], weight2: list[torch.Tensor], scale: tuple[list[torch.Tensor], ...]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Check ``x`` and the weights; returns w1 `[E_local, K, 2N]`, w2 `[E_local, N, K]` and, for int8 weights, the
    fp32 scales of ``scale`` (scale1, scale2), else None."""
    x = checked(x, "x", (torch.bfloat16, torch.float16), 2)
    if x.shape[0] > MAX_TOKENS:
        raise shape("x", f"has {x.shape[0]} tokens; the op takes at most {MAX_TOKENS} per rank")
    wdt = weight1[0].dtype if weight1 else torch.int8
    if wdt == torch.int32:
        raise invalid("weight1", "int32 (packed int4, the W4A8 kernel) is not simulated; use int8 or x's dtype")
    if wdt not in (torch.int8, x.dtype):
        raise invalid("weight1", f"dtype {wdt} not supported; allowed int8 or x's dtype {x.dtype}")
    w1, w2 = _stack(list(weight1), "weight1", wdt, 2), _stack(list(weight2), "weight2", wdt, 2)
    if wdt != torch.int8:
        return w1, w2, None, None
    num_local, hidden, n2 = w1.shape
    s1, s2 = _scales(list(scale[0]), "scale1", num_local, n2), _scales(list(scale[1]), "scale2", num_local, hidden)
    return w1, w2, s1, s2


def _routing(
    x: torch.Tensor,
    expert_idx: torch.Tensor,
    probs: torch.Tensor,
    outputs: tuple[torch.Tensor, torch.Tensor],
    x_active_mask: torch.Tensor | None,
    num_local: int,
    world_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Check the routing and the ``outputs`` (out, expert_token_nums); returns the ids (int64, -1 outside
    ``x_active_mask``) and the probs (0 there)."""
    (out, expert_token_nums), ids = outputs, checked(expert_idx, "expert_idx", (torch.int32,), 2)
    if ids.shape[0] != x.shape[0] or tuple(probs.shape) != tuple(ids.shape):
        what = f"expert_idx {tuple(ids.shape)}, probs {tuple(probs.shape)}"
        raise shape("expert_idx", f"{what}; both must be [M = {x.shape[0]}, topK]")
    if tuple(out.shape) != tuple(x.shape) or out.dtype != x.dtype:
        raise shape("out", f"is {tuple(out.shape)} {out.dtype}; must be x's shape {tuple(x.shape)} and dtype")
    if expert_token_nums.dtype != torch.int32 or expert_token_nums.numel() != num_local:
        what = f"{tuple(expert_token_nums.shape)} {expert_token_nums.dtype}"
        raise shape("expert_token_nums", f"is {what}; must be torch.int32 with E_local = {num_local} elements")
    active = torch.ones((x.shape[0],), dtype=torch.bool, device=x.device)
    if x_active_mask is not None:
        active = checked(x_active_mask, "x_active_mask", (torch.bool,), 1).to(x.device)
        if active.shape[0] != x.shape[0]:
            raise shape("x_active_mask", f"has {active.shape[0]} entries, expected M = {x.shape[0]}")
    rows = ids[active]
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= num_local * world_size):
        bad = int(rows.min()) if int(rows.min()) < 0 else int(rows.max())
        raise shape("expert_idx", f"contains {bad}, allowed [0, {num_local * world_size}) (the op has no -1)")
    return ids.long().masked_fill(~active.unsqueeze(1), -1), probs.masked_fill(~active.unsqueeze(1), 0.0)


def dispatch_ffn_combine(
    x: torch.Tensor,
    weight1: list[torch.Tensor],
    weight2: list[torch.Tensor],
    expert_idx: torch.Tensor,
    scale1: list[torch.Tensor],
    scale2: list[torch.Tensor],
    bias1: list[torch.Tensor],
    bias2: list[torch.Tensor],
    probs: torch.Tensor,
    group: str,
    max_output_size: int,
    out: torch.Tensor,
    expert_token_nums: torch.Tensor,
    x_active_mask: torch.Tensor | None = None,
    swiglu_limit: float = 1000000.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's CPU kernel (the module docstring's semantics): writes ``out`` `[M, K]` (x's dtype) and
    ``expert_token_nums`` (`torch.int32`, E_local elements) and returns them. Collective over ``group``."""
    engine = engine_for(resolve_group(group, "group"))
    ep = engine.ep
    no_rows: list[list[int]] = [[] for _ in range(ep.num_ranks)]  # (no counts: the pipeline's calls send the rows)
    try:
        w1, w2, s1, s2 = _weights(x, weight1, weight2, (scale1, scale2))
        mask = x_active_mask if s1 is not None else None  # (float weights: the mask is ignored)
        ids, probs = _routing(x, expert_idx, probs, (out, expert_token_nums), mask, w1.shape[0], ep.num_ranks)
    except MoeDistributeError as err:
        ep.start_agree(OP.name, err.code, no_rows, [x.shape[0]], device=x.device)()
        raise
    agreement = ep.start_agree(OP.name, STATUS_OK, no_rows, [x.shape[0]], device=x.device)()
    check_status(agreement)
    limit = float(swiglu_limit) if s1 is not None and 0 < swiglu_limit <= torch.finfo(torch.float32).max else 0.0
    ffn = FFN(w1, w2, s1, s2, x.dtype, limit, None, "expert", max_output_size)
    num_max = max([1, *(fp[0] for fp in agreement.shared)])
    call, ffn, _ = prepare(engine, x, ids, probs, ffn, num_max, w1.shape[0] * ep.num_ranks, None)
    counts = torch.zeros((w1.shape[0],), dtype=torch.int64, device=x.device)
    out.copy_(run(engine, call, ffn, counts))
    expert_token_nums.copy_(counts.view(expert_token_nums.shape))
    return out, expert_token_nums


OP = CustomOp(SCHEMA, dispatch_ffn_combine)
register, unregister, registered = OP.register, OP.unregister, OP.registered
