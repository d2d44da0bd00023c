"""Apply known mutants of the library one by one and check that the tests meant to catch each one fail.

Run from the repository root: ``.venv/bin/python scripts/mutation_check.py`` (a few minutes on 2 cores). Each mutant
is a single text replacement; the file is restored afterwards (also on Ctrl-C), and a mutated C file is rebuilt in
place before its tests and after. Exit status 1 if a mutant survives.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

MUTANTS = [  # (name, file, original text, mutated text, tests that must fail)
    ("int8 rint rounds half away from zero", "deep_ep_npu/quant.py",
     "q = torch.round(q).nan_to_num_(nan=0.0) if dtype == torch.int8 else q",
     "q = (torch.sign(q) * torch.floor(q.abs() + 0.5)).nan_to_num_(nan=0.0) if dtype == torch.int8 else q",
     ["tests/ops/test_ops_dispatch_combine.py", "tests/ops/test_ops_quant_ccl.py"]),
    ("failure grace stretched to the full timeout", "deep_ep_npu/transports/failure.py",
     "grace = time.monotonic(), min(timeout, max(1.0, timeout / 10))",
     "grace = time.monotonic(), timeout",
     ["tests/failure/test_failure.py::test_survivors_raise_naming_the_missing_rank"]),
    ("combine weights swapped between a token's slots", "deep_ep_npu/engine/masked.py",
     "c.expert_scales[plan.token, plan.slot]",
     "c.expert_scales.flip(1)[plan.token, plan.slot]",
     ["tests/compat/test_buffer_errors.py"]),
    ("agreement ignores which op a rank arrived at", "deep_ep_npu/transports/collective.py",
     "return int(their_seq) > seq or (int(their_seq) == seq and their_op == op)",
     "return int(their_seq) >= seq",
     ["tests/failure/test_failure_shrink.py"]),
    ("store calls unbounded", "deep_ep_npu/transports/failure.py",
     "call = lambda fn, *args: _bounded(timeout, fn, *args)  # noqa: E731",
     "call = lambda fn, *args: fn(*args)  # noqa: E731",
     ["tests/failure/test_failure.py::test_store_host_failure_is_bounded"]),
    ("a non-finite row's int8 scale made finite", "deep_ep_npu/quant.py",
     "return q.clamp_(-MAX[dtype], MAX[dtype]).to(dtype), amax / vmax",
     "return q.clamp_(-MAX[dtype], MAX[dtype]).to(dtype), (amax / vmax).nan_to_num(0.0, posinf=0.0)",
     ["tests/compat/test_fuzz_values.py"]),
    ("flat dispatch errors name the op's parameters", "deep_ep_npu/backends/__init__.py",
     "raise err.renamed(names) from None",
     "raise err",
     ["tests/compat/test_fuzz_library.py"]),
    ("C reduction rounds differently from the torch code", "deep_ep_npu/kernels/loops.c",
     "            acc[h] = acc[h] + p;",
     "            acc[h] = acc[h] + p * 1.0000001f;",
     ["tests/kernels/test_cpu_kernels.py", "tests/transports/test_transport.py::test_transports_are_bit_identical"]),
    ("C plan puts this rank's rows in rank order", "deep_ep_npu/kernels/loops.c",
     "int64_t d = q < R - 1 ? (q < me ? q : q + 1) : me;",
     "int64_t d = q;",
     ["tests/kernels/test_cpu_kernels.py"]),
    ("C flat placement orders its blocks by source, then expert", "deep_ep_npu/kernels/loops.c",
     "int64_t p = cursor[e * num_ranks + s]++;",
     "int64_t p = cursor[s * num_local + e]++;",
     ["tests/kernels/test_cpu_kernels.py", "tests/ops/test_ops_dispatch_combine.py::test_random_cases_match_oracle"]),
    ("flat combine sums a token's slots in plan order", "deep_ep_npu/engine/reduce.py",
     "order = torch.argsort(plan.slot, stable=True)",
     "order = torch.arange(plan.slot.numel(), device=dev)",
     ["tests/ops/test_ops_dispatch_combine.py::test_random_cases_match_oracle"]),
    ("C int8 rows round half away from zero", "deep_ep_npu/kernels/loops.c",
     "float r = __builtin_rintf(v[h] * inv);",
     "float r = __builtin_roundf(v[h] * inv);",
     ["tests/kernels/test_cpu_kernels.py", "tests/ops/test_ops_dispatch_combine.py::test_random_cases_match_oracle"]),
    ("C e4m3 cast rounds ties up", "deep_ep_npu/kernels/loops.c",
     "uint32_t normal = (u + 0x7FFFFu + ((u >> 20) & 1u) - ((uint32_t)(127 - 7) << 23)) >> 20;",
     "uint32_t normal = (u + 0x80000u - ((uint32_t)(127 - 7) << 23)) >> 20;",
     ["tests/kernels/test_cpu_kernels.py::test_e4m3_cast_matches_torch"]),
    ("a late rank completes a call its peers gave up", "deep_ep_npu/transports/window.py",
     "if any(call.seq in self.peers[s].abandoned for s in ranks):",
     "if False:",
     ["tests/failure/test_failure_ops.py::test_a_late_rank_learns_it_was_excluded"]),
]  # fmt: skip


def build_kernels() -> None:
    """Rebuild the CPU kernels in place (what ``pip install -e .`` builds): a C mutant only runs once built."""
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], capture_output=True, check=True)


def killed(path: str, old: str, new: str, tests: list[str]) -> bool:
    """Whether ``tests`` fail with ``old`` replaced by ``new`` in ``path`` (which is restored)."""
    file, native = pathlib.Path(path), path.endswith(".c")
    text = file.read_text()
    if text.count(old) != 1:
        raise SystemExit(f"{path}: the mutant's original text is not there exactly once: {old!r}")
    file.write_text(text.replace(old, new))
    try:
        if native:
            build_kernels()
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
        return subprocess.run(cmd, capture_output=True, timeout=600).returncode != 0
    except subprocess.TimeoutExpired:
        return True  # a hang is caught too (the suite's own timeouts would fail it)
    finally:
        file.write_text(text)
        if native:
            build_kernels()


def main() -> int:
    survivors = []
    for name, path, old, new, tests in MUTANTS:
        ok = killed(path, old, new, tests)
        print(f"{'killed  ' if ok else 'SURVIVED'} {name}  ({', '.join(tests)})", flush=True)
        if not ok:
            survivors.append(name)
    print(f"{len(MUTANTS) - len(survivors)} of {len(MUTANTS)} mutants killed")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
