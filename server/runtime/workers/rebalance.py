"""EPLB while serving (``--eplb``): every worker adds the rows its expert slots received each step (the dispatch's
receive counts: :meth:`~server.models.ep_comm.ExpertComm.take_load`) to a sliding window of ``eplb_window`` steps;
every ``eplb_interval`` steps all workers, at the same step boundary, gather the window (one all-gather), compute
the same new placement (:func:`deep_ep_npu.eplb.rebalance_experts`, global policy) and move the expert weights that
change place point-to-point (:func:`move_expert_weights`) into staging; the next step's plan commits them (weights,
then map) on every rank at that step boundary, while a regroup (a rank failed, maybe during the move) drops them, so
no rank ever runs a map whose weights did not all arrive, nor a map its peers do not run. Replicas are identical
copies, so tokens do not change (slot-ordered combine).
"""

from __future__ import annotations

import collections
import datetime
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


def move_expert_weights(
    tensors: list[torch.Tensor], old: list[int], new: list[int], rank: int, num_ranks: int, group: Any, timeout_s: float
) -> dict[int, list[torch.Tensor]]:
    """What this rank's slots of one MoE layer hold under placement ``new`` where it differs from ``old`` (phy2log
    rows, P entries): slot -> a copy of each of ``tensors`` (its expert parameters, each `[num_local_experts, ...]`,
    left unchanged). Experts already here are copied locally; the others arrive point-to-point from a rank that
    holds them (``batch_isend_irecv`` over ``group``, each wait at most ``timeout_s``: a peer lost meanwhile raises)."""
    per = len(old) // num_ranks
    mine_old, mine_new = old[rank * per : (rank + 1) * per], new[rank * per : (rank + 1) * per]
    ops, received = [], {}
    for e, src, dst in _transfers(old, new, num_ranks):
        if src == rank:
            slot = mine_old.index(e)
            ops += [
                dist.P2POp(dist.isend, t[slot].contiguous(), dist.get_global_rank(group, dst), group, tag=e)
                for t in tensors
            ]
        if dst == rank:
            received[e] = [torch.empty_like(t[0]) for t in tensors]
            ops += [dist.P2POp(dist.irecv, buf, dist.get_global_rank(group, src), group, tag=e) for buf in received[e]]
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    staged = {}
    for slot, e in enumerate(mine_new):
        if e != mine_old[slot] and e >= 0:
            staged[slot] = received[e] if e in received else [t[mine_old.index(e)].detach().clone() for t in tensors]
    return staged


class Rebalancer:
    """One worker's EPLB state: the load window, the step counter and the rebalance (see the module doc)."""

    def __init__(self, comm: Any, moe_layers: list[Any], interval: int, window: int) -> None:
        self.comm, self.moe_layers, self.interval = comm, moe_layers, interval
        self.window: collections.deque[torch.Tensor] = collections.deque(maxlen=window)
        self.steps = 0
        self.num_rebalances = 0
        self._staged: tuple[ExpertMap, list[dict[int, list[torch.Tensor]]]] | None = None

    def after_step(self, load: torch.Tensor | None, rebalance: bool = True) -> str:
        """Record this step's per-slot load `[moe layers, num_local_experts]` int64 (None: no MoE layer ran) and,
        on every ``interval``-th step (with ``rebalance``), stage a rebalance: the new placement and the weights it
        moves, applied by :meth:`commit`. Stops (logged) once a rank is lost: the survivors keep their map. Returns
        "" or, when the exchange failed (a peer lost meanwhile), why: nothing is staged and the group must regroup."""
        if load is not None:
            self.window.append(load)
        self.steps += 1
        if self.steps % self.interval or self.comm.lost_ranks or not rebalance:
            return ""
        try:
            self._staged = self._stage()
        except RuntimeError as e:  # (EPRankFailure and the process group's own errors)
            logger.warning("EPLB: rank %d could not rebalance at step %d: %s", self.comm.rank, self.steps, e)
            return f"worker {self.comm.rank}: EPLB exchange failed: {e}"
        return ""

    def _stage(self) -> tuple[ExpertMap, list[dict[int, list[torch.Tensor]]]]:
        comm, emap, timeout_s = self.comm, self.comm.expert_map, self.comm.timeout
        shape = (emap.num_layers, comm.num_local_experts)
        local = torch.stack(list(self.window)).sum(0) if self.window else torch.zeros(shape, dtype=torch.int64)
        local = local.to(next(self.moe_layers[0].experts.parameters()).device)  # (NCCL / HCCL: on the device)
        gathered = [torch.empty_like(local) for _ in range(comm.num_ranks)]
        dist.all_gather(gathered, local, group=comm.group, async_op=True).wait(datetime.timedelta(seconds=timeout_s))
        physical = torch.cat(gathered, dim=1).cpu()  # [layers, P]: rank r's slots at [r * L, (r + 1) * L)
        weight = emap.load_per_logical(physical)
        phy2log, _, _ = rebalance_experts(weight, emap.num_physical, 1, 1, comm.num_ranks)
        staged = []
        for layer, moe in enumerate(self.moe_layers):
            tensors = list(moe.experts.parameters())
            staged.append(
                move_expert_weights(
                    tensors,
                    emap.phy2log[layer].tolist(),
                    phy2log[layer].tolist(),
                    comm.rank,
                    comm.num_ranks,
                    comm.group,
                    timeout_s,
                )
            )
        return ExpertMap(phy2log, emap.num_logical, emap.num_ranks, emap.balance_mode), staged

    def commit(self) -> None:
        """Apply the staged rebalance (the driver's next step confirms that every rank staged it): the weights into
        their slots, then the map. Every rank commits at the same step boundary."""
        if self._staged is None:
            return
        t0, (emap, staged), self._staged = time.perf_counter(), self._staged, None
        for moe, slots in zip(self.moe_layers, staged, strict=True):
            for i, t in enumerate(moe.experts.parameters()):
                for slot, copies in slots.items():
                    t.data[slot].copy_(copies[i])
        self.comm.set_expert_map(emap)
        self.window.clear()  # its counts were per slot of the old placement
        self.num_rebalances += 1
        moved = sum(len(slots) for slots in staged)
        logger.info(
            "EPLB: rank %d rebalanced %d MoE layers at step %d (%d slots changed) in %.3f s",
            self.comm.rank,
            len(self.moe_layers),
            self.steps,
            moved,
            time.perf_counter() - t0,
        )

    def discard(self) -> None:
        """Drop a staged rebalance (the driver regroups instead: some rank may not have staged it)."""
        self._staged = None
