"""An independent single-process oracle for the Ascend MoE distribute dispatch / combine semantics.

Built the way Ascend's own golden tests build theirs: concatenate every rank's inputs, stable-sort the routed
(token, top-k) pairs by expert id, and slice the sorted list per destination rank. Nothing here imports the
implementation (``deep_ep_npu.ops``); quantization is recomputed with numpy from the documented formula.
"""

from __future__ import annotations

import dataclasses
import io
import math
import random

import numpy as np
import torch

# The outputs of ``moe_distribute_dispatch_v2``, in order.
DISPATCH_OUTPUTS = (
    "expand_x",
    "dynamic_scales",
    "assist_info_for_combine",
    "expert_token_nums",
    "ep_recv_counts",
    "tp_recv_counts",
    "expand_scales",
)


@dataclasses.dataclass
class RankInput:
    """One source rank's inputs: x `[Bs, H]`, ids `[Bs, K]`, optional mask `[Bs]`/`[Bs, K]` bool, weights `[Bs, K]`."""

    x: torch.Tensor
    ids: torch.Tensor
    mask: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    shared_x: torch.Tensor | None = None


def random_rank_input(
    x: torch.Tensor, num_ids: int, topk: int, mask: str | None, shared_x: bool, rng: random.Random, g: torch.Generator
) -> RankInput:
    """A random :class:`RankInput` around ``x`` `[Bs, H]`: ``topk`` distinct ids in ``[0, num_ids)`` per token, the
    ``mask`` (``"1d"``: the first ``randint(0, Bs)`` tokens, ``"2d"``: each (token, k) pair with probability 0.7, or
    None), weights in [0, 1) and, with ``shared_x``, a shared-expert input of ``x``'s shape and dtype.

    Drawn from ``rng`` and ``g`` in that order (ids, mask, weights, shared_x), so a seeded case stays the same."""
    bs, hidden = x.shape
    ids = torch.stack([torch.randperm(num_ids, generator=g)[:topk] for _ in range(bs)]) if bs else None
    ids = ids.to(torch.int32) if bs else torch.zeros((0, topk), dtype=torch.int32)
    rank_mask = None
    if mask == "1d":
        rank_mask = torch.arange(bs) < rng.randint(0, bs)
    elif mask == "2d":
        rank_mask = torch.rand((bs, topk), generator=g) < 0.7
    weights = torch.rand((bs, topk), generator=g)
    shared = torch.randn((bs, hidden), generator=g).to(x.dtype) if shared_x else None
    return RankInput(x, ids, rank_mask, weights, shared)


