"""``deep_ep_npu.sim``: the torch_npu stand-in (install / uninstall, the module's attributes, communicator names as
``group_ep`` / ``group_tp``, the vllm-ascend naming line) and the docs/sim.md example against an independent oracle.

Every install runs in a ``parallel_launch`` child (the ``"npu"`` device name it sets cannot be undone in a process);
the refusals, which change nothing, run in the test process. The Ascend backend on the sim: test_ascend_backend.py.
"""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import torch
import torch.distributed as dist

from deep_ep_npu import ops, sim
from tests.support.distributed import op_error, parallel_launch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="a real torch_npu exists")
TWO_STAGE = ("dispatch_setup", "dispatch_teardown", "combine_setup", "combine_teardown")


def _install_and_names(info):
    from deep_ep_npu import backends
    from deep_ep_npu.transports.names import resolve_group

    original = vars(dist.ProcessGroup)["_get_backend"]
    assert not sim.installed() and importlib.util.find_spec("torch_npu") is None
    module = sim.install()
    assert sim.install() is module and sim.installed()
    import torch_npu

    assert torch_npu is module and importlib.util.find_spec("torch_npu") is module.__spec__
    assert torch_npu.SIMULATED is True and torch_npu.device_type == "cpu" and "sim" in torch_npu.__version__
    assert (torch_npu.float8_e8m0fnu, torch_npu.hifloat8, torch_npu.float4_e2m1fn_x2) == (293, 290, 296)
    t = torch.ones(2)
    assert torch_npu.npu_format_cast(t, 29) is t
    assert torch_npu.npu_moe_distribute_dispatch_v2 is ops.moe_distribute_dispatch_v2
    assert torch_npu.npu_moe_distribute_combine_v2 is ops.moe_distribute_combine_v2
    for name in TWO_STAGE:  # bound by name when accessed
        if hasattr(ops, f"moe_distribute_{name}"):
            assert getattr(torch_npu, f"npu_moe_distribute_{name}") is getattr(ops, f"moe_distribute_{name}")
        else:
            with pytest.raises(AttributeError, match=f"deep_ep_npu.ops.moe_distribute_{name} does not exist"):
                getattr(torch_npu, f"npu_moe_distribute_{name}")
    with pytest.raises(AttributeError, match="has no 'npu_grouped_matmul'; it provides"):
        torch_npu.npu_grouped_matmul  # noqa: B018
    assert {"npu_moe_distribute_dispatch_setup", "hifloat8", "SIMULATED"} <= set(dir(torch_npu))

    # names: vllm-ascend's line (group-local rank), sgl's (group.rank()), backends.hccl_comm_name, resolve_group
    group, sub = info.group, dist.new_group([1, 0])
    name = group._get_backend(torch.device("npu")).get_hccl_comm_name(info.rank)
    assert name == sim.hccl_comm_name(group) == f"sim_hccl_{group.group_name}"
    assert group._get_backend(torch.device("npu")).get_hccl_comm_name(info.rank, init_comm=False) == name
    assert backends.hccl_comm_name(group, info.rank) == name
    sub_name = sub._get_backend(torch.device("npu")).get_hccl_comm_name(sub.rank())
    assert sub_name != name and resolve_group(name, "group_ep") is group and resolve_group(sub_name, "group_tp") is sub
    assert resolve_group(sub.group_name, "group_ep") is sub and resolve_group(sub, "group_ep") is sub
    assert isinstance(group._get_backend(torch.device("cpu")), dist.ProcessGroupGloo)  # other devices delegated
    with pytest.raises(ValueError, match="rankid must be an int >= 0"):
        group._get_backend(torch.device("npu")).get_hccl_comm_name(-1)
    code, param, text = op_error(lambda: resolve_group("sim_hccl_nope", "group_ep"))
    assert (code, param) == (161002, "group_ep") and "'sim_hccl_nope'" in text
    assert all(repr(known) in text for known in (name, sub_name, group.group_name, sub.group_name))
    assert op_error(lambda: resolve_group(None, "group_tp"))[:2] == (161001, "group_tp")
    dist.barrier()  # c10d's device probe still picks the CPU
    everyone = [None] * info.world_size
    dist.all_gather_object(everyone, [name, sub_name])

    sim.uninstall()
    sim.uninstall()
    assert not sim.installed() and "torch_npu" not in sys.modules and importlib.util.find_spec("torch_npu") is None
    assert vars(dist.ProcessGroup)["_get_backend"] is original
    with pytest.raises(RuntimeError, match="No backend type associated with device type npu"):
        group._get_backend(torch.device("npu"))
    assert op_error(lambda: resolve_group(name, "group_ep"))[0] == 161002  # forgotten
    again = sim.install()  # a fresh module; the device name is kept
    assert again is not module and sim.installed() and backends.hccl_comm_name(group, 0) == name
    sim.uninstall()
    return everyone


