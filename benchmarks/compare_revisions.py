"""Before / after in the same run: one benchmark script of two source trees, alternated round by round.

Runs ``benchmarks/<script>`` of the base tree and of this tree (each importing its own ``deep_ep_npu``)
``--rounds`` times in turn (base, this, base, this, ...), so that load drifting over the run hits both, and prints
per row (``bench_low_latency.py``: each op of ``ours*`` / ``elastic*``; ``bench_mega_moe.py``: each EP and timing)
both trees' median time over the rounds and the median of the per-round ratios this / base (> 1: slower now)::

    git worktree add --detach /tmp/base <revision>
    (cd /tmp/base && .venv/bin/python setup.py -q build_ext --inplace)      # the base tree's own CPU kernels
    .venv/bin/python benchmarks/compare_revisions.py --base /tmp/base --rounds 5 \\
        bench_low_latency.py --num-processes 2 --iters 30
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def rows(result: object) -> dict[str, float]:
    """Median microseconds per row of one run's JSON (either benchmark's format)."""
    if isinstance(result, dict):  # bench_mega_moe.py: {"results": [{"ep": W, "<name>_us": ...}, ...]}
        return {f"EP{r['ep']} {k[:-3]}": v for r in result["results"] for k, v in r.items() if k.endswith("_us")}
    assert isinstance(result, list)  # bench_low_latency.py: records with op, impl, latency_us
    return {
        f"EP{r['num_processes']} {r['op']} {r['impl']}": r["latency_us"]["median"]
        for r in result
        if "latency_us" in r and r["impl"].startswith(("ours", "elastic"))
    }


def run(tree: Path, script: str, args: list[str]) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        env = {**os.environ, "PYTHONPATH": str(tree)}
        cmd = [sys.executable, str(tree / "benchmarks" / script), *args, "--json", str(out)]
        subprocess.run(cmd, check=True, env=env, cwd=tree, stdout=subprocess.DEVNULL)
        return rows(json.loads(out.read_text()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", type=Path, required=True, help="the base source tree (its CPU kernels built in place)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", help="write the per-round times of both trees here")
    p.add_argument("script", help="a script of benchmarks/, e.g. bench_low_latency.py")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    a = p.parse_args()
    base: list[dict[str, float]] = []
    this: list[dict[str, float]] = []
    for i in range(a.rounds):
        base.append(run(a.base.resolve(), a.script, a.args))
        this.append(run(HERE, a.script, a.args))
        print(f"# round {i + 1} of {a.rounds} done", file=sys.stderr, flush=True)
    print(f"{'row':32s} {'base us':>10s} {'this us':>10s} {'this / base':>12s}")
    for key in base[0]:
        old, new = [r[key] for r in base], [r[key] for r in this]
        ratio = statistics.median(n / o for n, o in zip(new, old, strict=True))
        print(f"{key:32s} {statistics.median(old):10.1f} {statistics.median(new):10.1f} {ratio:12.3f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"base": base, "this": this}, indent=2))


if __name__ == "__main__":
    main()
