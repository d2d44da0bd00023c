"""``bench_low_latency.py --hosts H``: the spanning transport on ``H`` simulated hosts (:mod:`tests.support.hosts`:
network namespaces joined by veths, each with a private ``/dev/shm``) against the same calls on one host, in the same
run.

Each of the two launches (``H * P`` ranks, ``P = --num-processes``; first on this host, then ``P`` ranks on each of
the ``H`` simulated hosts) times, interleaved: dispatch and combine on the default transport (one host: the window;
``H`` hosts: spanning, the window for the ``P - 1`` peers of a rank's host and gloo for the others) and on the
collective transport; and, on a Buffer of each host's ``P`` ranks alone (the window; the hosts' Buffers at once),
the intra-host pairs.

Reported: ``r`` = window / collective on one host (median of same-iteration ratios); on the hosts, spanning /
collective against its ideal ``(W - P) / (W - 1) + r (P - 1) / (W - 1)`` (each rank's ``W - 1`` peers: ``P - 1`` at
window speed; 2 x 2: ``2/3 + r/3``) for dispatch, combine and the whole op (dispatch + combine); and the intra-host
Buffer's time on the simulated hosts / on one host (1.0: the window's speed).

Also timed in both launches, to show what the ideal assumes: gloo alone moving the payload of one dispatch + combine
(``all_to_all_single`` of the bytes per destination that ``ours`` moved last) without the ``P - 1`` peers of a
rank's host, over the same with them ("gloo far / all"): the part of gloo's time the window can take over is
``1 - far / all``; the ideal takes it as ``(P - 1) / (W - 1)``.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.baselines import A2AFloor
from benchmarks.timing import time_interleaved


def _inputs(rank: int, cfg: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1234 + rank)
    x = (torch.randn(cfg["num_tokens"], cfg["hidden"], generator=gen) * 0.1).to(torch.bfloat16)
    scores = torch.randn(cfg["num_tokens"], cfg["num_experts"], generator=gen).abs() + 1
    idx = torch.topk(scores, cfg["num_topk"], dim=-1).indices
    return x, idx, torch.rand(idx.shape, generator=gen)


def _ops(buf: Any, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, cfg: dict) -> list:
    """Dispatch and combine of ``buf`` (the combine's input: its own tensor, as in DeepEP's test)."""
    n, e, fp8 = cfg["num_tokens"], cfg["num_experts"], cfg["quant"] == "fp8"
    recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, n, e, use_fp8=False)
    expert_out = recv_x.to(torch.bfloat16, copy=True)
    return [
        lambda: buf.low_latency_dispatch(x, idx, n, e, use_fp8=fp8),
        lambda: buf.low_latency_combine(expert_out, idx, w, handle),
    ]


def _gloo(buf: Any, ops: list, group: dist.ProcessGroup, skip: list[int]) -> Any:
    """gloo alone moving the payload of ``buf``'s last dispatch + combine (run ``ops`` once first) to every rank but
    those of ``skip``."""
    from deep_ep_npu import profiling

    for op in ops:
        op()
    stats = profiling.wire_stats(buf)
    floors = [A2AFloor([0 if r in skip else b for r, b in enumerate(stats[f"{op}_send_bytes"])], group)
              for op in ("dispatch", "combine")]  # fmt: skip
    return lambda: [floor() for floor in floors]


def _rank(info: Any, cfg: dict, per_host: int) -> dict:
    from deep_ep_npu import Buffer

    torch.set_num_threads(1)
    x, idx, w = _inputs(info.rank, cfg)
    hosts = [list(range(h, h + per_host)) for h in range(0, info.world_size, per_host)]
    groups = [dist.new_group(ranks) for ranks in hosts]  # (every rank makes every group)
    mine = groups[info.rank // per_host]
    ours = Buffer(info.group, explicitly_destroy=True)
    coll = Buffer(info.group, explicitly_destroy=True, transport="collective")
    pair = Buffer(mine, explicitly_destroy=True)
    fns = _ops(ours, x, idx, w, cfg) + _ops(coll, x, idx, w, cfg) + _ops(pair, x, idx, w, cfg)
    host = hosts[info.rank // per_host]
    fns += [_gloo(ours, fns[:2], info.group, skip) for skip in ([info.rank], host)]
    us = time_interleaved(fns, info.group, cfg["warmup"], cfg["iters"])  # (each host's pair at once)
    names = (ours._backend.transport.name, pair._backend.transport.name)
    for buf in (pair, coll, ours):
        buf.destroy()
    return {"transports": names, "ours": us[:2], "collective": us[2:4], "pair": us[4:6], "gloo": us[6:]}


def _paired(a: list[float], b: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def _whole(times: list[list[float]]) -> list[float]:
    return [d + c for d, c in zip(*times, strict=True)]


def run_hosts(args: Any) -> dict:
    """Both launches and the comparison (see the module docstring); prints it and returns it as one record."""
    from tests.support import hosts
    from tests.support.distributed import parallel_launch

    if why := hosts.unavailable():
        raise SystemExit(f"--hosts: {why}")
    per, num_hosts = args.num_processes, args.hosts
    world = per * num_hosts
    keys = ("num_tokens", "hidden", "num_topk", "num_experts", "quant", "warmup", "iters")
    cfg = {k: getattr(args, k) for k in keys}
    one = parallel_launch(world, _rank, cfg, per, timeout=900, pg_timeout=300)[0]
    sim = hosts.SimulatedHosts(num_hosts)
    try:
        many = hosts.launch(sim, per, _rank, cfg, per, timeout=900, pg_timeout=300)[0]
    finally:
        sim.close()
    ideal_share = (world - per) / (world - 1)
    record: dict = {
        "op": "hosts",
        "hosts": num_hosts,
        "ranks_per_host": per,
        **cfg,
        "transports": {"one_host": one["transports"], "hosts": many["transports"]},
    }
    rows = []
    for i, op in enumerate(("dispatch", "combine", "whole")):
        pick = (lambda t, i=i: t[i]) if op != "whole" else _whole
        r = _paired(pick(one["ours"]), pick(one["collective"]))
        ratio = _paired(pick(many["ours"]), pick(many["collective"]))
        ideal = ideal_share + r * (1 - ideal_share)
        pair = statistics.median(pick(many["pair"])) / statistics.median(pick(one["pair"]))
        rows.append(
            {
                "op": op,
                "r_one_host": r,
                "spanning_over_collective": ratio,
                "ideal": ideal,
                "off_ideal": ratio - ideal,
                "pair_hosts_over_one_host": pair,
                "median_us": {k: statistics.median(pick(many[k])) for k in ("ours", "collective", "pair")},
                "one_host_median_us": {k: statistics.median(pick(one[k])) for k in ("ours", "collective", "pair")},
            }
        )
    record["rows"] = rows
    record["gloo_far_over_all"] = {k: _paired(*run["gloo"][::-1]) for k, run in (("hosts", many), ("one_host", one))}
    gloo_all, gloo_far = (statistics.median(t) for t in many["gloo"])
    record["gloo_median_us"] = {"all": gloo_all, "far": gloo_far}
    print(
        f"{num_hosts} simulated hosts x {per} ranks, tokens={cfg['num_tokens']} hidden={cfg['hidden']} "
        f"topk={cfg['num_topk']} experts={cfg['num_experts']} quant={cfg['quant']}; transports {record['transports']}"
    )
    print(
        f"{'op':9s} {'r (1 host)':>10s} {'span/coll':>10s} {'ideal':>7s} {'off':>7s} {'pair hosts/1':>12s} "
        f"{'span us':>9s} {'coll us':>9s}"
    )
    for row in rows:
        med = row["median_us"]
        print(
            f"{row['op']:9s} {row['r_one_host']:10.3f} {row['spanning_over_collective']:10.3f} {row['ideal']:7.3f} "
            f"{row['off_ideal']:+7.3f} {row['pair_hosts_over_one_host']:12.3f} {med['ours']:9.0f} "
            f"{med['collective']:9.0f}"
        )
    far = record["gloo_far_over_all"]
    print(f"gloo far / all (the payload without the host's peers / with): hosts {far['hosts']:.3f} ({gloo_far:.0f} / "
          f"{gloo_all:.0f} us), one host {far['one_host']:.3f}; the ideal takes {ideal_share:.3f}")  # fmt: skip
    return record
