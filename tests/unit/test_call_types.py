"""The call types say what a call is (``deep_ep_npu.core.call``): frozen, no field typed ``Any``, each layout's fields
on its own type only; and the one quantization type (``deep_ep_npu.quant.Quant``) that the front-ends build, DeepEP's
fp8 checked against its formula written out here."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deep_ep_npu.core import call, rules
from deep_ep_npu.quant import INT8_PER_TOKEN, Quant, deepep_fp8

TYPES = [
    call.Experts,
    call.FFN,
    call.Call,
    call.FlatCall,
    call.MaskedDispatch,
    call.FlatDispatch,
    call.ExpandDispatch,
    call.FusedCall,
    call.MaskedCombine,
    call.FlatCombine,
    call.ExpandCombine,
]


def _fields(t: type) -> set[str]:
    return {f.name for f in dataclasses.fields(t)}


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.__name__)
def test_frozen_and_no_any(t):
    assert t.__dataclass_params__.frozen, t
    loose = [(f.name, f.type) for f in dataclasses.fields(t) if "Any" in str(f.type) or f.type in ("object", object)]
    assert not loose, loose


def test_a_layout_s_fields_are_on_its_type_only():
    only = {
        "quant": {call.MaskedDispatch, call.FlatDispatch},
        "x_sf": {call.ExpandDispatch},
        "cached": {call.ExpandDispatch},
        "handle": {call.MaskedCombine, call.FlatCombine, call.ExpandCombine},
        "zero_copy": {call.MaskedCombine},
        "logfmt": {call.MaskedCombine},
        "comm_quant_mode": {call.FlatCombine},
        "bias": {call.ExpandCombine},
        "x_active_mask": {call.FlatDispatch, call.FlatCombine, call.FusedCall, call.FlatCall},
        "global_bs": {call.FlatDispatch, call.FlatCombine, call.FlatCall},
    }
    for name, owners in only.items():
        have = {t for t in TYPES if name in _fields(t)}
        assert have == owners, (name, sorted(t.__name__ for t in have ^ owners))


def test_deepep_quant_builds_the_one_type():
    assert rules.deepep_quant(False, False, False, None, "fp8_e4m3") is None
    assert rules.deepep_quant(True, False, False, None, "fp8_e4m3") == deepep_fp8()
    assert (
        rules.deepep_quant(True, True, True, "fp8_e4m3", "int8_per_token")
        == deepep_fp8(True, True)
        == Quant(3, torch.float8_e4m3fn, deepep=True, round_scale=True, ue8m0=True)
    )
    assert rules.deepep_quant(True, False, False, "int8_per_token", "fp8_e4m3") == INT8_PER_TOKEN
    with pytest.raises(Exception, match="round_scale"):
        rules.deepep_quant(True, True, False, None, "int8_per_token")


@pytest.mark.parametrize("round_scale", [False, True])
def test_deepep_fp8_is_deepep_s_formula(round_scale):
    g = torch.Generator().manual_seed(3)
    x = torch.randn((5, 256), generator=g).bfloat16()
    x[1, :128] = 0  # a zero group: the scale's floor 1e-4 / 448
    q, scale = deepep_fp8(round_scale)(x)
    groups = x.float().view(5, 2, 128)
    want = groups.abs().amax(dim=-1).clamp(min=1e-4) / 448.0
    if round_scale:
        want = torch.exp2(torch.ceil(torch.log2(want)))
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    torch.testing.assert_close(scale, want, rtol=0, atol=0)
    expect = (groups / want.unsqueeze(-1)).clamp(-448, 448).view(5, 256).to(torch.float8_e4m3fn)
    assert torch.equal(q.view(torch.uint8), expect.view(torch.uint8))
    assert deepep_fp8().scale_bytes(256) == 2 * 4 and INT8_PER_TOKEN.scale_bytes(256) == 4
