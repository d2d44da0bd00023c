"""Buffer sizes: the CCL (HCCL window) size by ops-transformer's ``get_low_latency_ccl_buffer_size`` formula, and
DeepEP's low-latency RDMA size hint."""

from __future__ import annotations

import math

from .errors import invalid, shape

_MB = 1 << 20
COMM_ALGS = ("", "fullmesh_v1", "fullmesh_v2")  # the formula's; the ops take core.ascend.OP_COMM_ALGS


def align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def ccl_buffer_bytes(
    world_size: int,
    num_max_dispatch_tokens_per_rank: int,
    hidden: int,
    num_local_experts: int,
    topk: int,
    num_shared_expert: int = 0,
    comm_alg: str = "",
) -> int:
    """Minimum bytes of the two CCL windows (dispatch + combine, x2) for these shapes, no range checks:
    ``2 * (bs * disp_tok * W * L + bs * comb_tok * (topk + S)) + 1 MiB`` with ``disp_tok = align512(align32(2H) + 44)``
    (``ceil(.../480)*512`` for fullmesh_v2), ``comb_tok = align512(2H)``."""
    tok_len = align(hidden * 2, 32) + 44  # bf16 row + 32 B scale + the int32 (rank, token, slot) triple
    disp_tok = math.ceil(tok_len / 480) * 512 if comm_alg == "fullmesh_v2" else align(tok_len, 512)
    bs, comb_tok = num_max_dispatch_tokens_per_rank, align(hidden * 2, 512)
    return 2 * (bs * disp_tok * world_size * num_local_experts + bs * comb_tok * (topk + num_shared_expert)) + _MB


def ccl_buffer_mb(num_bytes: int) -> int:
    """MB value to give HCCL (CANN 9.1+, which allocates twice the size it is given): ``align2(ceil(B/1MiB)) / 2``."""
    return align(math.ceil(num_bytes / _MB), 2) // 2


def get_low_latency_ccl_buffer_size(
    world_size: int,
    num_max_dispatch_tokens_per_rank: int,
    hidden: int,
    num_moe_expert: int,
    topk: int,
    num_shared_expert: int = 0,
    num_shared_expert_ranks: int = 0,
    comm_alg: str = "",
) -> int:
    """The CCL buffer size, in MB, that low-latency dispatch + combine need (``HCCL_BUFFSIZE`` / ``hccl_buffer_size``):
    ops-transformer's static ``MoeDistributeBuffer.get_low_latency_ccl_buffer_size`` (CANN 9.1+, the halved value),
    e.g. 479 for ``(W, 128, 7168, 256, 8)``. Raises :class:`~deep_ep_npu.errors.MoeDistributeError` as it does:
    code 561002 for an argument out of its range (``world_size`` [2, 768], ``hidden`` [1024, 8192], tokens [1, 512],
    experts [1, 1024], ``topk`` [1, 16], shared experts [0, 4]; ``L * W <= 2048`` with ``L = num_moe_expert //
    (world_size - num_shared_expert_ranks)``), 161002 for ``comm_alg`` not in {"", fullmesh_v1, fullmesh_v2}."""
    tokens, shared_ranks = num_max_dispatch_tokens_per_rank, num_shared_expert_ranks
    for name, value, lo, hi in (
        ("world_size", world_size, 2, 768),
        ("num_max_dispatch_tokens_per_rank", tokens, 1, 512),
        ("hidden", hidden, 1024, 8192),
        ("num_moe_expert", num_moe_expert, 1, 1024),
        ("topk", topk, 1, 16),
        ("num_shared_expert", num_shared_expert, 0, 4),
        ("num_shared_expert_ranks", shared_ranks, 0, world_size - 1),
    ):
        if not lo <= value <= hi:
            raise shape(name, f"got {value}, allowed [{lo}, {hi}]")
    if comm_alg not in COMM_ALGS:
        raise invalid("comm_alg", f"got {comm_alg!r}, allowed {COMM_ALGS}")
    num_local = num_moe_expert // (world_size - shared_ranks)
    if num_local * world_size > 2048:
        raise shape("num_moe_expert", f"local experts x world size = {num_local * world_size} exceeds 2048")
    return ccl_buffer_mb(ccl_buffer_bytes(world_size, tokens, hidden, num_local, topk, num_shared_expert, comm_alg))


def rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> int:
    """DeepEP's ``LowLatencyLayout``: two copies of (send, recv, signal) buffers, plus its alignment step
    ``(total + 128) // 128 * 128`` (which adds 128 bytes to an already aligned total, as DeepEP does)."""
    n, scales = num_max_dispatch_tokens_per_rank, hidden // 128
    dispatch_msg, combine_msg = 16 + max(hidden * 2, hidden + scales * 4), scales * 4 + hidden * 2
    send = max(n * dispatch_msg, num_experts * n * combine_msg)
    recv = max(num_experts * n * dispatch_msg, num_experts * n * combine_msg)
    signal = (num_experts * 4 + 127) // 128 * 128
    return (2 * (send + recv + signal) + 128) // 128 * 128
