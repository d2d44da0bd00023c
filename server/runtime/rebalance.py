"""EPLB while serving (``--eplb``): every worker adds the rows its expert slots received each step (the dispatch's
receive counts: :meth:`~server.models.ep_comm.ExpertComm.take_load`) to a sliding window of ``eplb_window`` steps;
every ``eplb_interval`` steps all workers, at the same step boundary, gather the window (one all-gather), compute
the same new placement (:func:`deep_ep_npu.eplb.rebalance_experts`, global policy), move the expert weights that
change place point-to-point (:func:`move_expert_weights`) and switch the map. Workers run every step in lockstep, so
every rank switches at the same step. Replicas are identical copies, so tokens do not change (slot-ordered combine).
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any

import torch
import torch.distributed as dist

from deep_ep_npu.eplb import ExpertMap, rebalance_experts

logger = logging.getLogger("server.eplb")


def _transfers(old: list[int], new: list[int], num_ranks: int) -> list[tuple[int, int, int]]:
    """``(expert, src rank, dst rank)`` for each expert a rank needs under ``new`` and does not hold under ``old``
    (one per rank and expert); the holders serve the receivers round-robin. Every rank computes the same list."""
    per = len(old) // num_ranks
    held = [set(old[r * per : (r + 1) * per]) for r in range(num_ranks)]
    out = []
    for e in sorted({x for x in new if x >= 0}):
        holders = [r for r in range(num_ranks) if e in held[r]]
        receivers = [r for r in range(num_ranks) if e in new[r * per : (r + 1) * per] and e not in held[r]]
        out += [(e, holders[i % len(holders)], r) for i, r in enumerate(receivers)]
    return out


def move_expert_weights(tensors: list[torch.Tensor], old: list[int], new: list[int], rank: int, num_ranks: int,
                        group: Any) -> int:  # fmt: skip
    """Rearrange this rank's slots of one MoE layer from placement ``old`` to ``new`` (phy2log rows, P entries):
    ``tensors`` are its expert parameters, each `[num_local_experts, ...]`, rewritten in place. Experts already here
    are copied locally; the others arrive point-to-point from a rank that holds them (``batch_isend_irecv`` over
    ``group``). Returns the number of expert copies received."""
    per = len(old) // num_ranks
    mine_old, mine_new = old[rank * per : (rank + 1) * per], new[rank * per : (rank + 1) * per]
    if mine_old == mine_new and old == new:
        return 0
    ops, received = [], {}
    for e, src, dst in _transfers(old, new, num_ranks):
        if src == rank:
            slot = mine_old.index(e)
            ops += [dist.P2POp(dist.isend, t[slot].contiguous(), dist.get_global_rank(group, dst), group, tag=e)
                    for t in tensors]  # fmt: skip
        if dst == rank:
            received[e] = [torch.empty_like(t[0]) for t in tensors]
            ops += [dist.P2POp(dist.irecv, buf, dist.get_global_rank(group, src), group, tag=e) for buf in received[e]]
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    for i, t in enumerate(tensors):
        before = t.detach().clone()
        for slot, e in enumerate(mine_new):
            if e == mine_old[slot] or e < 0:
                continue
            t.data[slot].copy_(received[e][i] if e in received else before[mine_old.index(e)])
    return len(received)


class Rebalancer:
    """One worker's EPLB state: the load window, the step counter and the rebalance (see the module doc)."""

    def __init__(self, comm: Any, moe_layers: list[Any], interval: int, window: int) -> None:
        self.comm, self.moe_layers, self.interval = comm, moe_layers, interval
        self.window: collections.deque[torch.Tensor] = collections.deque(maxlen=window)
        self.steps = 0
        self.num_rebalances = 0

    def after_step(self, load: torch.Tensor | None) -> None:
        """Record this step's per-slot load `[moe layers, num_local_experts]` int64 (None: no MoE layer ran) and
        rebalance on every ``interval``-th step. Stops (logged) once a rank is lost: the survivors keep their map."""
        if load is not None:
            self.window.append(load)
        self.steps += 1
        if self.steps % self.interval or self.comm.lost_ranks:
            return
        t0 = time.perf_counter()
        comm, emap = self.comm, self.comm.expert_map
        shape = (emap.num_layers, comm.num_local_experts)
        local = torch.stack(list(self.window)).sum(0) if self.window else torch.zeros(shape, dtype=torch.int64)
        local = local.to(next(self.moe_layers[0].experts.parameters()).device)  # (NCCL / HCCL: on the device)
        gathered = [torch.empty_like(local) for _ in range(comm.num_ranks)]
        dist.all_gather(gathered, local, group=comm.group)
        physical = torch.cat(gathered, dim=1).cpu()  # [layers, P]: rank r's slots at [r * L, (r + 1) * L)
        weight = emap.load_per_logical(physical)
        phy2log, _, _ = rebalance_experts(weight, emap.num_physical, 1, 1, comm.num_ranks)
        moved = 0
        for layer, moe in enumerate(self.moe_layers):
            tensors = list(moe.experts.parameters())
            moved += move_expert_weights(tensors, emap.phy2log[layer].tolist(), phy2log[layer].tolist(), comm.rank,
                                         comm.num_ranks, comm.group)  # fmt: skip
        comm.set_expert_map(ExpertMap(phy2log, emap.num_logical, emap.num_ranks, emap.balance_mode))
        self.window.clear()  # its counts were per slot of the old placement
        self.num_rebalances += 1
        logger.info("EPLB: rank %d rebalanced %d MoE layers at step %d (%d experts received) in %.3f s", comm.rank,
                    len(self.moe_layers), self.steps, moved, time.perf_counter() - t0)  # fmt: skip
