"""Zero / copy / const experts (ids ``moe_expert_num + [0, Z + C + Const)``): never sent, added by combine locally.

Following the kernel (``CalConstExpertAlpha`` / ``ProcessConstantExpert``), for a pair (t, k)
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

from ..params import EpLayout


def special_contributions(
    layout: EpLayout,
    expert_ids: torch.Tensor,
    valid: torch.Tensor,
    weights: torch.Tensor,
    tensors: dict[str, torch.Tensor | None],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token `[n]`, slot `[n]`, value `[n, H]` fp32) of every active copy / const pair (zero experts add nothing).

    Arguments:
        expert_ids: `[Bs, K]`; valid: `[Bs, K]` bool, the active pairs; weights: `[Bs, K]` `torch.float32`.
    """
    ids = expert_ids.long()
    first_copy = layout.num_moe_experts + layout.zero_expert_num
    token, slot = (valid & (ids >= first_copy)).nonzero(as_tuple=True)
    ori_x, alpha_1, alpha_2, v = (
        tensors[k] for k in ("ori_x", "const_expert_alpha_1", "const_expert_alpha_2", "const_expert_v")
    )
    if token.numel() == 0 or ori_x is None:
        hidden = 0 if ori_x is None else ori_x.shape[1]
        return token, slot, torch.zeros((0, hidden), dtype=torch.float32, device=expert_ids.device)
    ori = ori_x[token].float()
    w = weights[token, slot].unsqueeze(1)
    value = ori.clone()
    c = ids[token, slot] - first_copy - layout.copy_expert_num
    is_const = c >= 0
    if bool(is_const.any()) and alpha_1 is not None and alpha_2 is not None and v is not None:
        cc = c[is_const]
        o = ori[is_const]
        d1 = (alpha_1[cc].float() * o).sum(dim=1)
        d2 = (alpha_2[cc].float() * o).sum(dim=1)
        m = torch.maximum(d1, d2)
        e1, e2 = torch.exp(d1 - m), torch.exp(d2 - m)
        a1, a2 = (e1 / (e1 + e2)).unsqueeze(1), (e2 / (e1 + e2)).unsqueeze(1)
        value[is_const] = a1 * o + a2 * v[cc].float()
    return token, slot, w * value
