"""The bf16 expert matmul of the grouped layout on the CPU (``expert_mm.c``): the MoE experts of a decode step read
their weights once, one sequential stream per thread, at close to the memory's read rate."""

from __future__ import annotations

import torch
from torch import Tensor

from . import library

ROWS_PER_EXPERT = 8
"""The most rows per expert (on average) for which :func:`expert_mm` beats torch's matmul: measured 2.6-3x at 1-4
rows, still ahead at 8, behind from ~32 on (it reads the weights once but multiplies without blocking)."""

MATMUL_ROWS = 8
"""An expert with more rows than this (in one call) is compute-bound: torch's blocked bf16 matmul (oneDNN, AMX where
the CPU has it) beats the kernel's one pass over its weights (``max_rows``)."""

_threads: int | None = None


def set_num_threads(threads: int | None) -> None:
    """The threads :func:`expert_mm` may use when its caller names none (None: ``torch.get_num_threads()``). A
    process that runs torch's small ops on one thread can still read its weights on several: 2 threads read 23
    GB/s here against 18 for one."""
    global _threads
    _threads = threads


def expert_mm(
    x: Tensor, w: Tensor, offsets: Tensor, threads: int | None = None, max_rows: int | None = None
) -> Tensor | None:
    """``y[r] = x[r] @ w[e].T`` for the rows ``r`` of each expert ``e`` in the grouped layout, each sum in fp32
    (products exact, sums in an order of the kernel's) rounded once to bf16; None where the kernel does not apply
    (not bf16 CPU tensors, kernels off or not built, a CPU without AVX512-BF16), having done nothing.

    Arguments:
        x: `[rows, K]` `torch.bfloat16`, contiguous; expert ``e``'s rows are ``offsets[e - 1]:offsets[e]``.
        w: `[E, N, K]` `torch.bfloat16`, contiguous.
        offsets: `[E]` `torch.int32`, the cumulative row ends (non-decreasing, at most ``rows``).
        threads: at most this many threads share the weight rows, each taking at least 4 MiB of them (a wake-up and
            an uneven split cost about as much as reading 2 MiB); default :func:`set_num_threads`'s. The kernel keeps
            its helper threads between calls (one call at a time uses them; a concurrent call runs on its own).
        max_rows: experts with more rows are skipped, their output rows left undefined (the caller multiplies them:
            :data:`MATMUL_ROWS`); None: none is skipped.

    Returns:
        `[rows, N]` `torch.bfloat16`; rows past ``offsets[-1]`` are undefined.
    """
    bf16 = x.dtype == w.dtype == torch.bfloat16 and offsets.dtype == torch.int32
    if not bf16 or x.dim() != 2 or w.dim() != 3 or w.shape[2] != x.shape[1] or offsets.shape != (w.shape[0],):
        return None
    if not all(t.is_cpu and t.is_contiguous() for t in (x, w, offsets)) or (lib := library()) is None:
        return None
    y = torch.empty(x.shape[0], w.shape[1], dtype=torch.bfloat16)
    n = threads or _threads or torch.get_num_threads()
    limit = x.shape[0] if max_rows is None else max_rows
    return y if lib.expert_mm(x, x.shape[0], w, w.shape[0], w.shape[1], w.shape[2], y, offsets, n, limit) else None
