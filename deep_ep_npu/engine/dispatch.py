"""Dispatch: move each token to the ranks hosting its experts and place it by a layout.

Send phase (:func:`start_dispatch`): the agreement step starts (status, rows per destination, fingerprint), the
rows are encoded while it travels (:mod:`.rows`; each token once per destination rank), then the remote rows go
out in one uneven all-to-all. This rank's own rows never touch the wire. Receive phase (the returned
:class:`~deep_ep_npu.event.Completion`): the received rows are expanded into one output row per (token, local
expert) at the position the layout computes, written once:

- :class:`Masked` (DeepEP): ``recv_x`` `[L, R * N, hidden]`; inside local expert i, this rank's own block first
  (expanded while the remote rows travel), then the other sources in rank order, tokens ascending.
- :class:`Flat` (Ascend): ``expand_x`` `[A, hidden]`, rows expert-major, then source rank, then token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from .. import profiling
from ..event import Completion
from ..group import STATUS_OK, EPGroup
from .plan import Plan
from .rows import RowFormat
from .workspace import Workspace


@dataclasses.dataclass
class Received:
    """Pairs parsed from received rows: `[n]` int64 each, in receive order."""

    row: torch.Tensor
    slot: torch.Tensor
    expert: torch.Tensor
    src: torch.Tensor


def parse(fmt: RowFormat, rows: torch.Tensor, src_of_row: torch.Tensor, masked_src: torch.Tensor | None) -> Received:
    """The (row, slot, local expert, source) of every pair the rows carry (rows from masked sources dropped)."""
    table = fmt.slot_experts(rows)
    valid = table >= 0
    if masked_src is not None:
        valid &= ~masked_src[src_of_row].unsqueeze(1)
    row, slot = valid.nonzero(as_tuple=True)
    return Received(row, slot, table[row, slot].long(), src_of_row[row])


@dataclasses.dataclass
class DispatchJob:
    """One validated dispatch, ready for the engine.

    ``slot_expert`` `[P]` int64 is each pair's local expert at its destination (``plan.expert``), ``weights`` `[P]`
    fp32 the per-pair weight to carry (or None), ``smooth`` `[num_rows, hidden]` fp32 per-row int8 smoothing.
    ``fingerprint``: the values every rank must agree on (``layout.names`` names them).
    """

    ep: EPGroup
    op: str
    x: torch.Tensor
    plan: Plan
    fmt: RowFormat
    weights: torch.Tensor | None
    smooth: torch.Tensor | None
    fingerprint: tuple[int, ...]
    layout: Any  # Masked | Flat
    workspace: Workspace
    tag: str = ""  # workspace names of the wire buffers (double-buffering)
    before_send: Callable[[], bool] | None = None  # runs after the agreement, before the payload (the TP pair's)


def start_dispatch(job: DispatchJob) -> Completion:
    """Run the send phase; the returned completion runs the receive phase and fills ``job.layout``'s outputs."""
    ep, plan, fmt, x = job.ep, job.plan, job.fmt, job.x
    me, r, lap = ep.rank, ep.num_ranks, profiling.laps("dispatch")
    counts = [[plan.rows_per_dest[d], plan.pairs_per_dest[d]] for d in range(r)]
    finish_agree = ep.start_agree(job.op, STATUS_OK, counts, job.fingerprint, device=x.device)
    profiling.record_wire("dispatch", [k * fmt.row_bytes for k in plan.rows_per_dest], me, 8 * len(job.fingerprint))

    num_rows = int(plan.row_token.numel())
    send = job.workspace.get(f"dispatch_send{job.tag}", (num_rows, fmt.row_bytes), torch.uint8)
    slot_expert = torch.full((num_rows, fmt.num_slots), -1, dtype=torch.int32, device=x.device)
    slot_expert[plan.row_of_pair, plan.slot] = plan.expert.to(torch.int32)
    weights = None
    if job.weights is not None:
        weights = torch.zeros((num_rows, fmt.num_slots), dtype=torch.float32, device=x.device)
        weights[plan.row_of_pair, plan.slot] = job.weights
    x_rows = torch.index_select(x, 0, plan.row_token)
    fmt.encode_into(send, x_rows, plan.row_token, slot_expert, weights, job.smooth)
    lap("packing")  # (while the agreement travels)
    agreement = finish_agree()
    job.layout.check(agreement)
    if job.before_send is not None:
        job.before_send()
    lap("header_wait")
    recv_rows = [0 if s == me else c[0] for s, c in enumerate(agreement.counts)]
    send_rows = [0 if d == me else k for d, k in enumerate(plan.rows_per_dest)]
    recv = job.workspace.get(f"dispatch_recv{job.tag}", (sum(recv_rows), fmt.row_bytes), torch.uint8)
    transfer = ep.transfer(recv, send[: plan.num_remote_rows], recv_rows, send_rows, "payload exchange")
    lap("collective_start")
    own_rows = send[plan.num_remote_rows :]
    own = parse(fmt, own_rows, torch.full((own_rows.shape[0],), me, device=x.device), None)
    job.layout.place_own(fmt, own_rows, own)
    lap("unpacking_self")

    def finish() -> None:
        lap = profiling.laps("dispatch")
        wait_ns = transfer.wait()
        lap("collective_wait")
        src_of_row = torch.repeat_interleave(
            torch.arange(r, device=x.device), torch.tensor(recv_rows, device=x.device), output_size=recv.shape[0]
        )
        masked = ep.mask.to(x.device).bool() if bool(ep.mask.any()) else None
        job.layout.place_remote(fmt, recv, parse(fmt, recv, src_of_row, masked), own_rows, own, agreement, wait_ns)
        lap("unpacking")

    return Completion(finish)
