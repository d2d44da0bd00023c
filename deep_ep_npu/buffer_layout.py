"""DeepEP's normal-mode layout and configuration methods of :class:`deep_ep_npu.Buffer` (``get_dispatch_layout``,
``get_dispatch_config`` / ``get_combine_config``, ``set_num_sms``) and where the group's ranks live (:func:`host_nodes`:
one host is DeepEP's intranode form, several its internode form). Local: no communication after construction."""

from __future__ import annotations

import torch

from .backends import Backend
from .core import normal, rules
from .errors import invalid
from .handle import EventOverlap
from .normal_config import COMBINE_CONFIGS, DISPATCH_CONFIGS, Config, recommended
from .transports.hosts import host_groups, host_key

__all__ = ["LayoutMethods", "host_nodes"]


def host_nodes(backend: Backend) -> list[list[int]]:
    """Each host's ranks (a collective step: every rank's :func:`host_key`), hosts in order of their first rank."""
    return host_groups(
        [
            words[0]
            for words in backend.ep.start_agree("Buffer hosts", 0, [[]] * backend.num_ranks, [host_key()])().shared
        ]
    )


class LayoutMethods:
    """The layout and config methods (see the module docstring); a base of the normal-mode methods."""

    _backend: Backend
    group_size: int
    nodes: list[list[int]]  # each host's ranks (Buffer.__init__: host_nodes)
    num_sms: int = 20  # DeepEP's default (set_num_sms changes it)

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """DeepEP's SM count for the normal-mode configs (even); it sets the channel count of new handles."""
        if isinstance(new_num_sms, bool) or not isinstance(new_num_sms, int) or new_num_sms < 2 or new_num_sms % 2:
            raise ValueError(f"new_num_sms: must be an even int >= 2, got {new_num_sms!r}")
        LayoutMethods.num_sms = new_num_sms

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """DeepEP's recommended dispatch :class:`Config` for ``num_ranks`` (2 ... 160 ranks, its table)."""
        return recommended(DISPATCH_CONFIGS, LayoutMethods.num_sms, num_ranks)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """DeepEP's recommended combine :class:`Config` for ``num_ranks``."""
        return recommended(COMBINE_CONFIGS, LayoutMethods.num_sms, num_ranks)

    def _internode(self) -> bool:
        if len(self.nodes) > 1 and (
            len({len(n) for n in self.nodes}) > 1 or sum(self.nodes, []) != list(range(self.group_size))
        ):
            why = f"internode normal mode needs the same number of ranks on every host, in rank order; got {self.nodes}"
            raise invalid("group", why)
        return len(self.nodes) > 1

    def get_dispatch_layout(
        self,
        topk_idx: torch.Tensor,
        num_experts: int,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, EventOverlap]:
        """DeepEP's layout of a top-k, computed locally. ``topk_idx``: `[T, K]` `torch.int64` / `torch.int32`, ids in
        ``[0, num_experts)`` or -1. Returns ``num_tokens_per_rank`` `[R]` `torch.int32` (tokens with an expert on each
        rank), ``num_tokens_per_rdma_rank`` `[num_hosts]` `torch.int32` (tokens with an expert on each host; None
        when the group is on one host), ``num_tokens_per_expert`` `[num_experts]` `torch.int32`,
        ``is_token_in_rank`` `[T, R]` `torch.bool` and a complete :class:`EventOverlap`, on ``topk_idx``'s device."""
        self._backend.check_alive(self)
        normal.flags(previous_event, async_finish, allocate_on_comm_stream, None, Config)
        r = self.group_size
        rules.plain_experts(r, 0, num_experts, "num_experts")
        idx = rules.tensor(topk_idx, "topk_idx", (torch.int32, torch.int64), 2)
        idx = rules.expert_ids(idx, "topk_idx", num_experts, idx.shape[0], 32, no_expert=True).long()
        per_expert = torch.bincount(idx[idx >= 0], minlength=num_experts).to(torch.int32)
        in_rank = normal.ranks_of(idx, num_experts, r)
        per_node = None
        if self._internode():
            per_node = torch.stack([in_rank[:, n].any(dim=1) for n in self.nodes], dim=1).sum(dim=0).to(torch.int32)
        return in_rank.sum(dim=0).to(torch.int32), per_node, per_expert, in_rank, EventOverlap(None)