@dataclasses.dataclass
class Layout:
    """The expert layout the oracle assumes (the aclnn V2 docs): shared ranks first, then L experts per rank.

    With ``table1`` (elastic_info's EP rank -> new rank, -1 = scaled out) the experts are laid over the new ranks.
    """

    world_size: int
    moe_expert_num: int
    shared_expert_rank_num: int = 0
    shared_expert_num: int = 0  # effective S
    zero: int = 0
    copy: int = 0
    const: int = 0
    table1: list[int] | None = None

    @property
    def num_ids(self) -> int:
        return self.moe_expert_num + self.zero + self.copy + self.const

    @property
    def logical_world_size(self) -> int:
        return self.world_size if self.table1 is None else sum(v >= 0 for v in self.table1)

    def logical(self, ep_rank: int) -> int:
        return ep_rank if self.table1 is None else self.table1[ep_rank]

    def ep_of(self, logical: int) -> int:
        return logical if self.table1 is None else self.table1.index(logical)

    @property
    def num_local(self) -> int:
        return self.moe_expert_num // (self.logical_world_size - self.shared_expert_rank_num)

    def dest_of_expert(self, e: int) -> int:
        return self.ep_of(self.shared_expert_rank_num + e // self.num_local)

    def shared_dest(self, src: int, s: int) -> int:
        r = self.shared_expert_rank_num // self.shared_expert_num
        return self.ep_of(self.logical(src) % r + s * r)

    def expert_of_rank(self, ep_rank: int, local: int) -> int:
        """Global expert id of local expert ``local`` on ``ep_rank`` (shared expert s: -1 - s)."""
        lr = self.logical(ep_rank)
        if lr < 0:  # scaled out: receives nothing
            return 0
        if lr < self.shared_expert_rank_num:
            return -1 - lr // (self.shared_expert_rank_num // self.shared_expert_num)
        return (lr - self.shared_expert_rank_num) * self.num_local + local


def expert_fn(x: torch.Tensor, expert: torch.Tensor | int) -> torch.Tensor:
    """A deterministic elementwise 'expert' (so batching cannot change a bit): fp32 math, cast back to x's dtype.

    Arguments:
        x: `[n, H]` rows (any float dtype); expert: `[n]` int or an int, the global expert id (shared: -1 - s).
    """
    e = torch.as_tensor(expert, dtype=torch.float32).reshape(-1, 1)
    return (x.float() * (1.0 + e / 8.0) + e / 16.0).to(x.dtype)


def quant_int8(x: torch.Tensor, smooth: torch.Tensor | None) -> tuple[np.ndarray, np.float32]:
    """Reference §2.5 with numpy: ``xf = x * smooth``, ``q = rint(xf * (127 / amax))``, scale ``amax / 127``."""
    xf = x.float().numpy().astype(np.float32)
    if smooth is not None:
        xf = (xf * smooth.numpy().astype(np.float32)).astype(np.float32)
    amax = np.float32(np.abs(xf).max()) if xf.size else np.float32(0)
    if amax == 0:
        return np.zeros(xf.shape, dtype=np.int8), np.float32(0)
    inv = np.float32(127.0) / amax
    q = np.rint((xf * inv).astype(np.float32))
    return np.clip(q, -127, 127).astype(np.int8), np.float32(amax / np.float32(127.0))


def active_pairs(inp: RankInput, moe_expert_num: int) -> list[tuple[int, int, int]]:
    """(token, slot, expert) of every pair that is sent, in flat (token, slot) order."""
    out = []
    bs, k = inp.ids.shape
    n_active = int(inp.mask.sum()) if inp.mask is not None and inp.mask.dim() == 1 else bs
    for t in range(bs):
        for j in range(k):
            e = int(inp.ids[t, j])
            if t >= n_active or e >= moe_expert_num:
                continue
            if inp.mask is not None and inp.mask.dim() == 2 and not bool(inp.mask[t, j]):
                continue
            out.append((t, j, e))
    return out


def active_tokens(inp: RankInput) -> list[int]:
    """Tokens that go to the shared experts (the 1D mask's prefix; with a 2D mask, tokens with any active pair)."""
    bs = inp.ids.shape[0]
    if inp.mask is None:
        return list(range(bs))
    if inp.mask.dim() == 1:
        return list(range(int(inp.mask.sum())))
    return [t for t in range(bs) if bool(inp.mask[t].any())]


def routed_rows(inputs: list[RankInput], lay: Layout) -> dict[int, list[tuple[int, int, int, int]]]:
    """Per destination rank, its received rows in order: (src rank, token, slot, global expert id or -1 - s)."""
    live = [r for r in range(len(inputs)) if lay.logical(r) >= 0]
    flat = [(r, t, j, e) for r in live for (t, j, e) in active_pairs(inputs[r], lay.moe_expert_num)]
    flat.sort(key=lambda p: p[3])  # stable: ties keep (rank, token, slot) order -- the golden tests' routing sort
    per_dest: dict[int, list] = {d: [] for d in range(lay.world_size)}
    for p in flat:
        per_dest[lay.dest_of_expert(p[3])].append(p)
    k = inputs[0].ids.shape[1]
    for s in range(lay.shared_expert_num):
        for r in live:
            for t in active_tokens(inputs[r]):
                per_dest[lay.shared_dest(r, s)].append((r, t, k + s, -1 - s))
    for d in range(lay.shared_expert_rank_num):
        per_dest[lay.ep_of(d)].sort(key=lambda p: (p[0], p[1]))
    return per_dest


def recv_capacity(lay: Layout, rank: int, global_bs_real: int, topk: int) -> int:
    """A (§2.3): MoE rank ``global_bs * min(L, K)``, shared rank ``maxBs * ceil(W / R)``, elastic: the larger."""
    moe = global_bs_real * min(lay.num_local, topk)
    if not lay.shared_expert_num:
        return moe
    r = lay.shared_expert_rank_num // lay.shared_expert_num
    shared = global_bs_real // lay.world_size * math.ceil(lay.logical_world_size / r)
    if lay.table1 is not None:
        return max(moe, shared)
    return shared if 0 <= lay.logical(rank) < lay.shared_expert_rank_num else moe


def dispatch_oracle(
    inputs: list[RankInput],
    lay: Layout,
    *,
    global_bs: int = 0,
    quant: bool = False,
    smooth: torch.Tensor | None = None,
    expert_token_nums_type: int = 1,
) -> list[dict[str, torch.Tensor]]:
    """Expected dispatch outputs of every rank (keys as torch_npu names them, plus ``num_rows``)."""
    w = lay.world_size
    bs_max = max(inp.x.shape[0] for inp in inputs)
    hidden, topk = inputs[0].x.shape[1], inputs[0].ids.shape[1]
    dtype = inputs[0].x.dtype
    global_bs_real = global_bs or bs_max * w
    per_dest = routed_rows(inputs, lay)
    outs = []
    for d in range(w):
        rows = per_dest[d]
        shared_rank = 0 <= lay.logical(d) < lay.shared_expert_rank_num
        num_local = 1 if shared_rank else lay.num_local
        cap = recv_capacity(lay, d, global_bs_real, topk)
        n = len(rows)
        expand_x = torch.zeros((cap, hidden), dtype=torch.int8 if quant else dtype)
        dyn = torch.zeros((cap,), dtype=torch.float32)
        assist = torch.zeros((max(inputs[d].x.shape[0] * topk, cap * 128),), dtype=torch.int32)
        counts = torch.zeros((num_local, w), dtype=torch.int64)
        expand_scales = torch.zeros((cap,), dtype=torch.float32)
        for i, (r, t, j, e) in enumerate(rows):
            row = inputs[r].x[t]
            if quant:
                srow = None
                if smooth is not None:
                    srow = smooth[lay.shared_expert_num + e] if e >= 0 else smooth[-1 - e]
                q, sc = quant_int8(row, srow)
                expand_x[i] = torch.from_numpy(q)
                dyn[i] = float(sc)
            else:
                expand_x[i] = row
            assist[3 * i : 3 * i + 3] = torch.tensor([r, t, j], dtype=torch.int32)
            local = 0 if shared_rank else e - (lay.logical(d) - lay.shared_expert_rank_num) * lay.num_local
            counts[local, r] += 1
            if inputs[r].weights is not None:
                expand_scales[i] = inputs[r].weights[t, j] if j < topk else 1.0
        per_expert = counts.sum(dim=1)
        outs.append(
            dict(
                expand_x=expand_x,
                dynamic_scales=dyn,
                assist_info_for_combine=assist,
                expert_token_nums=(per_expert.cumsum(0) if expert_token_nums_type == 0 else per_expert),
                ep_recv_counts=counts.reshape(-1).cumsum(0).to(torch.int32),
                expand_scales=expand_scales,
                num_rows=torch.tensor(n),
                experts=torch.tensor([p[3] for p in rows], dtype=torch.int64),
            )
        )
    return outs


def combine_oracle(
    inputs: list[RankInput],
    lay: Layout,
    *,
    quant: bool = False,
    smooth: torch.Tensor | None = None,
    comm_quant: bool = False,
    special: list[dict] | None = None,
    expert_out=None,
) -> list[torch.Tensor]:
    """Expected combine output of every rank when expert e maps a row x to ``expert_fn(x, e)``.

    ``out[t] = sum_k c[t, k]`` (k ascending, fp32; masked pairs add nothing), where ``c`` is ``w * y`` for a routed
    expert, 0 / ``w * ori_x`` / ``w * (a1 * ori_x + a2 * v[c])`` for zero / copy / const experts, then the shared
    experts' ``y`` (slots K + s) and ``shared_x[t]`` with weight 1, then one cast. With ``quant`` the expert sees the
    dequantized int8 row ``q * scale``; with ``comm_quant`` the returned y went through the 8-element int8 codec.
    ``expert_out(src_rank, row, e)`` overrides how y is computed (the TP tests sum two partial experts).
    """
    outs = []
    for r, inp in enumerate(inputs):
        bs, hidden = inp.x.shape
        acc = torch.zeros((bs, hidden), dtype=torch.float32)
        if lay.logical(r) < 0:
            outs.append(acc.to(inp.x.dtype))
            continue

        def y_of(t: int, e: int, r=r, inp=inp) -> torch.Tensor:
            y = _expert_out(inp.x[t], e, lay, quant, smooth) if expert_out is None else expert_out(r, inp.x[t], e)
            return comm_quant_row(y) if comm_quant else y

        pairs = {(t, j): e for t, j, e in active_pairs(inp, lay.num_ids)}
        for t in range(bs):
            for j in range(inp.ids.shape[1]):
                if (t, j) not in pairs:
                    continue
                e, w = pairs[(t, j)], inp.weights[t, j]
                if e < lay.moe_expert_num:
                    acc[t] += w * y_of(t, e).float()
                elif e >= lay.moe_expert_num + lay.zero:
                    acc[t] += w * _special_value(inp.x.dtype, special[r], t, e - lay.moe_expert_num - lay.zero, lay)
        for s in range(lay.shared_expert_num):
            for t in active_tokens(inp):
                acc[t] += y_of(t, -1 - s).float()
        if inp.shared_x is not None:
            acc += inp.shared_x.float().reshape(bs, hidden)
        if inp.mask is not None and inp.mask.dim() == 1:
            acc[int(inp.mask.sum()) :] = 0
        outs.append(acc.to(inp.x.dtype))
    return outs


def _special_value(dtype: torch.dtype, sp: dict, t: int, c: int, lay: Layout) -> torch.Tensor:
    """Copy expert (c < copy): ori_x[t]; const expert c': a1 * ori_x[t] + a2 * v[c'] with a 2-way softmax of the
    dot products <alpha_i[c'], ori_x[t]> (the kernel's reading of §3.3), fp32, via numpy."""
    ori = sp["ori_x"][t].float().numpy().astype(np.float64)
    if c < lay.copy:
        return torch.from_numpy(ori.astype(np.float32))
    c -= lay.copy
    d1 = float(np.dot(sp["alpha_1"][c].float().numpy().astype(np.float64), ori))
    d2 = float(np.dot(sp["alpha_2"][c].float().numpy().astype(np.float64), ori))
    m = max(d1, d2)
    e1, e2 = math.exp(d1 - m), math.exp(d2 - m)
    a1, a2 = e1 / (e1 + e2), e2 / (e1 + e2)
    v = sp["v"][c].float().numpy().astype(np.float64)
    return torch.from_numpy((a1 * ori + a2 * v).astype(np.float32))


def comm_quant_row(y: torch.Tensor, group: int = 8) -> torch.Tensor:
    """A row after combine's int8 comm quant (§3.3), numpy: per 8 elements ``scale = to_dtype(amax / 127)``,
    ``q = rint(y / scale)``, back as ``to_dtype(q * scale)``."""
    yf = y.float().numpy().astype(np.float32).reshape(-1, group)
    amax = np.abs(yf).max(axis=1).astype(np.float32)
    scale = torch.from_numpy((amax / np.float32(127)).astype(np.float32)).to(y.dtype).float().numpy()[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(scale > 0, np.rint(yf / np.where(scale > 0, scale, 1)), 0).clip(-127, 127)
    return torch.from_numpy((q * scale).astype(np.float32).reshape(-1)).to(y.dtype)


def _expert_out(row: torch.Tensor, e: int, lay: Layout, quant: bool, smooth: torch.Tensor | None) -> torch.Tensor:
    if quant:
        srow = None
        if smooth is not None:
            srow = smooth[lay.shared_expert_num + e] if e >= 0 else smooth[-1 - e]
        q, sc = quant_int8(row, srow)
        row = (torch.from_numpy(q).float() * float(sc)).to(row.dtype)
    return expert_fn(row.unsqueeze(0), e)[0]


def to_bytes(obj: object) -> bytes:
    """Serialize rank results (tensors inside) so they outlive the rank process (no shared-memory handles)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def from_bytes(data: bytes) -> object:
    return torch.load(io.BytesIO(data), weights_only=False)
