"""DeepEP V2's receive layouts (``ElasticBuffer``): one row per (source token, this rank), or one per (token, local
expert) ("expand").

A V2 row's payload is raw bytes, ``[x row | scale-factor row | top-k weights, fp32 x K]`` (:class:`Payload`): nothing
is cast, so fp8 data and its 4-byte scale factors arrive bit for bit. The row's slots carry the local expert of each
top-k entry at this rank (-1: another rank's), i.e. ``recv_topk_idx``.

Non-expand: rows grouped by source rank, ascending; inside a source, its tokens ascending (always; ``deterministic``
changes nothing). Expand: rows grouped by local expert, ascending, expert ``e``'s segment starting at
``align(psum[e - 1], expert_alignment)``; inside an expert, by (source rank, token). :class:`Placement` is where every
row and pair went; a cached handle keeps it, so a cached dispatch places rows at the same positions without
recomputing (or exchanging) anything.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..errors import shape
from ..group import Agreement, EPGroup
from ..group_names import comm_device
from ..sizes import align
from .dispatch import Incoming
from .rows import RowFormat

X_DTYPE_CODES = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3, torch.float8_e4m3fn: 4}
SF_DTYPE_CODES = {None: 0, torch.float32: 1, torch.int32: 2}


@dataclasses.dataclass(frozen=True)
class Payload:
    """How a row's bytes split: ``x`` `[hidden]` in ``x_dtype``, ``sf`` `[sf_cols]` (4-byte ``sf_dtype``, or none),
    the weights `[num_topk]` fp32 (zeros when the caller gave none)."""

    hidden: int
    x_dtype: torch.dtype
    sf_cols: int
    sf_dtype: torch.dtype | None
    num_topk: int

    @property
    def x_bytes(self) -> int:
        return self.hidden * self.x_dtype.itemsize

    @property
    def sf_end(self) -> int:
        return self.x_bytes + 4 * self.sf_cols

    @property
    def num_bytes(self) -> int:
        return self.sf_end + 4 * self.num_topk

    @property
    def fingerprint(self) -> tuple[int, ...]:
        return self.hidden, X_DTYPE_CODES[self.x_dtype], self.sf_cols, SF_DTYPE_CODES[self.sf_dtype], self.num_topk

    def pack(self, x: torch.Tensor, sf: torch.Tensor | None, weights: torch.Tensor | None) -> torch.Tensor:
        """`[T, num_bytes]` uint8 from x `[T, hidden]`, sf `[T, sf_cols]` and weights `[T, K]` fp32 (or None)."""
        parts = [x.contiguous().view(torch.uint8)]
        if sf is not None:
            parts.append(sf.contiguous().view(torch.uint8))
        w = weights if weights is not None else x.new_zeros((x.shape[0], self.num_topk), dtype=torch.float32)
        parts.append(w.contiguous().view(torch.uint8))
        return torch.cat(parts, dim=1)

    def fields(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Views of ``rows`` `[n, >= num_bytes]` uint8: x `[n, hidden]`, sf `[n, sf_cols]` (or None), weights."""
        sf = rows[:, self.x_bytes : self.sf_end].view(self.sf_dtype) if self.sf_dtype is not None else None
        return rows[:, : self.x_bytes].view(self.x_dtype), sf, rows[:, self.sf_end : self.num_bytes].view(torch.float32)


@dataclasses.dataclass
class Placement:
    """Where one dispatch put its rows (kept by the handle; the same topk_idx places the same way). ``rows_from``:
    rows per source rank (this rank's own included); ``slots`` `[num_recv, K]` int32: each received row's local
    expert per top-k slot (-1: not here), rows in layout order; ``pair_row`` / ``pair_slot`` / ``pair_pos`` `[P]`
    int64: each (row, slot) pair for this rank and its expand row; ``counts`` `[L]` int64: pairs per local expert;
    ``num_rows`` / ``num_expanded``: the allocated rows (exact, or the worst case without CPU sync)."""

    rows_from: list[int]
    slots: torch.Tensor
    pair_row: torch.Tensor
    pair_slot: torch.Tensor
    pair_pos: torch.Tensor
    counts: torch.Tensor
    num_rows: int
    num_expanded: int


