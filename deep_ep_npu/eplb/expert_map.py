""":class:`ExpertMap`: one placement of every MoE layer (phy2log `[layers, P]` over R ranks) and the logical ->
physical mapping of top-k ids before a dispatch (:func:`.routing.to_physical`, torch_npu's ``npu_moe_update_expert``
semantics). The exchange (``Buffer``, the ops, ``ElasticBuffer``) then runs on physical ids with ``num_experts = P``:
slot ``p`` is local expert ``p % L`` of rank ``p // L`` (L = P / R)."""

from __future__ import annotations

import torch

from ..errors import invalid
from .placement import check_placement, drop_ranks, maps
from .routing import BALANCE_BY_TOKEN, eplb_table, to_physical


class ExpertMap:
    """``phy2log`` `[layers, P]` int64 (-1: an empty slot, only after :meth:`without_ranks`), E logical experts,
    ``num_ranks`` ranks, ``balance_mode`` as torch_npu's (0: by rank, 1: by token). Raises
    :class:`~deep_ep_npu.MoeDistributeError` for a placement that misses an expert or does not split over the ranks."""

    def __init__(
        self,
        phy2log: torch.Tensor,
        num_logical: int,
        num_ranks: int,
        balance_mode: int = BALANCE_BY_TOKEN,
        *,
        allow_missing: bool = False,
    ) -> None:
        phy2log = phy2log.detach().to("cpu", torch.int64)
        if phy2log.dim() == 1:
            phy2log = phy2log.unsqueeze(0)
        if not allow_missing:
            check_placement(phy2log, num_logical, num_ranks)
        elif phy2log.dim() != 2 or phy2log.shape[1] % num_ranks:
            raise invalid("phy2log", f"shape {tuple(phy2log.shape)}: must be [layers, P], P a multiple of {num_ranks}")
        if balance_mode not in (0, 1):
            raise invalid("balance_mode", f"got {balance_mode}; allowed: 0 (by rank) or 1 (by token)")
        self.phy2log, self.num_logical, self.num_ranks, self.balance_mode = (
            phy2log,
            num_logical,
            num_ranks,
            balance_mode,
        )
        self.log2phy, self.logcnt = maps(phy2log, num_logical)
        # torch_npu's tables; an expert without a replica points at slot 0 and is masked to -1 in to_physical
        slot0 = torch.full((1, self.log2phy.shape[2]), -1, dtype=torch.int64)
        slot0[0, 0] = 0
        self.tables = [
            eplb_table(torch.where(cnt.unsqueeze(1) > 0, l2p, slot0))
            for l2p, cnt in zip(self.log2phy, self.logcnt, strict=True)
        ]
        self._device_tables: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def num_layers(self) -> int:
        return self.phy2log.shape[0]

    @property
    def num_physical(self) -> int:
        """P, the ``num_experts`` of the exchange."""
        return self.phy2log.shape[1]

    @property
    def num_local(self) -> int:
        """L = P / R physical slots per rank."""
        return self.num_physical // self.num_ranks

    def local_experts(self, layer: int, rank: int) -> list[int]:
        """The logical expert of each of ``rank``'s L slots in ``layer`` (-1: empty)."""
        return self.phy2log[layer, rank * self.num_local : (rank + 1) * self.num_local].tolist()

    def to_physical(self, layer: int, topk_idx: torch.Tensor, rank: int) -> torch.Tensor:
        """``topk_idx`` `[T, K]` int64 logical ids (-1: none) -> `[T, K]` int64 physical ids on its device, each
        (token, k) to one replica by ``balance_mode`` (rank: this ``rank``'s block); -1 stays -1, and so does an
        expert with no replica left. The (token, k) slot and so its weight stay: combine is unchanged."""
        key = (layer, topk_idx.device)
        if key not in self._device_tables:
            self._device_tables[key] = (self.tables[layer].to(topk_idx.device), self.logcnt[layer].to(topk_idx.device))
        table, count = self._device_tables[key]
        valid = topk_idx >= 0
        ids = topk_idx.clamp(min=0)
        phys = to_physical(ids, table, balance_mode=self.balance_mode, local_rank_id=rank, world_size=self.num_ranks)
        return torch.where(valid & (count[ids] > 0), phys, -1)

    def load_per_logical(self, physical_load: torch.Tensor) -> torch.Tensor:
        """Per-slot counts `[layers, P]` summed per logical expert: `[layers, E]` int64."""
        out = torch.zeros(self.num_layers, self.num_logical, dtype=torch.int64)
        return out.scatter_add_(1, self.phy2log.clamp(min=0), physical_load.long() * (self.phy2log >= 0))

    def without_ranks(self, dead: set[int]) -> tuple[ExpertMap, list[list[int]]]:
        """This map with the slots of the ``dead`` ranks emptied, and per layer the logical experts left with no
        replica (their tokens' slots then map to -1: dropped)."""
        phy2log, lost = drop_ranks(self.phy2log, dead, self.num_ranks)
        return ExpertMap(phy2log, self.num_logical, self.num_ranks, self.balance_mode, allow_missing=True), lost
