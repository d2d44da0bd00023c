"""DeepEP's normal-mode rules (``Buffer.dispatch`` / ``combine``): the layout tensors ``get_dispatch_layout`` gives, the
top-k, events and flags, checked on this rank (:func:`layout`), then across ranks (:func:`counts`: what DeepEP's
notify step exchanges, and the sizes every rank must agree on). Errors name DeepEP's parameters."""

from __future__ import annotations

import dataclasses

import torch

from ..errors import MoeDistributeError, invalid, null, shape
from . import rules

ID_DTYPES = (torch.int32, torch.int64)  # DeepEP's torch.int counts (int64 accepted)


@dataclasses.dataclass
class Routing:
    """One rank's checked routing: ``is_token_in_rank`` `[T, R]` bool, ``per_rank`` `[R]`, ``per_expert`` `[E]`
    (int64), ``ids`` `[T, K]` int64: the top-k, or without one each token's destination ranks as ``rank * L`` (-1
    padding; K the most ranks a token goes to, at least 1)."""

    is_token_in_rank: torch.Tensor
    per_rank: torch.Tensor
    per_expert: torch.Tensor
    ids: torch.Tensor
    with_topk: bool

    @property
    def num_experts(self) -> int:
        return int(self.per_expert.numel())


def flags(
    previous_event: object, async_finish: object, allocate_on_comm_stream: object, config: object, config_type: type
) -> None:
    """DeepEP's stream arguments (no streams here: checked, then no-ops) and ``config`` (None or a ``Config``)."""
    from ..handle import EventOverlap

    if previous_event is not None and not isinstance(previous_event, EventOverlap):
        raise invalid(
            "previous_event", f"must be None or an EventOverlap (Buffer.capture()), got {type(previous_event)}"
        )
    finish, on_comm = (
        rules.flag(async_finish, "async_finish"),
        rules.flag(allocate_on_comm_stream, "allocate_on_comm_stream"),
    )
    if on_comm and (previous_event is None or not finish):
        raise invalid("allocate_on_comm_stream", "needs previous_event and async_finish=True (as DeepEP requires)")
    if config is not None and not isinstance(config, config_type):
        raise invalid("config", f"must be None or a deep_ep Config, got {type(config).__name__}")


