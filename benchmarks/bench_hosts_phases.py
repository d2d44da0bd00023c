"""Where a call's time goes on simulated hosts: the phases of the default transport (2 hosts: spanning) and of the
collective one, on one host and on ``--hosts`` simulated hosts (:mod:`tests.support.hosts`, root), µs per call, mean
over the ranks. The phases are timed by wrapping the transports' methods (this process only; the library is unchanged):
``send`` (the engine's send phase, with the agreement issue and the window write), ``agree issue`` / ``agree wait``
(the header all-to-all; on gloo the one all-to-all of headers and rows), ``payload issue`` / ``payload wait`` (the
rows' all-to-all, when it is a second round), ``win write`` / ``win wait`` /
``win release`` (the window's rows and header, the wait for its peers' headers, the "read" messages) and ``place``
(the engine's placement / reduction). Dispatch and combine of both transports run interleaved, barrier-aligned.

    python -m benchmarks.bench_hosts_phases --num-tokens 128 --iters 60
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

COLUMNS = ("total", "send", "agree issue", "agree wait", "payload issue", "payload wait", "win write", "win wait",
           "win release", "place")  # fmt: skip


def _timed(cls: type, name: str, label: Callable[..., str], spent: dict, current: list) -> None:
    """Add the time of ``cls.name`` calls made while ``current[0]`` names an (impl, op) to ``spent``."""
    orig = getattr(cls, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        if current[0] is None:
            return orig(*args, **kwargs)
        t0 = time.perf_counter()
        try:
            return orig(*args, **kwargs)
        finally:
            spent[current[0], label(*args, **kwargs)] += time.perf_counter() - t0

    setattr(cls, name, timed)


def _rank(info: Any, cfg: dict) -> dict:
    from benchmarks.bench_hosts import _inputs, _ops
    from deep_ep_npu import Buffer, profiling
    from deep_ep_npu.transports import early, group, window

    torch.set_num_threads(1)
    spent: dict = defaultdict(float)
    current: list = [None]
    kind = lambda what: lambda _, __, op: f"payload {what}" if op == early.PAYLOAD else f"agree {what}"  # noqa: E731
    _timed(group.EPGroup, "start", kind("issue"), spent, current)
    _timed(group.EPGroup, "wait", kind("wait"), spent, current)
    for name, label in (("write", "win write"), ("wait_headers", "win wait"), ("release", "win release")):
        _timed(window.Window, name, lambda *_, label=label: label, spent, current)

    def add(prefix: str, **seconds: float) -> None:  # the engine's sections: send, wait, place
        for name, value in seconds.items():
            if current[0] is not None:
                spent[current[0], name] += value

    profiling.add = add  # (this rank's process only)
    x, idx, w = _inputs(info.rank, cfg)
    ours = Buffer(info.group, explicitly_destroy=True)
    coll = Buffer(info.group, explicitly_destroy=True, transport="collective")
    impls = {ours._backend.transport.name: ours, "collective": coll}
    fns = {}
    for impl, buf in impls.items():
        fns[impl, "dispatch"], fns[impl, "combine"] = _ops(buf, x, idx, w, cfg)
    profiling.enable()
    for i in range(cfg["warmup"] + cfg["iters"]):
        for key, fn in fns.items():
            dist.barrier(group=info.group)
            current[0] = key if i >= cfg["warmup"] else None
            t0 = time.perf_counter()
            fn()
            if current[0] is not None:
                spent[key, "total"] += time.perf_counter() - t0
            current[0] = None
    profiling.disable()
    for buf in (coll, ours):
        buf.destroy()
    return {key: seconds / cfg["iters"] * 1e6 for key, seconds in spent.items()}


def _show(title: str, results: list[dict]) -> None:
    print(f"== {title}: µs per call, mean over {len(results)} ranks")
    print(f"{'':22s}" + "".join(f"{c:>14s}" for c in COLUMNS))
    for impl, op in sorted({key[0] for result in results for key in result}):
        means = [sum(result.get(((impl, op), c), 0.0) for result in results) / len(results) for c in COLUMNS]
        print(f"{op + ', ' + impl:22s}" + "".join(f"{v:14.0f}" for v in means))


def main() -> None:
    from benchmarks.bench_hosts_phases import _rank  # (by module name: the ranks import it)
    from tests.support import hosts
    from tests.support.distributed import parallel_launch

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--num-processes", type=int, default=2, help="ranks per host")
    p.add_argument("--num-tokens", type=int, default=128)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--num-topk", type=int, default=8)
    p.add_argument("--num-experts", type=int, default=32)
    p.add_argument("--quant", choices=["none", "fp8"], default="none")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=60)
    args = p.parse_args()
    if why := hosts.unavailable():
        raise SystemExit(why)
    cfg = {k: getattr(args, k) for k in ("num_tokens", "hidden", "num_topk", "num_experts", "quant", "warmup", "iters")}
    world = args.hosts * args.num_processes
    _show(f"one host, {world} ranks", parallel_launch(world, _rank, cfg, timeout=900, pg_timeout=300))
    sim = hosts.SimulatedHosts(args.hosts)
    try:
        results = hosts.launch(sim, args.num_processes, _rank, cfg, timeout=900, pg_timeout=300)
    finally:
        sim.close()
    _show(f"{args.hosts} simulated hosts x {args.num_processes} ranks", results)


if __name__ == "__main__":
    main()
