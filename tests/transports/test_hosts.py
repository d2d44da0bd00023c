"""A group across simulated hosts (issue 28; :mod:`tests.support.hosts`): 2 hosts x 2 ranks, each host a network
namespace with its own address and a private ``/dev/shm``.

- Host identity: the ranks of one host see one identity, the two hosts two; the Buffer's "auto" transport is the
  spanning one (window within a host, torch.distributed across) and "shm" is refused naming the hosts.
- Buffer dispatch / combine (bf16, fp8), the flat (Ascend) layout and the ``_v2`` ops give, bit for bit, what the
  same calls give on one host (4 ranks: the window) and with the collective transport across the hosts.
- Teardown leaves no namespace, link or ``/dev/shm`` file (:meth:`SimulatedHosts.close` asserts it).
"""

from __future__ import annotations

import pytest
import torch

from tests.support import hosts
from tests.support.distributed import parallel_launch
from tests.transports.test_transport import N
from tests.transports.test_transport import _inputs as transport_inputs

EXPERTS, LATE_S = 8, 1.0

pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(why := hosts.unavailable()), reason=why or "-")]


@pytest.fixture(scope="module")
def two_hosts():
    sim = hosts.SimulatedHosts(2)
    try:
        yield sim
    finally:
        sim.close()  # asserts that nothing is left


def _inputs(rank: int, step: int):
    return transport_inputs(rank, step, EXPERTS)


def _calls(info, transport: str):
    """Buffer (bf16, fp8), flat (no quant, int8) and ``_v2`` calls; every result tensor, and the transport used."""
    from deep_ep_npu import Buffer
    from deep_ep_npu.ops import moe_distribute_combine_v2, moe_distribute_dispatch_v2
    from deep_ep_npu.transports.hosts import host_identity

    buf = Buffer(info.group, transport=transport, timeout=20, explicitly_destroy=True)
    got = []
    for step in range(2):
        x, idx, w = _inputs(info.rank, step)
        for fp8 in (False, True):
            recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, N, EXPERTS, use_fp8=fp8)
            data = recv_x if not fp8 else recv_x[0].float() * recv_x[1].repeat_interleave(128, -1)
            out, _, _ = buf.low_latency_combine((data.float() * 1.5).to(torch.bfloat16), idx, w, handle)
            raw = recv_x if not fp8 else recv_x[0].view(torch.uint8)  # rows past the counts are undefined
            got += [count.clone(), out.clone()] + [raw[i, : int(c)].clone() for i, c in enumerate(count)]
        for quant_mode in (0, 2):
            flat, _, _ = buf.low_latency_dispatch_flat(x, idx, N, EXPERTS, topk_weights=w, quant_mode=quant_mode)
            rows = int(flat.expert_token_nums.sum())
            y = (flat.expand_x.float() * 0.5).to(torch.bfloat16)
            out, _, _ = buf.low_latency_combine_flat(y, idx, w, flat.handle, shared_expert_x=x)
            got += [flat.expert_token_nums.clone(), flat.expand_x[:rows].clone(), out.clone()]
        args = (info.group, info.world_size, info.rank, EXPERTS)
        idx = torch.where(idx < 0, (idx.max(1, keepdim=True).values + 1) % EXPERTS, idx)  # (the ops take no -1)
        outs = moe_distribute_dispatch_v2(x, idx, *args, quant_mode=2, expert_scales=w, global_bs=N * 4)
        expand_x, dyn, assist, token_nums, recv_counts, _, expand_scales = outs
        y = (expand_x.float() * dyn.unsqueeze(1)).to(torch.bfloat16)
        combined = moe_distribute_combine_v2(
            y, idx, assist, recv_counts, w, *args, expand_scales=expand_scales, global_bs=N * 4
        )
        got += [t.clone() for t in outs if isinstance(t, torch.Tensor)] + [combined]
    transport_used = buf._backend.transport
    name, window_calls = transport_used.name, getattr(getattr(transport_used, "window", None), "seq", 0)
    buf.destroy()
    return host_identity(), (name, window_calls), got


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_two_hosts_bit_identical_to_one_host(two_hosts):
    spanning = hosts.launch(two_hosts, 2, _calls, "auto", timeout=90)
    collective = hosts.launch(two_hosts, 2, _calls, "collective", timeout=90)
    one_host = parallel_launch(4, _calls, "auto", timeout=90)
    identities = [ident for ident, _, _ in spanning]
    assert identities[0] == identities[1] and identities[2] == identities[3] and identities[0] != identities[2]
    assert [name for _, name, _ in spanning] == [("spanning", 16)] * 4  # 16 calls, each through the window too
    assert [name[0] for _, name, _ in one_host] == ["shm"] * 4
    for rank in range(4):
        assert _same(spanning[rank][2], one_host[rank][2]), f"rank {rank}: two hosts differ from one host"
        assert _same(spanning[rank][2], collective[rank][2]), f"rank {rank}: spanning differs from collective"