def worst_case_rows(num_ranks: int, num_max: int, num_topk: int, num_local: int, alignment: int) -> tuple[int, int]:
    """DeepEP's no-CPU-sync shapes: ``R * N`` rows, ``align(R * N * min(K, L) + (a - 1) * L, a)`` expanded rows."""
    rn = num_ranks * num_max
    return rn, align(rn * min(num_topk, num_local) + (alignment - 1) * num_local, alignment)


class ElasticLayout:
    """Places V2 rows (see the module docstring). ``outputs`` (filled by :meth:`place_remote`): ``x`` `[rows, hidden]`,
    ``sf`` `[rows, sf_cols]` or None, ``weights`` (`[rows, K]` fp32; expand: `[rows]`), ``topk_idx`` `[rows, K]`
    int64 (non-expand), ``metadata`` `[num_recv, K + 2]` int32 (source rank * N + token, source rank, expand row
    per slot or -1), ``psum_per_rank`` `[R]` int32 (inclusive), ``psum_per_expert`` `[L]` int32, ``counts`` `[L]`
    int32 (unaligned); allocated up front when ``sizes`` is given, else at the receive (exact sizes)."""

    names = ("cached handle", "num_max_tokens_per_rank", "num_experts", "hidden", "x dtype", "scale-factor columns",
             "scale-factor dtype", "num_topk", "row bytes")  # fmt: skip
    """What every rank must agree on (:func:`fingerprint`, after its two count vectors)."""

    # fmt: off
    def __init__(self, rank: int, num_ranks: int, num_max: int, num_local: int, payload: Payload, alignment: int,
                 do_expand: bool, zero_padding: bool, tma_sf: bool, device: torch.device,
                 sizes: tuple[int, int] | None = None, cached: Placement | None = None,
                 ep: EPGroup | None = None) -> None:
        # fmt: on
        self.rank, self.num_ranks, self.num_max, self.num_local = rank, num_ranks, num_max, num_local
        self.payload, self.alignment, self.do_expand = payload, alignment, do_expand
        self.zero_padding, self.tma_sf, self.device, self.placement = zero_padding, tma_sf, device, cached
        self.sizes = sizes  # (rows, expand rows) to allocate, known up front (no CPU sync, a cached handle)
        self.ep = ep  # the group (needed by check)
        self.outputs: dict[str, torch.Tensor | None] = {}
        if sizes is not None:
            self.alloc(*sizes)

    def check(self, agreement: Agreement) -> None:
        assert self.ep is not None
        check_agreement(self.ep, agreement, cached=self.placement is not None)

    def alloc(self, num_rows: int, num_expanded: int) -> None:
        """Allocate the outputs for ``num_rows`` received tokens and ``num_expanded`` expand rows."""
        p, dev, k = self.payload, self.device, self.payload.num_topk
        rows = num_expanded if self.do_expand else num_rows
        new = torch.zeros if self.zero_padding else torch.empty
        sf = None
        if p.sf_dtype is not None:
            if self.tma_sf:  # DeepEP's TMA-aligned column-major scale factors: strides (1, align(rows, 4))
                sf = new((p.sf_cols, align(rows, 4)), dtype=p.sf_dtype, device=dev).t()[:rows]
            else:
                sf = new((rows, p.sf_cols), dtype=p.sf_dtype, device=dev)
        self.outputs = dict(
            x=new((rows, p.hidden), dtype=p.x_dtype, device=dev), sf=sf,
            weights=torch.zeros((rows,) if self.do_expand else (rows, k), dtype=torch.float32, device=dev),
            topk_idx=None if self.do_expand else torch.full((rows, k), -1, dtype=torch.int64, device=dev),
            metadata=torch.full((num_rows, k + 2), -1, dtype=torch.int32, device=dev),
            psum_per_rank=torch.empty((self.num_ranks,), dtype=torch.int32, device=dev),
            psum_per_expert=torch.empty((self.num_local,), dtype=torch.int32, device=dev),
            counts=torch.empty((self.num_local,), dtype=torch.int32, device=dev),
        )  # fmt: skip

    def place_own(self, fmt: RowFormat, incoming: Incoming) -> None:
        """Nothing yet: own rows are placed with the remote ones (the layout puts them between the sources)."""

    def place_own_direct(self, *_: Any) -> bool:
        """No: own rows are packed (and placed with the remote ones)."""
        return False

    def place_remote(self, fmt: RowFormat, incoming: Incoming, own: Incoming, agreement: Agreement,
                     wait_ns: int) -> None:  # fmt: skip
        me, r, rows, own_rows = self.rank, self.num_ranks, incoming.rows, own.rows
        if self.placement is not None:
            rows_from = self.placement.rows_from
        else:
            rows_from = [own_rows.shape[0] if s == me else agreement.counts[s][0] for s in range(r)]
        split = sum(rows_from[:me])
        parts = [rows[:split], own_rows, rows[split:]]  # layout order: by source rank, tokens ascending
        staged = parts[0] if len(parts[0]) == sum(rows_from) else torch.cat(parts)  # [total, row_bytes]
        place = self.placement
        if place is None:
            place = make_placement(fmt.slot_experts(staged), rows_from, self.num_local, self.alignment, self.sizes)
        self.fill(place, *self.payload.fields(staged), fmt.tokens(staged))

    def fill(self, place: Placement, x: torch.Tensor, sf: torch.Tensor | None, weights: torch.Tensor,
             tokens: torch.Tensor) -> None:  # fmt: skip
        """Write the received tokens, in layout order (x `[total, hidden]`, sf `[total, sf_cols]` or None, weights
        `[total, K]` fp32, tokens `[total]` int32: each one's index at its source) where ``place`` says; a fresh
        layout also fills the handle's tensors."""
        if not self.outputs:
            self.alloc(place.num_rows, place.num_expanded)
        out = self.outputs
        if self.do_expand:
            src_row, pos = place.pair_row, place.pair_pos
            _put(out["x"], pos, x.index_select(0, src_row))
            if sf is not None:
                _put(out["sf"], pos, sf.index_select(0, src_row))
            _put(out["weights"], pos, weights[src_row, place.pair_slot])
        else:
            _copy_rows(out["x"], x)
            if sf is not None:
                _copy_rows(out["sf"], sf)
            _copy_rows(out["weights"], weights)
            _copy_rows(out["topk_idx"], place.slots)
        if self.placement is None:  # a fresh layout: the handle's tensors
            self._fill_handle(tokens, place)
            self.placement = place

    def _fill_handle(self, tokens: torch.Tensor, place: Placement) -> None:
        out, n, a, total = self.outputs, self.num_max, self.alignment, tokens.shape[0]
        dev = tokens.device
        rows_from = torch.tensor(place.rows_from, device=dev)
        src = torch.repeat_interleave(torch.arange(self.num_ranks, device=dev), rows_from, output_size=total)
        meta = out["metadata"]
        assert meta is not None
        meta[:total, 0] = src.to(torch.int32) * n + tokens.to(torch.int32)
        meta[:total, 1] = src.to(torch.int32)
        if self.do_expand:
            meta[place.pair_row, 2 + place.pair_slot] = place.pair_pos.to(torch.int32)
        counts = place.counts
        aligned = (counts + a - 1) // a * a
        psum = aligned.cumsum(0)
        for name, value in (
            ("psum_per_rank", rows_from.cumsum(0)),
            ("psum_per_expert", psum - aligned + counts if self.do_expand else psum),
            ("counts", counts),
        ):
            out[name].copy_(value)  # type: ignore[union-attr]


