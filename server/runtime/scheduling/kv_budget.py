"""How many KV-cache blocks a worker gets, from a memory budget, and the start-up check that one request fits.

Per worker, after its weights are loaded:

- ``kv_cache_memory`` set: that many bytes of KV cache.
- else, on an accelerator (``cuda``, ``npu``): ``gpu_memory_utilization`` x the device's total memory, less what
  is in use after loading (weights, other processes) and the activation peak of a forward of ``N`` tokens.
- else, on the CPU (the workers share the host's memory): ``gpu_memory_utilization`` x the memory available now,
  split over the local workers, and no more than ``max_num_seqs`` full-length requests need (host memory is shared
  with everything else; set ``kv_cache_memory`` for a bigger prefix cache).

The pool is ``budget // bytes_per_block`` blocks of ``block_size`` tokens (:func:`~server.models.kv_cache.
bytes_per_block`). Start-up fails (:func:`check_fits`) when it cannot hold one request of ``max_model_len`` tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:.1f} MiB"


def host_memory_available() -> int:
    """Bytes of host memory available to new allocations (Linux ``MemAvailable``)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemAvailable line")


def kv_budget_bytes(
    device: torch.device,
    kv_cache_memory: int | None,
    utilization: float,
    local_workers: int,
    cpu_cap_bytes: int,
    activation_peak: Callable[[], int],
) -> tuple[int, str]:
    """This worker's KV-cache budget in bytes, and how it was chosen (for messages). ``activation_peak()``
    measures the peak of one forward (accelerators only)."""
    if kv_cache_memory is not None:
        return kv_cache_memory, f"kv-cache-memory {mib(kv_cache_memory)}"
    if device.type == "cpu":
        share = int(utilization * host_memory_available() / local_workers)
        why = f"gpu-memory-utilization {utilization:g} of the host memory available, split over {local_workers} "
        return min(share, cpu_cap_bytes), why + "workers, capped at max-num-seqs full-length requests"
    free, total = torch.accelerator.get_memory_info(device)
    budget = int(utilization * total) - (total - free) - activation_peak()
    why = f"gpu-memory-utilization {utilization:g} of {mib(total)}, less {mib(total - free)} in use and the "
    return max(budget, 0), why + "activation peak"


def check_fits(num_blocks: int, block_size: int, bytes_per_block: int, max_model_len: int, source: str) -> None:
    """Refuse a pool that cannot hold one request of ``max_model_len`` tokens, saying what fits and what was asked."""
    need = -(-max_model_len // block_size)
    if num_blocks >= need:
        return
    per_token = bytes_per_block / block_size
    raise ValueError(
        f"KV cache too small: {source} holds {num_blocks} blocks of {block_size} tokens ({num_blocks * block_size} "
        f"tokens at {per_token:g} bytes per token); one request of max-model-len {max_model_len} needs {need} blocks "
        f"({mib(need * bytes_per_block)}). Raise kv-cache-memory (or gpu-memory-utilization), or lower max-model-len"
    )
