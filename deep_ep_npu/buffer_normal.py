"""DeepEP's normal (high-throughput) mode on :class:`deep_ep_npu.Buffer`: ``get_dispatch_layout``, ``dispatch`` /
``combine`` with DeepEP's signatures, defaults, return values and handles (intranode, or internode when the group
spans hosts), ``Config``. One more front-end on the engine: the rows travel in DeepEP V2's non-expand layout (one
row per (token, destination rank), grouped by source rank, tokens ascending), after a count step (DeepEP's notify
step, here two small all-to-alls: every rank checks the others' layout and learns what it receives, so shapes are
exact and ``async_finish`` returns before the rows arrive). A mixin of :class:`deep_ep_npu.Buffer`."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .buffer_layout import LayoutMethods
from .core import elastic as v2
from .core import normal, rules
from .core.call import ExpandCombine, ExpandDispatch
from .engine.exchange import InFlight
from .errors import MoeDistributeError, invalid
from .handle import EventOverlap
from .handle_normal import InternodeHandle, IntranodeHandle, NormalHandle, complete, internode, intranode
from .normal_config import Config

__all__ = ["Config", "NormalModeMethods"]
DISPATCH_OP, COMBINE_OP = "dispatch", "combine"
COUNT_WORDS = 4096  # per-expert counts a rank sends in the count round (a second round for more local experts)


class NormalModeMethods(LayoutMethods):
    """The normal-mode methods of :class:`deep_ep_npu.Buffer` (see the module docstring; the layout and config
    methods: :mod:`.buffer_layout`)."""

    rank: int

    def dispatch(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        handle: NormalHandle | None = None,
        num_tokens_per_rank: torch.Tensor | None = None,
        num_tokens_per_rdma_rank: torch.Tensor | None = None,
        is_token_in_rank: torch.Tensor | None = None,
        num_tokens_per_expert: torch.Tensor | None = None,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[Any, torch.Tensor | None, torch.Tensor | None, list[int] | None, NormalHandle | None, EventOverlap]:
        """Send each token to the ranks ``is_token_in_rank`` marks (DeepEP normal-mode dispatch; collective). R ranks,
        L = E / R local experts (E = ``num_tokens_per_expert``'s length), T tokens here, num_recv the rows received.

        Arguments:
            x: `[T, hidden]` `torch.bfloat16` (`torch.float16` / `torch.float32` also), or DeepEP's fp8 tuple
                (`[T, hidden]` `torch.float8_e4m3fn`, scales `[T, S]` `torch.float32` / `torch.int32`, any strides),
                passed through bit for bit.
            handle: a handle this buffer's dispatch returned: reuse its layout (no count round); then only ``x``,
                ``config``, the event flags may be given.
            num_tokens_per_rank `[R]`, num_tokens_per_rdma_rank `[num_hosts]` (internode only), is_token_in_rank
                `[T, R]` `torch.bool`, num_tokens_per_expert `[E]`: ``get_dispatch_layout``'s (int32 / int64).
            topk_idx: `[T, K]` `torch.int64` / `torch.int32` (-1: none) and topk_weights `[T, K]` `torch.float32`,
                both or neither; they must give the layout above.
            expert_alignment: ``num_recv_tokens_per_expert_list`` is rounded up to multiples of it.
            num_worst_tokens: 0, or the rows to allocate (at least what each rank receives; also across hosts, as
                DeepEP before V2): the list is then empty.
            config: None or a :class:`Config` (checked; no effect). previous_event (an :class:`EventOverlap`),
                allocate_on_comm_stream (needs previous_event and async_finish): accepted (no streams here).
            async_finish: return at once; ``event.current_stream_wait()`` completes the receive (the returned tensors
                are filled then).

        Returns:
            recv_x: `[num_recv, hidden]` as x (a tuple for fp8), rows grouped by source rank (boundaries in the
                handle), tokens ascending. recv_topk_idx: `[num_recv, K]` in topk_idx's dtype, local expert ids
                (-1: not here) or None; recv_topk_weights: `[num_recv, K]` `torch.float32`, 0 where -1, or None.
            num_recv_tokens_per_expert_list: per local expert, the tokens all ranks send it (their
                ``num_tokens_per_expert``), aligned; ``[]`` with ``num_worst_tokens``; None for a cached dispatch.
            handle: :class:`IntranodeHandle` or :class:`InternodeHandle` (None for a cached dispatch). event.
        Rows past the received ones (``num_worst_tokens``): x unspecified, topk_idx -1, weights 0."""
        self._backend.check_alive(self)
        if handle is not None:
            return self._cached_dispatch(
                x,
                handle,
                num_tokens_per_rank,
                topk_idx,
                topk_weights,
                expert_alignment,
                num_worst_tokens,
                config,
                previous_event,
                async_finish,
                allocate_on_comm_stream,
            )
        r, me, internode_ = self.group_size, self.rank, self._internode()
        status, lay, call, words = 0, None, None, [0, 0, 0, 0, *[0] * r]
        try:
            normal.flags(previous_event, async_finish, allocate_on_comm_stream, config, Config)
            data, sf = v2.split_x(x)
            a = rules.count(expert_alignment, "expert_alignment", 1)
            worst = rules.count(num_worst_tokens, "num_worst_tokens", 0)
            lay = normal.layout(
                data.shape[0],
                r,
                self.nodes,
                num_tokens_per_rank,
                num_tokens_per_rdma_rank,
                is_token_in_rank,
                num_tokens_per_expert,
                topk_idx,
                topk_weights,
            )
            experts = rules.plain_experts(r, me, lay.num_experts, "num_tokens_per_expert")
            call = rules.dispatch(
                ExpandDispatch(
                    DISPATCH_OP,
                    data,
                    lay.ids,
                    experts,
                    num_max=max(data.shape[0], 1),
                    expert_scales=topk_weights,
                    x_sf=sf,
                    cpu_sync=False,
                    names=v2.NAMES,
                )
            )
            words = [lay.num_experts, data.shape[0], worst, lay.ids.shape[1], *lay.per_rank.tolist()]
        except MoeDistributeError as err:
            status, error = err.code, err
        # each rank's per-expert counts ride in the same round when they fit its fixed width (else a second round)
        width = max(1, COUNT_WORDS // r)
        fit = lay is not None and lay.num_experts // r <= width
        mine = normal.padded(lay.per_expert.view(r, -1).tolist() if fit else [], r, width)  # type: ignore[union-attr]
        agreed = self._backend.ep.start_agree(DISPATCH_OP, status, mine, words)()
        shared = [list(w) for w in agreed.shared]
        if status:
            raise error
        normal.counts(r, [tuple(w) for w in shared], agreed.status, DISPATCH_OP)
        assert lay is not None and call is not None
        num_local = lay.num_experts // r
        got = agreed.counts
        if num_local > width:  # (equal E everywhere: the widths match)
            got = self._backend.ep.start_agree(DISPATCH_OP, 0, lay.per_expert.view(r, num_local).tolist(), [])().counts
        per_expert = [sum(c[i] for c in got) for i in range(num_local)]
        sent = torch.tensor([w[4:] for w in shared], dtype=torch.int64)
        rows, ids = worst or int(sent[:, me].sum()), lay.ids
        if not lay.with_topk:  # every rank's routing as wide as the widest (each token's ranks, then -1)
            ids = torch.nn.functional.pad(ids, (0, max(w[3] for w in shared) - ids.shape[1]), value=-1)
        num_max = max(max(w[1] for w in shared), 1)
        recv_from = tuple(int(n) for n in sent[:, me].tolist())
        call = dataclasses.replace(call, expert_ids=ids, num_max=num_max, recv_rows=rows, recv_from=recv_from)
        with self._backend.rejecting(DISPATCH_OP, v2.NAMES):
            inflight = self._backend.dispatch(call)
        out, channels = inflight.value, (config.num_sms if config else self.num_sms) // 2
        fields = (out.handle, lay.is_token_in_rank, sent, me, max(channels, 1))
        h: NormalHandle = internode(*fields, self.nodes) if internode_ else intranode(*fields)
        out.handle.state["with_topk"] = lay.with_topk
        idx = None if not lay.with_topk else torch.empty_like(out.topk_idx, dtype=topk_idx.dtype)  # type: ignore[union-attr]
        weights = out.weights if lay.with_topk else None

        def finish() -> None:
            inflight.wait()
            complete(h, me, len(self.nodes[0]))
            if idx is not None and weights is not None:
                idx.copy_(out.topk_idx)
                weights.masked_fill_(out.topk_idx < 0, 0.0)

        listed = [] if worst else [(n + a - 1) // a * a for n in per_expert]
        recv_x = out.x if out.sf is None else (out.x, out.sf)
        return recv_x, idx, weights, listed, h, self._event(finish, async_finish)

    def _event(self, finish: Any, async_finish: bool) -> EventOverlap:
        if async_finish:
            return EventOverlap(InFlight(finish))
        finish()
        return EventOverlap(None)

    def _own(self, handle: object) -> NormalHandle:
        form = InternodeHandle if self._internode() else IntranodeHandle
        if not isinstance(handle, form):
            why = f"must be the {form.__name__} this Buffer's dispatch returned, got {type(handle).__name__}"
            raise invalid("handle", why)
        v2.owned_handle(handle.layout, self._backend)
        return handle

    def _cached_dispatch(
        self,
        x: Any,
        handle: object,
        num_tokens_per_rank: object,
        topk_idx: object,
        topk_weights: object,
        expert_alignment: object,
        num_worst_tokens: object,
        config: object,
        previous_event: object,
        async_finish: bool,
        allocate_on_comm_stream: object,
    ) -> Any:
        with self._backend.rejecting(DISPATCH_OP, v2.NAMES):
            normal.flags(previous_event, async_finish, allocate_on_comm_stream, config, Config)
            for name, value in (("topk_idx", topk_idx), ("topk_weights", topk_weights)):
                if value is not None:
                    raise invalid(name, "must be None with a cached handle (as DeepEP: the layout is the handle's)")
            rules.count(expert_alignment, "expert_alignment", 1)
            rules.count(num_worst_tokens, "num_worst_tokens", 0)
            h = self._own(handle).layout
            data, sf = v2.split_x(x)
            if data.shape[0] != h.num_tokens:
                raise invalid("x", f"has {data.shape[0]} tokens but the cached handle was made for {h.num_tokens}")
            experts = rules.plain_experts(self.group_size, self.rank, h.num_experts, "num_tokens_per_expert")
            call = rules.dispatch(
                ExpandDispatch(
                    DISPATCH_OP,
                    data,
                    h.topk_idx,
                    experts,
                    num_max=h.num_max_tokens_per_rank,
                    x_sf=sf,
                    cpu_sync=False,
                    cached=h,
                    names=v2.NAMES,
                )
            )
        inflight = self._backend.dispatch(call)
        out = inflight.value
        recv_x = out.x if out.sf is None else (out.x, out.sf)
        return recv_x, None, None, None, None, self._event(inflight.wait, async_finish)

    def combine(
        self,
        x: torch.Tensor,
        handle: NormalHandle,
        topk_weights: torch.Tensor | None = None,
        bias: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, EventOverlap]:
        """Return each received row to its source rank and add them there, without weights (DeepEP normal-mode
        combine; collective).

        Arguments:
            x: `[num_recv, hidden]` `torch.bfloat16` (`torch.float16` / `torch.float32` also), row-aligned with the
                dispatch's ``recv_x`` (rows past the received ones are ignored).
            handle: the dispatch's. topk_weights: `[num_recv, K]` `torch.float32` or None, summed the same way.
            bias: None, a `[T, hidden]` tensor or a pair of them, in x's dtype, added first.
            config, previous_event, async_finish, allocate_on_comm_stream: as in dispatch.

        Returns:
            combined_x: `[T, hidden]` in x's dtype: ``bias_0 + bias_1 + sum`` of the token's rows over the ranks it
                went to, in fp32, source ranks ascending, rounded once (0 for a token sent nowhere, plus the bias).
            combined_topk_weights: `[T, K]` `torch.float32`, the rows of ``topk_weights`` summed likewise, or None.
            event: :class:`EventOverlap`."""
        self._backend.check_alive(self)
        with self._backend.rejecting(COMBINE_OP, v2.NAMES):
            normal.flags(previous_event, async_finish, allocate_on_comm_stream, config, Config)
            h = self._own(handle).layout
            experts = rules.plain_experts(self.group_size, self.rank, h.num_experts, "num_experts")
            if topk_weights is not None and not h.state["with_topk"]:
                raise invalid("topk_weights", "must be None: the handle's dispatch had no top-k")
            call = ExpandCombine(
                COMBINE_OP,
                x,
                h.topk_idx,
                experts,
                h,
                expert_scales=topk_weights,
                by_rank=True,
                raw_weights=True,
            )
            call = v2.combine(call, True, bias)
        inflight = self._backend.combine(call)
        combined, weights = inflight.value if isinstance(inflight.value, tuple) else (inflight.value, None)
        return combined, weights, self._event(inflight.wait, async_finish)