def make_placement(slots: torch.Tensor, rows_from: list[int], num_local: int, alignment: int,
                   sizes: tuple[int, int] | None) -> Placement:  # fmt: skip
    """The placement of received tokens in layout order: ``slots`` `[total, K]` int32 (each one's local expert per
    slot, -1: not here), ``rows_from`` tokens per source rank; ``sizes``: the rows to allocate (None: exact)."""
    pair_row, pair_slot = (slots >= 0).nonzero(as_tuple=True)
    expert = slots[pair_row, pair_slot].long()
    total, a = slots.shape[0], alignment
    order = torch.argsort(expert * max(total, 1) + pair_row)  # by (local expert, row): rows are (source, token)
    pair_row, pair_slot, expert = pair_row[order], pair_slot[order], expert[order]
    counts = torch.bincount(expert, minlength=num_local)
    aligned = (counts + a - 1) // a * a
    start = aligned.cumsum(0) - aligned
    pos = start[expert] + torch.arange(expert.numel(), device=expert.device) - (counts.cumsum(0) - counts)[expert]
    num_rows, num_expanded = sizes or (total, int(aligned.sum()))
    return Placement(rows_from, slots, pair_row, pair_slot, pos, counts, num_rows, num_expanded)


def _copy_rows(out: torch.Tensor | None, rows: torch.Tensor) -> None:
    assert out is not None
    out[: rows.shape[0]] = rows