def test_install_names_uninstall():
    """install is idempotent and found by find_spec; names round-trip through resolve_group and agree across ranks;
    an unknown name lists the known ones; uninstall restores everything (twice is fine)."""
    names = parallel_launch(2, _install_and_names, timeout=60)
    assert names[0] == names[1] and names[0][0] == names[0][1] and names[0][0][0] == "sim_hccl_0"


def _hccl_probe(info):
    """With a (fake) real torch_npu loaded, names of groups with an HCCL backend resolve through the probe, asked
    with init_comm=False; a group whose probe raises is skipped, never an error."""
    from deep_ep_npu.transports.names import resolve_group

    sys.modules["torch_npu"] = types.ModuleType("torch_npu")
    torch.utils.rename_privateuse1_backend("npu")  # as torch_npu does
    good, bad = info.group, dist.new_group([0, 1])
    asked = []

    class Backend:
        def __init__(self, pg):
            self.pg = pg

        def get_hccl_comm_name(self, rankid, init_comm=True):
            asked.append(init_comm)
            if self.pg is bad:
                raise RuntimeError("HCCL communicator not initialized")
            return f"hccl_{rankid}"

    dist.get_backend = lambda group=None: "cpu:gloo,npu:hccl"
    dist.ProcessGroup._get_backend = lambda pg, device: Backend(pg)
    assert resolve_group(f"hccl_{info.rank}", "group_ep") is good and set(asked) == {False}
    code, _, text = op_error(lambda: resolve_group("hccl_99", "group_ep"))
    assert code == 161002 and f"'hccl_{info.rank}'" in text
    return True


def test_resolve_group_hccl_probe():
    assert parallel_launch(2, _hccl_probe, timeout=60) == [True, True]


def test_install_refuses(monkeypatch):
    """A real torch_npu already imported, or a privateuse1 backend of another name: a clear RuntimeError, no change."""
    original = vars(dist.ProcessGroup)["_get_backend"]
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    with pytest.raises(RuntimeError, match="torch_npu is already imported"):
        sim.install()
    monkeypatch.delitem(sys.modules, "torch_npu")
    monkeypatch.setattr(torch._C, "_get_privateuse1_backend_name", lambda: "xpu_like")
    with pytest.raises(RuntimeError, match="already named 'xpu_like'"):
        sim.install()
    assert not sim.installed() and "torch_npu" not in sys.modules
    assert vars(dist.ProcessGroup)["_get_backend"] is original


def _example(info):
    """The docs/sim.md example's ``moe_layer`` (written against torch_npu) under sim.install()."""
    from examples.sim_torch_npu import moe_layer

    sim.install()
    g = torch.Generator().manual_seed(info.rank)
    num_tokens, hidden, num_experts, k = [5, 0, 3, 7][info.rank], 32, 8, 3
    x = torch.randn((num_tokens, hidden), generator=g).to(torch.bfloat16)
    ids = torch.rand((num_tokens, num_experts), generator=g).argsort(dim=1)[:, :k].to(torch.int32)
    weights = torch.rand((num_tokens, k), generator=g)
    y = moe_layer(x, ids, weights, info.group, num_experts, max_tokens_per_rank=8)
    # oracle: expert e's bf16 output x * (e + 1), weighted in fp32 over slots ascending, one cast
    per_slot = (x.float()[:, None] * (ids[:, :, None] + 1)).to(torch.bfloat16).float() * weights[:, :, None]
    expected = torch.zeros((num_tokens, hidden))
    for slot in range(k):
        expected += per_slot[:, slot]
    # the two-stage ops through torch_npu's names and the stand-in's communicator name give the same result
    import torch_npu

    name, w, bs = sim.hccl_comm_name(info.group), info.world_size, 8 * info.world_size
    common = dict(group_ep=name, ep_world_size=w, ep_rank_id=info.rank, moe_expert_num=num_experts, global_bs=bs)
    y_rows, expand_idx, cmd = torch_npu.npu_moe_distribute_dispatch_setup(x, ids, **common)
    expand_x, _, assist, token_nums = torch_npu.npu_moe_distribute_dispatch_teardown(x, y_rows, ids, cmd, **common)
    expert_out, start = torch.zeros_like(expand_x), 0
    for local, count in enumerate(token_nums.tolist()):
        expert_out[start : start + count] = expand_x[start : start + count] * (info.rank * num_experts // w + local + 1)
        start += count
    quant_x, cmd = torch_npu.npu_moe_distribute_combine_setup(expert_out, ids, assist, **common)
    y2 = torch_npu.npu_moe_distribute_combine_teardown(expert_out, quant_x, ids, expand_idx, weights, cmd, **common)
    dist.barrier()
    return torch.equal(y, expected.to(torch.bfloat16)) and y.dtype == torch.bfloat16 and torch.equal(y2, y)


def test_readme_example_matches_oracle():
    """examples/sim_torch_npu.py's torch_npu-style function on 4 gloo ranks (one with no tokens) equals the oracle,
    and so do torch_npu's two-stage ops called by name on the stand-in."""
    assert parallel_launch(4, _example, timeout=60) == [True] * 4