def ranks_of(topk_idx: torch.Tensor, num_experts: int, num_ranks: int) -> torch.Tensor:
    """`[T, R]` bool: whether token t has an expert on rank r (``topk_idx`` validated, -1 none)."""
    in_rank = torch.zeros((topk_idx.shape[0], num_ranks + 1), dtype=torch.bool, device=topk_idx.device)
    valid = topk_idx >= 0
    in_rank.scatter_(1, torch.where(valid, topk_idx // (num_experts // num_ranks), num_ranks).long(), True)
    return in_rank[:, :num_ranks].contiguous()


def layout(
    num_tokens: int,
    num_ranks: int,
    nodes: list[list[int]],
    num_tokens_per_rank: object,
    num_tokens_per_rdma_rank: object,
    is_token_in_rank: object,
    num_tokens_per_expert: object,
    topk_idx: object,
    topk_weights: object,
) -> Routing:
    """A fresh dispatch's routing, checked: the counts must be the ones ``get_dispatch_layout`` gives for the same
    ``topk_idx`` (with it) or for ``is_token_in_rank`` (without); ``nodes``: the ranks of each host (internode when
    more than one: ``num_tokens_per_rdma_rank`` `[num_nodes]` is then required)."""
    in_rank = rules.tensor(is_token_in_rank, "is_token_in_rank", (torch.bool,), 2)
    rules.dims(in_rank, "is_token_in_rank", (num_tokens, num_ranks), "[num_tokens, num_ranks]")
    per_rank = rules.tensor(num_tokens_per_rank, "num_tokens_per_rank", ID_DTYPES, 1)
    rules.dims(per_rank, "num_tokens_per_rank", (num_ranks,), "[num_ranks]")
    if not torch.equal(per_rank.long(), in_rank.sum(dim=0)):
        got, want = per_rank.tolist(), in_rank.sum(dim=0).tolist()
        raise shape("num_tokens_per_rank", f"is {got} but is_token_in_rank sends {want} tokens to the ranks")
    if len(nodes) > 1:
        per_node = rules.tensor(num_tokens_per_rdma_rank, "num_tokens_per_rdma_rank", ID_DTYPES, 1)
        to_node = torch.stack([in_rank[:, ranks].any(dim=1) for ranks in nodes], dim=1).sum(dim=0)
        if tuple(per_node.shape) != (len(nodes),) or not torch.equal(per_node.long(), to_node):
            why = (
                f"is {per_node.tolist()} but is_token_in_rank sends {to_node.tolist()} tokens to the {len(nodes)} hosts"
            )
            raise shape("num_tokens_per_rdma_rank", why)
    per_expert = rules.tensor(num_tokens_per_expert, "num_tokens_per_expert", ID_DTYPES, 1)
    e = per_expert.numel()
    if e < num_ranks or e % num_ranks:
        raise shape("num_tokens_per_expert", f"has {e} experts, which must be a positive multiple of {num_ranks}")
    if (topk_idx is None) != (topk_weights is None):
        given = "topk_idx" if topk_weights is None else "topk_weights"
        raise null("topk_weights" if topk_weights is None else "topk_idx", f"{given} is given: pass both or neither")
    if topk_idx is None:
        most = max(int(in_rank.sum(dim=1).max()) if num_tokens else 0, 1)
        dest = torch.where(in_rank, torch.arange(num_ranks, device=in_rank.device) * (e // num_ranks), -1)
        ids = dest.sort(dim=1, descending=True).values[:, :most]
        return Routing(in_rank, per_rank.long(), per_expert.long(), ids, False)
    ids = rules.expert_ids(topk_idx, "topk_idx", e, num_tokens, 32, no_expert=True).long()
    rules.dims(
        rules.tensor(topk_weights, "topk_weights", (torch.float32,), 2),
        "topk_weights",
        tuple(ids.shape),
        "topk_idx's shape",
    )
    if not torch.equal(ranks_of(ids, e, num_ranks), in_rank):
        raise shape("is_token_in_rank", "does not match topk_idx: pass get_dispatch_layout(topk_idx, ...)'s")
    counted = torch.bincount(ids[ids >= 0], minlength=e)
    if not torch.equal(per_expert.long(), counted):
        why = f"does not match topk_idx (e.g. expert {int((per_expert.long() != counted).nonzero()[0, 0])})"
        raise shape("num_tokens_per_expert", f"{why}: pass get_dispatch_layout(topk_idx, ...)'s")
    return Routing(in_rank, per_rank.long(), per_expert.long(), ids, True)


def padded(rows: list[list[int]], num_ranks: int, width: int) -> list[list[int]]:
    """``num_ranks`` rows of ``width`` ints: ``rows`` zero-padded (none: zeros)."""
    return [[*row, *[0] * (width - len(row))] for row in (rows or [[]] * num_ranks)]


def counts(num_ranks: int, words: list[tuple[int, ...]], status: list[int], op: str) -> None:
    """Raise the same error on every rank when a rank rejected its input or the ranks disagree: ``words[p]`` is rank
    p's ``(num_experts, num_tokens, num_worst_tokens, top-k width, *num_tokens_per_rank)``."""
    if bad := [(p, s) for p, s in enumerate(status) if s]:
        ranks = ", ".join(f"rank {p} (aclnn {s})" for p, s in bad)
        raise MoeDistributeError(bad[0][1], "inputs", f"{op} aborted on every rank: rejected on {ranks}")
    experts = [w[0] for w in words]
    if len(set(experts)) > 1:
        raise shape("num_tokens_per_expert", f"{op}: ranks disagree on the number of experts (per rank: {experts})")
    for q in range(num_ranks):
        total, worst = sum(w[4 + q] for w in words), words[q][2]
        if worst and total > worst:
            why = f"rank {q} receives {total} tokens, more than its num_worst_tokens = {worst}"
            raise shape("num_worst_tokens", f"{op}: {why}; raise it (num_tokens * num_ranks always fits)")