def _put(out: torch.Tensor | None, pos: torch.Tensor, values: torch.Tensor) -> None:
    assert out is not None
    out[pos] = values


def fingerprint(send_rows: list[int], expect_rows: list[int] | None, rest: tuple[int, ...], row_bytes: int) -> tuple:
    """A V2 dispatch's agreement values: the rows this rank sends to each rank, the rows it expects from each (a
    cached handle's; -1 each without one), whether it reuses a handle, then ``rest`` (``ElasticLayout.names``
    between the flag and the row bytes) and the row bytes."""
    expect = [-1] * len(send_rows) if expect_rows is None else list(expect_rows)
    return (*send_rows, *expect, int(expect_rows is not None), *rest, row_bytes)


def release_cached_peers(ep: EPGroup, agreement: Agreement) -> None:
    """Peers that reuse a handle have their payload in flight already: a rank that does not (a fresh call, or one
    that rejected its input) takes part in it with zeros, so that every rank gets to raise instead of waiting."""
    r, me = ep.num_ranks, ep.rank
    cached = [fp[2 * r] == 1 and p != me for p, fp in enumerate(agreement.shared)]
    if not any(cached):
        return
    width = [fp[-1] for fp in agreement.shared]
    recv = [agreement.shared[p][me] * width[p] if cached[p] else 0 for p in range(r)]
    send = [agreement.shared[p][r + me] * width[p] if cached[p] else 0 for p in range(r)]
    dev = comm_device(ep.comm)
    recv_t = torch.empty((sum(recv),), dtype=torch.uint8, device=dev)
    ep.wait(ep.all_to_all(recv_t, torch.zeros((sum(send),), dtype=torch.uint8, device=dev), recv, send,
                          "payload exchange"), "payload exchange")  # fmt: skip


def check_agreement(ep: EPGroup, agreement: Agreement, cached: bool) -> None:
    """Raise the same error on every rank when any rank rejected its input, when some ranks reuse a handle and
    others do not, when the ranks' handles do not describe the same dispatch (the rows one sends another differ from
    what the other expects), or when they disagree on a value of ``ElasticLayout.names``."""
    r, me = ep.num_ranks, ep.rank
    if not cached:
        release_cached_peers(ep, agreement)
    agreement.check(me, ())
    shared = agreement.shared
    if all(fp[2 * r] == 1 for fp in shared):
        bad = [(p, q) for p in range(r) for q in range(r) if p != q and shared[p][q] != shared[q][r + p]]
        if bad:
            (p, q), n = bad[0], len(bad)
            raise shape("handle", f"rank {p}'s handle sends {shared[p][q]} rows to rank {q}, whose handle expects "
                        f"{shared[q][r + p]} from it ({n} rank pairs differ): every rank must pass the handle of the "
                        "same dispatch")  # fmt: skip
    agreement.check(me, ElasticLayout.names, offset=2 * r)
