"""The Buffer's transports (issue 18): the shared-memory window (``"shm"``) and torch.distributed (``"collective"``).

- The send phase of both never waits for a peer: with ``return_recv_hook=True`` a call returns while a peer is still
  asleep before its own call (only ``hook()`` waits).
- Both give bit-identical results (same rows, same fp32 reduction order).
- A rank killed inside a dispatch leaves no shared-memory file behind once the survivors raised and exited (the
  window is a memfd: it has no name anywhere), while the window was really mapped during the run.
- The choice: ``"auto"`` is shm for a gloo group on one host; the option and ``DEEP_EP_NPU_TRANSPORT`` force one.
"""

from __future__ import annotations

import contextlib
import os
import time

import pytest
import torch
import torch.distributed as dist

from deep_ep_npu import Buffer, EPRankFailure
from deep_ep_npu import kernels as cpu_kernels
from tests.support.distributed import parallel_launch
from tests.support.tokens import routed_tokens

N, HIDDEN, TOPK, EXPERTS, LATE_S = 8, 256, 3, 12, 1.0


def _inputs(rank: int, step: int, experts: int = EXPERTS):
    """Rank ``rank``'s tokens (N - rank of them, bf16), top-k ids (one -1) and weights of call ``step``."""
    g = torch.Generator().manual_seed(100 * step + rank)
    x, idx, weights = routed_tokens(g, N - rank, HIDDEN, TOPK, experts, scale=3)
    idx[0, 1] = -1
    return x, idx, weights


def _late_peer(info):
    """Rank 1 sleeps before each of its calls; rank 0's send phases (hook mode) return long before it wakes."""
    sends = {}
    for transport in ("shm", "collective"):
        buf = Buffer(info.group, transport=transport, timeout=20)
        x, idx, w = _inputs(info.rank, 0)
        recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, N, EXPERTS, use_fp8=False)  # warm-up round
        buf.low_latency_combine(recv_x, idx, w, handle)
        dist.barrier(group=info.group)
        if info.rank == 1:
            time.sleep(LATE_S)
        t0 = time.monotonic()
        recv_x, _, handle, _, hook = buf.low_latency_dispatch(x, idx, N, EXPERTS, use_fp8=False, return_recv_hook=True)
        dispatch_send = time.monotonic() - t0
        hook()
        if info.rank == 1:
            time.sleep(LATE_S)
        t0 = time.monotonic()
        out, _, hook = buf.low_latency_combine(recv_x, idx, w, handle, return_recv_hook=True)
        combine_send = time.monotonic() - t0
        hook()
        sends[transport] = (dispatch_send, combine_send)
    return sends


def test_send_phase_returns_while_a_peer_has_not_called():
    sends = parallel_launch(2, _late_peer, timeout=90)[0]
    for transport, (dispatch_send, combine_send) in sends.items():
        assert dispatch_send < LATE_S / 4 and combine_send < LATE_S / 4, (transport, sends)


