"""Zero / copy / const experts (ids ``moe_expert_num + [0, Z + C + Const)``): never sent, added by combine locally.

Following the kernel (``CalConstExpertAlpha`` / ``ProcessConstantExpert``, ascend_ops.md §3.3), for a pair (t, k)
with weight ``w = expert_scales[t, k]``:

- zero expert: adds 0;
- copy expert: adds ``w * ori_x[t]``;
- const expert c: adds ``w * (a1 * ori_x[t] + a2 * v[c])`` with
  ``(a1, a2) = softmax(<alpha_1[c], ori_x[t]>, <alpha_2[c], ori_x[t]>)``, dot products over H in fp32.

The docs' ``alpha1 * ori_x + alpha2 * v`` reads as elementwise with `[H]` alphas; the kernel reduces each alpha
row to one scalar per token as above, which is what is implemented here.
"""

from __future__ import annotations

import torch

from . import checks
from .errors import null
from .spec import EpLayout


def validate_special(layout: EpLayout, num_tokens: int, hidden: int, dtype: torch.dtype, kw: dict) -> dict:
    """Check ``ori_x`` `[Bs, H]` (required iff copy or const experts exist) and ``const_expert_alpha_1/_2`` /
    ``const_expert_v`` `[const_expert_num, H]` (required iff const experts exist), all in expand_x's dtype."""
    need_ori = bool(layout.copy_expert_num or layout.const_expert_num)
    out: dict[str, torch.Tensor | None] = {}
    ori = checks.optional_tensor(kw["ori_x"], "ori_x", (dtype,), 2)
    if need_ori and ori is None:
        raise null("ori_x", "copy_expert_num / const_expert_num are nonzero")
    if ori is not None:
        checks.dims(ori, "ori_x", (num_tokens, hidden), "(Bs, H)")
    out["ori_x"] = ori
    for name in ("const_expert_alpha_1", "const_expert_alpha_2", "const_expert_v"):
        t = checks.optional_tensor(kw[name], name, (dtype,), 2)
        if layout.const_expert_num and t is None:
            raise null(name, f"const_expert_num is {layout.const_expert_num}")
        if t is not None:
            checks.dims(t, name, (layout.const_expert_num, hidden), "(const_expert_num, H)")
        out[name] = t
    return out


def special_contributions(
    layout: EpLayout,
    expert_ids: torch.Tensor,
    valid: torch.Tensor,
    weights: torch.Tensor,
    tensors: dict,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token `[n]`, slot `[n]`, value `[n, H]` fp32) of every active copy / const pair (zero experts add nothing).

    Arguments:
        expert_ids: `[Bs, K]`; valid: `[Bs, K]` bool, the active pairs; weights: `[Bs, K]` `torch.float32`.
    """
    ids = expert_ids.long()
    first_copy = layout.num_moe_experts + layout.zero_expert_num
    token, slot = (valid & (ids >= first_copy)).nonzero(as_tuple=True)
    hidden = 0 if tensors["ori_x"] is None else tensors["ori_x"].shape[1]
    if token.numel() == 0:
        return token, slot, torch.zeros((0, hidden), dtype=torch.float32)
    ori = tensors["ori_x"][token].float()
    w = weights[token, slot].unsqueeze(1)
    value = ori.clone()
    c = ids[token, slot] - first_copy - layout.copy_expert_num
    is_const = c >= 0
    if bool(is_const.any()):
        cc = c[is_const]
        o = ori[is_const]
        d1 = (tensors["const_expert_alpha_1"][cc].float() * o).sum(dim=1)
        d2 = (tensors["const_expert_alpha_2"][cc].float() * o).sum(dim=1)
        m = torch.maximum(d1, d2)
        e1, e2 = torch.exp(d1 - m), torch.exp(d2 - m)
        a1, a2 = (e1 / (e1 + e2)).unsqueeze(1), (e2 / (e1 + e2)).unsqueeze(1)
        value[is_const] = a1 * o + a2 * tensors["const_expert_v"][cc].float()
    return token, slot, w * value
