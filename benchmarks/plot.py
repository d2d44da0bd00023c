"""Latency plots for bench_low_latency.py sweeps (matplotlib, Agg backend)."""

from __future__ import annotations


def plot_latency(records: list[dict], sweep: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = {"tokens": "num_tokens", "ep": "num_processes"}.get(sweep)
    if key is None:
        raise ValueError("--plot needs --sweep tokens or --sweep ep")
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=False)
    for ax, op in zip(axes, ("dispatch", "combine"), strict=True):
        for impl in ("ours", "ours_collective", "memcpy_floor", "a2a_floor", "allgather_rs"):
            pts = sorted((r[key], r["latency_us"]["median"]) for r in records if r["op"] == op and r["impl"] == impl)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
        ax.set_title(op)
        ax.set_xlabel("tokens per rank" if key == "num_tokens" else "EP size (ranks)")
        ax.set_ylabel("median latency (µs)")
        if key == "num_tokens":
            ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend()
    cfg = records[0]
    fig.suptitle(f"gloo CPU, hidden {cfg['hidden']}, top-{cfg['num_topk']} of {cfg['num_experts']}, {cfg['dtype']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
