"""CANN ops-transformer's own ``ElasticBuffer`` (``cann_ops_transformer.ops``, Ascend 950;
https://github.com/cannmirror/ops-transformer/blob/25fb6b9/torch_extension/cann_ops_transformer/ops/elastic_buffer.py),
distinct from DeepEP V2's :class:`deep_ep_npu.ElasticBuffer`, on which it runs (expand layout, every row returned,
alignment 1). What the kernels do is followed where CANN's docs differ: ``combine`` sums a token's rows **unweighted**
(fp32, ascending k, one cast) and echoes the weights back as ``combined_topk_weights`` (the docs say ``sum_k w * x``).
Rows of a local expert come by (source rank, token). Engram: each rank's table ``(num_entries, hidden)``; global index
``g`` reads row ``g % num_entries`` of rank ``g // num_entries``; here ``engram_write`` gathers every rank's table
(collective), ``engram_fetch`` then reads locally."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .. import elastic
from ..core import elastic as v2
from ..core import rules
from ..core.call import ExpandCombine
from ..errors import invalid, null, shape
from ..sizes import align

_MB, _MIB2 = 1 << 20, 2 << 20
ENGRAM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclasses.dataclass
class EPHandle:
    """One dispatch's layout (CANN's field order). A received rows, L local experts, W ranks, BS tokens, K top-k:
    ``dst_buffer_slot_idx`` `[BS, K]` `torch.int32` (token t's slot on the rank of ``topk_idx[t, k]``, -1 for an id
    < 0), ``recv_src_metadata`` `[A, 4]` `torch.int32` (``[src_rank, src_token, k, slot]`` per row, -1 past the
    received ones), ``num_recv_tokens_per_rank`` `[W]` `torch.int32` (distinct tokens per source rank),
    ``num_recv_tokens_per_expert`` `[L]` `torch.int64` (rows per local expert), ``num_experts``, ``expert_alignment``
    (1), ``num_max_tokens_per_rank``, ``topk_idx`` `[BS, K]` `torch.int32`."""

    dst_buffer_slot_idx: torch.Tensor
    recv_src_metadata: torch.Tensor
    num_recv_tokens_per_rank: torch.Tensor
    num_recv_tokens_per_expert: torch.Tensor
    num_experts: int
    expert_alignment: int
    num_max_tokens_per_rank: int
    topk_idx: torch.Tensor
    v2: Any = dataclasses.field(default=None, repr=False)  # the DeepEP V2 handle it is

    @property
    def num_recv_tokens(self) -> int:
        """The distinct tokens received (``num_recv_tokens_per_rank.sum()``)."""
        return int(self.num_recv_tokens_per_rank.sum())


class ElasticBuffer:
    """``ElasticBuffer(group, *, num_cpu_bytes=0, num_max_tokens_per_rank=None, hidden=None, num_topk=None)``:
    ``num_cpu_bytes`` the Engram storage bytes (a multiple of 2 MiB); the three MoE sizes all given (for
    :meth:`dispatch` / :meth:`combine`) or all None. Collective: every rank of ``group`` constructs one."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        *,
        num_cpu_bytes: int = 0,
        num_max_tokens_per_rank: int | None = None,
        hidden: int | None = None,
        num_topk: int | None = None,
    ) -> None:
        rules.count(num_cpu_bytes, "num_cpu_bytes", 0)
        if num_cpu_bytes % _MIB2:
            raise invalid("num_cpu_bytes", f"{num_cpu_bytes} is not a multiple of 2 MiB")
        sizes = (num_max_tokens_per_rank, hidden, num_topk)
        if any(v is None for v in sizes) and any(v is not None for v in sizes):
            raise null("num_max_tokens_per_rank", "give num_max_tokens_per_rank, hidden and num_topk together")
        n, h, k = (
            (0, 0, 0)
            if num_max_tokens_per_rank is None
            else (
                rules.count(v, nm, 1)
                for v, nm in zip(sizes, ("num_max_tokens_per_rank", "hidden", "num_topk"), strict=True)
            )
        )
        self.group, self.num_cpu_bytes, self.moe = group, num_cpu_bytes, n > 0
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.num_max_tokens_per_rank, self.hidden, self.num_topk = n, h, k
        self._v2: elastic.ElasticBuffer | None = elastic.ElasticBuffer(
            group,
            num_max_tokens_per_rank=n,
            hidden=h,
            num_topk=k,
            allow_multiple_reduction=False,
            explicitly_destroy=True,
            backend="reference",
        )
        self._tables: torch.Tensor | None = None
        self._pending = False

    def _live(self) -> elastic.ElasticBuffer:
        if self._v2 is None:
            raise RuntimeError("this ElasticBuffer cannot be used after destroy()")
        return self._v2

    @property
    def _backend(self) -> Any:
        return self._live()._backend

    @staticmethod
    def get_moe_ep_ccl_buffer_size(
        world_size: int, num_max_tokens_per_rank: int, hidden: int, num_experts: int, topk: int
    ) -> int:
        """MB of CCL buffer (``HCCL_BUFFSIZE``) dispatch / combine need (CANN master's formula):
        ``state + W * N * slot_d + N * K * slot_c`` bytes, halved to MB as HCCL allocates twice."""
        rules.in_range(num_experts, "num_experts", 2, 2048)
        rules.in_range(topk, "topk", 1, 32)
        w, n, k, num_local = world_size, num_max_tokens_per_rank, topk, num_experts // world_size
        state = w * align(4 * num_local, 512) + 2 * w * 512 + n * k * 512 + w * 512
        slot_d = align(align(2 * hidden, 32) + 2 * align(4 * k, 32) + 32, 512)
        slot_c = align(align(2 * hidden, 32) + 32, 512)
        return align(math.ceil((state + w * n * slot_d + n * k * slot_c) / _MB), 2) // 2

    def dispatch(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        *,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        handle: EPHandle | None = None,
        num_experts: int | None = None,
        num_max_tokens_per_rank: int | None = None,
        expert_alignment: int | None = None,
        do_cpu_sync: bool | None = None,
    ) -> tuple[Any, ...]:
        """Send each token to the ranks of its experts (collective). ``x`` `[BS, H]` (or ``(x_fp8, scales)``),
        ``topk_idx`` `[BS, K]` `torch.int32` ids in ``[0, num_experts)`` (None with a cached ``handle``),
        ``topk_weights`` `[BS, K]` `torch.float32` or None, ``expert_alignment`` 1; ``do_cpu_sync`` True (default,
        exact A) or False (A = W * N * min(K, L), rows past the real ones unspecified). A cached ``handle`` reuses its
        layout (``topk_idx`` / ``topk_weights`` None). Returns ``(recv_x `[A, H]` (or ``(recv_x, recv_scales)``),
        None, recv_topk_weights `[A]` `torch.float32` or None, handle)``: rows by local expert, then (source rank,
        token)."""
        if not self.moe:
            raise null("num_max_tokens_per_rank", "must be specified (with hidden, num_topk) to use MoE dispatch")
        with self._backend.rejecting("cann_elastic_dispatch", v2.NAMES):
            if handle is None:
                rules.tensor(topk_idx, "topk_idx", (torch.int32,), 2)
                rules.in_range(num_experts, "num_experts", 2, 2048)
            elif not isinstance(handle, EPHandle):
                raise invalid("handle", f"must be an EPHandle of this buffer's dispatch, got {type(handle).__name__}")
            elif topk_idx is not None or topk_weights is not None or do_cpu_sync:
                raise invalid("handle", "a cached dispatch takes no topk_idx, topk_weights or do_cpu_sync=True")
            rules.one_of(1 if expert_alignment is None else expert_alignment, "expert_alignment", (1,))
        recv_x, _, weights, h, _ = self._live().dispatch(
            x,
            topk_idx,
            topk_weights,
            num_experts=None if handle else num_experts,
            num_max_tokens_per_rank=None if handle else num_max_tokens_per_rank,
            handle=handle.v2 if handle else None,
            do_cpu_sync=do_cpu_sync,
            do_expand=True,
        )
        return recv_x, None, weights, handle or _handle(h)

    def combine(
        self, x: torch.Tensor, handle: EPHandle, *, topk_weights: torch.Tensor | None = None, bias: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return rows to their tokens (collective): ``x`` `[A, H]` row-aligned with ``recv_x``, ``topk_weights``
        `[A]` `torch.float32` (dispatch's ``recv_topk_weights``) or None; ``bias`` must be None. Returns
        ``combined_x`` `[BS, H]` in x's dtype (the rows of each token summed unweighted in fp32 over k ascending, one
        cast) and ``combined_topk_weights`` `[BS, K]` `torch.float32` (row (t, k)'s weight) or None."""
        bias = bias[0] if isinstance(bias, tuple) and len(bias) == 2 and bias[1] is None else bias
        with self._backend.rejecting("cann_elastic_combine", v2.NAMES):
            if bias is not None:
                raise invalid("bias", "is not supported: pass None")
            h = v2.owned_handle(handle.v2 if isinstance(handle, EPHandle) else handle, self._backend)
            experts = rules.plain_experts(self.world_size, self.rank, h.num_experts, "num_experts")
            call = ExpandCombine("cann_elastic_combine", x, h.topk_idx, experts, h, expert_scales=topk_weights)
            call = dataclasses.replace(v2.combine(call, True, None), multiple_reduction=False)
        inflight = self._backend.combine(call)
        out = inflight.value if isinstance(inflight.value, tuple) else (inflight.value, None)
        inflight.wait()
        return out

    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False) -> None:
        """A bounded barrier of the group (the arguments choose streams on the NPU; no-ops here)."""
        self._backend.ep.barrier("ElasticBuffer.barrier")

    def destroy(self) -> None:
        """Release the buffer (idempotent; collective: a barrier first). Later calls raise RuntimeError."""
        if self._v2 is not None:
            self._v2.destroy()
            self._v2, self._tables = None, None

    @staticmethod
    def get_engram_storage_size_hint(num_entries: int, hidden: int, dtype: torch.dtype = torch.bfloat16) -> int:
        """Bytes of Engram storage: ``align(num_entries * align(hidden * itemsize, 32), 2 MiB)``."""
        rules.count(num_entries, "num_entries", 0)
        if rules.count(hidden, "hidden", 1) % 128:
            raise shape("hidden", f"{hidden} is not a multiple of 128")
        rules.one_of(dtype, "dtype", ENGRAM_DTYPES)
        return align(num_entries * align(hidden * dtype.itemsize, 32), _MIB2)

    def engram_write(self, storage: torch.Tensor) -> None:
        """Publish this rank's table ``storage`` `[num_entries, hidden]` (CPU, contiguous, bf16 / fp16 / fp32,
        hidden a multiple of 128, at most ``num_cpu_bytes``); collective, may be called again (overwrites). Every
        rank must give the same shape and dtype."""
        with self._backend.rejecting("engram_write", {}):
            t = rules.tensor(storage, "storage", ENGRAM_DTYPES, 2)
            if t.device.type != "cpu" or not t.is_contiguous():
                raise invalid("storage", "must be a contiguous CPU tensor")
            if t.shape[1] < 1 or t.shape[1] % 128:
                raise shape("storage", f"hidden (dim 1) {t.shape[1]} must be a positive multiple of 128")
            if t.numel() * t.element_size() > self.num_cpu_bytes:
                raise shape(
                    "storage", f"{t.numel() * t.element_size()} bytes exceed num_cpu_bytes {self.num_cpu_bytes}"
                )
            if t.shape[0] * self.world_size > 2**31 - 1:
                raise shape("storage", "num_entries * world size exceeds INT32_MAX")
        shapes: list[Any] = [None] * self.world_size
        dist.all_gather_object(shapes, (tuple(t.shape), str(t.dtype)), group=self.group)
        if len(set(shapes)) > 1:
            raise shape("storage", f"shapes / dtypes differ across ranks: {shapes}")
        tables = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(tables, t, group=self.group)
        self._tables = torch.cat(tables)

    def engram_fetch(self, indices: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Start reading rows ``indices`` `[M]` `torch.int32` (global indices; out of range: zero rows); the returned
        callable returns ``fetched`` `[M, hidden]` in the storage dtype (bit-exact copies). One fetch at a time."""
        ids = rules.tensor(indices, "indices", (torch.int32,), 1)
        if self._tables is None:
            raise RuntimeError("engram_fetch needs a prior engram_write")
        if self._pending:
            raise RuntimeError("engram_fetch: the previous fetch's callable has not run yet")
        valid = (ids >= 0) & (ids < self._tables.shape[0])
        rows = self._tables[torch.where(valid, ids.long(), 0)]
        rows = torch.where(valid.unsqueeze(1), rows, torch.zeros((), dtype=rows.dtype))
        self._pending = True

        def wait() -> torch.Tensor:
            self._pending = False
            return rows

        return wait


def _handle(h: Any) -> EPHandle:
    """CANN's handle of DeepEP V2 handle ``h`` (expand layout)."""
    rows_from = torch.diff(h.psum_num_recv_tokens_per_scaleup_rank.long(), prepend=torch.zeros(1, dtype=torch.long))
    meta = torch.full((h.num_expanded_tokens, 4), -1, dtype=torch.int32)
    src_meta = h.recv_src_metadata.long()
    i, k = (src_meta[:, 2:] >= 0).nonzero(as_tuple=True)
    src = src_meta[i, 1]
    first = torch.cumsum(rows_from, 0) - rows_from
    meta[src_meta[i, 2 + k]] = torch.stack(
        [src, src_meta[i, 0] - src * h.num_max_tokens_per_rank, k, i - first[src]], dim=1
    ).to(torch.int32)
    return EPHandle(
        h.dst_buffer_slot_idx,
        meta,
        rows_from.to(torch.int32),
        h.num_unaligned_recv_tokens_per_expert.long(),
        h.num_experts,
        1,
        h.num_max_tokens_per_rank,
        h.topk_idx.int(),
        h,
    )