def _shm_refused(info):
    from deep_ep_npu import Buffer

    try:
        Buffer(info.group, transport="shm")
    except ValueError as err:
        return str(err)
    return ""


def test_shm_transport_refused_across_hosts(two_hosts):
    errors = hosts.launch(two_hosts, 2, _shm_refused, timeout=60)
    assert all("every rank on one host" in e and "[[0, 1], [2, 3]]" in e for e in errors), errors


def _late_peer(info):
    """Rank 3 (host 1) sleeps before each call; the other ranks' send phases (hook mode) return before it wakes."""
    import time

    import torch.distributed as dist

    from deep_ep_npu import Buffer

    buf = Buffer(info.group, timeout=20, explicitly_destroy=True)
    x, idx, w = _inputs(info.rank, 0)
    recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, N, EXPERTS, use_fp8=False)  # warm-up
    buf.low_latency_combine(recv_x, idx, w, handle)
    dist.barrier(group=info.group)
    sends = []
    for _ in range(2):
        if info.rank == 3:
            time.sleep(LATE_S)
        t0 = time.monotonic()
        recv_x, _, handle, _, hook = buf.low_latency_dispatch(x, idx, N, EXPERTS, use_fp8=False, return_recv_hook=True)
        sends.append(time.monotonic() - t0)
        hook()
        if info.rank == 3:
            time.sleep(LATE_S)
        t0 = time.monotonic()
        _, _, hook = buf.low_latency_combine(recv_x, idx, w, handle, return_recv_hook=True)
        sends.append(time.monotonic() - t0)
        hook()
    name = buf._backend.transport.name
    buf.destroy()
    return name, sends


def test_send_phase_waits_for_no_peer_across_hosts(two_hosts):
    results = hosts.launch(two_hosts, 2, _late_peer, timeout=90)
    for rank, (name, sends) in enumerate(results[:3]):
        assert name == "spanning" and max(sends) < LATE_S / 4, (rank, name, sends)


def _one_dies(info, transport: str = "auto"):
    """Rank 3 (host 1, rank 2's window peer) dies before step 1; the survivors find it missing, mask it and keep
    computing the oracle's results (:mod:`tests.support.shrink`'s experts and oracle)."""
    import os

    import torch.distributed as dist

    from deep_ep_npu import Buffer
    from tests.support import shrink
    from tests.support.distributed import leave_together

    buf = Buffer(info.group, enable_shrink=True, timeout=shrink.TIMEOUT, explicitly_destroy=True, transport=transport)
    name, masks, masked = buf._backend.transport.name, [], set()
    for step in range(3):
        if step == 1 and info.rank == 3:
            os._exit(0)  # (a host's process dies: no goodbye)
        masked |= {3} if step >= 1 else set()
        shrink.check(info.rank, step, masked, *shrink.run_step(buf, info.rank, step))
        masks.append(shrink.masked_ranks(buf))
    leave_together(dist.distributed_c10d._get_default_store(), info.rank, shrink.W - 1)
    buf.destroy()
    return name, masks


def test_shrink_across_three_hosts():
    """3 simulated hosts x 2 ranks, shrink mode: rank 3 dies; every survivor (its window peer on host 1 included)
    raises nothing, masks it and computes the oracle's results."""
    sim = hosts.SimulatedHosts(3)
    try:
        results = hosts.launch(sim, 2, _one_dies, timeout=120, allow_exit=(3,))
    finally:
        sim.close()
    for rank in (0, 1, 2, 4, 5):
        assert results[rank] == ("spanning", [[], [3], [3]]), (rank, results[rank])