def _parity(info):
    """The same calls (masked and flat layouts, MegaMoE) on both transports, and on the shm one with the torch code
    instead of the CPU kernels; every result tensor compared bit for bit."""
    results = {}
    for transport in ("shm", "collective", "torch"):
        buf = Buffer(info.group, transport="shm" if transport == "torch" else transport)
        assert buf._backend.transport.name == ("shm" if transport == "torch" else transport)
        kernels = cpu_kernels.disabled() if transport == "torch" else contextlib.nullcontext()
        got = []
        with kernels:
            for step in range(3):
                x, idx, w = _inputs(info.rank, step)
                for fp8 in (False, True):
                    recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, N, EXPERTS, use_fp8=fp8)
                    data = recv_x if not fp8 else recv_x[0].float() * recv_x[1].repeat_interleave(128, -1)
                    y = (data.float() * 1.5).to(torch.bfloat16)
                    out, _, _ = buf.low_latency_combine(y, idx, w, handle)
                    out32, _, _ = buf.low_latency_combine(data.float() / 3, idx, w, handle)  # fp32: every rounding
                    data = recv_x if not fp8 else recv_x[0].view(torch.uint8)  # rows past the counts are undefined
                    scales = () if not fp8 else (recv_x[1],)
                    valid = [
                        t[i, : int(c)].clone() for i, c in enumerate(count) for t in (data, handle.src_info, *scales)
                    ]
                    got.append((count.clone(), handle.layout_range.clone(), out.clone(), [out32.clone(), *valid]))
                window = buf._backend.window
                calls = None if window is None else window.seq
                for quant_mode in (0, 2):  # the flat (Ascend) layout: the same rows through the same window
                    flat, _, _ = buf.low_latency_dispatch_flat(
                        x, idx, N, EXPERTS, topk_weights=w, quant_mode=quant_mode
                    )
                    rows = int(flat.expert_token_nums.sum())
                    y = (flat.expand_x.float() * 0.5).to(torch.bfloat16)
                    out, _, _ = buf.low_latency_combine_flat(y, idx, w, flat.handle, shared_expert_x=x)
                    h = flat.handle
                    meta = [h.ep_recv_counts.clone(), h.expand_scales[:rows].clone(), h.assist_info_for_combine.clone()]
                    scales = [flat.dynamic_scales[:rows].clone()] if quant_mode else []
                    got.append(
                        (flat.expert_token_nums.clone(), flat.expand_x[:rows].clone(), out.clone(), meta + scales)
                    )
                assert window is None or window.seq == calls + 4, "the flat calls go over the window"
                g = torch.Generator().manual_seed(7 + step)  # MegaMoE: 2 segments = 4 calls on the same transport
                w1 = torch.randn((EXPERTS // info.world_size, HIDDEN, 64), generator=g).to(torch.bfloat16) / 16
                w2 = torch.randn((EXPERTS // info.world_size, 32, HIDDEN), generator=g).to(torch.bfloat16) / 8
                mega = buf.mega_moe(
                    x, idx, w, w1, w2, num_max_dispatch_tokens_per_rank=N, num_experts=EXPERTS, num_segments=2
                )
                got.append((mega.clone(), mega.float().abs().sum().reshape(1), mega.clone(), []))
                assert window is None or window.seq == calls + 8, "MegaMoE goes over the window"
        results[transport] = got

    def same(a: str, b: str) -> bool:
        return all(
            all(torch.equal(x, y) for x, y in zip(ra[:3], rb[:3], strict=True))
            and all(torch.equal(x, y) for x, y in zip(ra[3], rb[3], strict=True))
            for ra, rb in zip(results[a], results[b], strict=True)
        )

    return same("shm", "collective"), same("shm", "torch"), bool(results["shm"][0][2].abs().sum() > 0)


def test_transports_are_bit_identical():
    """(The CPU kernels are built here: the third run compares them with the torch code.)"""
    assert cpu_kernels.unavailable() == ""
    assert parallel_launch(3, _parity, timeout=90) == [(True, True, True)] * 3


def _window_files() -> set[str]:
    """Files in /dev/shm, less multiprocessing's semaphores (the launcher's queues, other processes' on the host)."""
    names = os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []
    return {n for n in names if not n.startswith("sem.mp-")}


def _crash(info):
    """Rank 2 dies inside a dispatch, after writing rows into its peers' windows; the survivors raise."""
    from deep_ep_npu.transports.window import Window as ShmWindow

    buf = Buffer(info.group, transport="shm", timeout=5)
    x, idx, w = _inputs(info.rank, 0)
    recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, N, EXPERTS, use_fp8=False)
    buf.low_latency_combine(recv_x, idx, w, handle)
    with open("/proc/self/maps") as f:
        mapped = sum("memfd:deep_ep_npu.window" in line for line in f)
    if info.rank == 2:
        post = ShmWindow.post

        def die_mid_dispatch(self, call, dest, words):
            post(self, call, dest, words)  # the first peer got its signal, the other did not
            os._exit(1)

        ShmWindow.post = die_mid_dispatch
    t0 = time.monotonic()
    for _ in range(2):  # a peer that got rank 2's signal completes this dispatch and finds it gone at the next
        try:
            buf.low_latency_dispatch(x, idx, N, EXPERTS, use_fp8=False)
        except EPRankFailure as err:
            return mapped, err.missing_ranks, time.monotonic() - t0
    return mapped, None, time.monotonic() - t0


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux")
def test_a_crash_leaves_no_shared_segment():
    before = _window_files()
    results = parallel_launch(3, _crash, timeout=60, allow_exit=(2,))
    assert _window_files() == before  # nothing named in /dev/shm, during or after the run
    for rank in (0, 1):
        mapped, missing, elapsed = results[rank]
        assert mapped == 3, mapped  # its own window and both peers' were mapped: the window was real
        assert missing == (2,), results  # the same ranks on every survivor
        assert elapsed < 4.0, elapsed  # an exit is seen at once (closed pipe) plus the agreement's grace (1 s)


def _choice(info):
    auto = Buffer(info.group)._backend.transport.name
    os.environ["DEEP_EP_NPU_TRANSPORT"] = "collective"
    env = Buffer(info.group)._backend.transport.name
    forced = Buffer(info.group, transport="shm")._backend.transport.name
    del os.environ["DEEP_EP_NPU_TRANSPORT"]
    return auto, env, forced


def test_auto_picks_shm_on_one_host_and_the_option_or_env_forces():
    assert parallel_launch(2, _choice, timeout=60) == [("shm", "collective", "shm")] * 2
    with pytest.raises(ValueError, match=r"transport: must be one of \['auto', 'shm', 'collective'\], got 'nvshmem'"):
        Buffer(object(), transport="nvshmem")


def _small_window(info):
    """A window too small for one rank's rows: that rank names ``num_rdma_bytes``, its peer learns of the rejection
    from the signal (no hang), and the next call that fits works."""
    from deep_ep_npu import MoeDistributeError
    from deep_ep_npu.transports import window

    window.DEFAULT_WINDOW_BYTES = 4096 + (64 << 10)  # 16 KiB per (half, source): 31 rows of 528 bytes
    buf = Buffer(info.group, transport="shm", timeout=10)
    g = torch.Generator().manual_seed(info.rank)
    n = 64 if info.rank == 1 else 0
    x, idx = torch.randn((n, HIDDEN), generator=g).to(torch.bfloat16), torch.zeros((n, TOPK), dtype=torch.int64)
    idx[:, 1:] = -1  # every token to expert 0 on rank 0: 64 rows for rank 0
    try:
        buf.low_latency_dispatch(x, idx, 64, EXPERTS, use_fp8=False)
        text = "no error"
    except MoeDistributeError as err:
        text = str(err)
    x, idx, w = _inputs(info.rank, 1)
    recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, N, EXPERTS, use_fp8=False)
    out, _, _ = buf.low_latency_combine(recv_x, idx, w, handle)
    want = (x.float() * w.masked_fill(idx < 0, 0).sum(dim=1, keepdim=True)).to(torch.bfloat16)
    return text, torch.allclose(out.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_a_window_too_small_is_an_error_on_every_rank():
    (peer, ok0), (own, ok1) = parallel_launch(2, _small_window, timeout=60)
    need = 4096 + 2 * 2 * 64 * 528  # two halves x two sources x 64 rows of 528 bytes
    assert "num_rdma_bytes: low_latency_dispatch sends 64 rows of 528 bytes to rank 0" in own and ok1, own
    assert f"num_rdma_bytes >= {need}" in own, own
    assert "rejected on rank 1" in peer and ok0, peer


def _crossed_hooks(info):
    """Two dispatches and two combines in flight; rank 0 receives them in call order, rank 1 in reverse. Every
    result equals the same call made alone (the collective transport starts deferred payloads in call order)."""
    same = []
    for transport in ("shm", "collective"):
        buf = Buffer(info.group, transport=transport, timeout=10)
        batches = [_inputs(info.rank, step) for step in (3, 4)]
        alone = []
        for x, idx, w in batches:
            recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, N, EXPERTS, use_fp8=False)
            out, _, _ = buf.low_latency_combine(recv_x, idx, w, handle)
            alone.append((count.clone(), out.clone()))
        order = [0, 1] if info.rank == 0 else [1, 0]
        sent = [
            buf.low_latency_dispatch(x, idx, N, EXPERTS, use_fp8=False, return_recv_hook=True) for x, idx, _ in batches
        ]
        for b in order:
            sent[b][4]()
        counts = [s[1].clone() for s in sent]
        combines = [
            buf.low_latency_combine(s[0], idx, w, s[2], return_recv_hook=True)
            for s, (_, idx, w) in zip(sent, batches, strict=True)
        ]
        for b in order:
            combines[b][2]()
        same.append(
            all(torch.equal(counts[b], alone[b][0]) and torch.equal(combines[b][0], alone[b][1]) for b in (0, 1))
        )
    return same


def test_receives_in_another_order_on_each_rank():
    assert parallel_launch(2, _crossed_hooks, timeout=60) == [[True, True]] * 2


def _unreachable(info):
    """Rank 1 binds its socket under a name its peer does not look for (as a rank on another host): its own sends
    reach rank 0, rank 0's do not reach it. Every rank falls back to the collective transport at once under "auto"
    (rank 1 does not wait for a message that cannot come), and "shm" is refused on every rank."""
    from deep_ep_npu.transports import window_setup

    if info.rank == 1:
        address, calls = window_setup._address, []

        def bind_elsewhere(token: int) -> bytes:  # the first call names the socket to bind
            calls.append(token)
            return f"\0elsewhere.{token:x}".encode() if len(calls) % 2 == 1 else address(token)

        window_setup._address = bind_elsewhere
    t0 = time.monotonic()
    auto = Buffer(info.group, timeout=20)
    name, elapsed = auto._backend.transport.name, time.monotonic() - t0
    x, idx, w = _inputs(info.rank, 0)
    recv_x, _, handle, _, _ = auto.low_latency_dispatch(x, idx, N, EXPERTS, use_fp8=False)
    out, _, _ = auto.low_latency_combine(recv_x, idx, w, handle)
    want = (x.float() * w.masked_fill(idx < 0, 0).sum(dim=1, keepdim=True)).to(torch.bfloat16)
    try:
        Buffer(info.group, transport="shm", timeout=20)
        refused = ""
    except ValueError as err:
        refused = str(err)
    return name, elapsed, torch.allclose(out.float(), want.float(), rtol=2e-2, atol=2e-2), refused


def test_ranks_that_cannot_share_memory_fall_back_at_once():
    for name, elapsed, ok, refused in parallel_launch(2, _unreachable, timeout=60):
        assert name == "collective" and ok and elapsed < 5.0, (name, elapsed)
        assert "transport: 'shm' needs every rank on one host" in refused and "ranks [0, 1] cannot" in refused
