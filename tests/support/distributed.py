"""Multi-process test harness: ``parallel_launch(world_size, fn, *args)``.

Each call starts ``world_size`` processes that join one gloo process group (its store hosted by the calling process
on a port the OS picked and that stays bound while the ranks run, so no other job can take it), runs
``fn(info, *args)`` on every rank and returns the per-rank results (rank order). Processes are forked from a
forkserver that has already imported torch and this package, so a launch costs ~0.1 s instead of a fresh
interpreter per rank. Any rank's exception fails the call with every failing rank's traceback; a rank that
neither returns nor fails within ``timeout`` seconds (a deadlock) fails it with ``TimeoutError`` naming the
stuck ranks, and all children are killed, so CI never hangs.

``fn`` must be a module-level function (it is pickled by reference) and its result picklable.

Also small helpers for the rank functions: a failure test's victim and survivors (``stop_victim``,
``leave_together``) and ``op_error`` (what a ``deep_ep_npu.ops`` call raises).
"""

from __future__ import annotations

import dataclasses
import datetime
import io
import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

_PRELOAD = ["torch", "torch.distributed", "deep_ep_npu", "tests.support.distributed"]
_CTX: Any = None


@dataclasses.dataclass(frozen=True)
class ProcessGroupInfo:
    """What a rank knows about its launch: ``rank``, ``world_size``, the gloo world ``group`` and its ``port``."""

    rank: int
    world_size: int
    group: Any
    port: int


def _context() -> Any:
    global _CTX
    if _CTX is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        _CTX = ctx
    return _CTX


def _dumps(obj: Any) -> bytes:
    """Serialize with torch.save: tensors travel as bytes, not as shared-memory handles (which break when the
    sender exits first, and run out of file descriptors with many tensors)."""
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    import torch

    return torch.load(io.BytesIO(data), weights_only=False)


def _worker(rank: int, world_size: int, port: Any, fn: Callable, args: bytes, results: Any, pg_timeout: float) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        args = _loads(args)
        timeout = datetime.timedelta(seconds=pg_timeout)
        if isinstance(port, int):
            store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
        elif rank == 0:  # rank 0 hosts the store (as torchrun-less jobs do) and hands its port to the others
            store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False, timeout=timeout)
            for _ in range(world_size - 1):
                port.put(store.port)
        else:
            store = dist.TCPStore(
                "127.0.0.1", port.get(timeout=pg_timeout), world_size, is_master=False, timeout=timeout
            )
        port = store.port
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        try:
            out = fn(ProcessGroupInfo(rank, world_size, dist.group.WORLD, port), *args)
            results.put((rank, True, _dumps(out)))
        finally:
            dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - forwarded to the parent with its traceback
        results.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def _drain(results: Any, done: dict) -> None:
    while True:
        try:
            rank, ok, out = results.get_nowait()
        except queue.Empty:
            return
        done[rank] = (ok, out)


def parallel_launch(
    world_size: int,
    fn: Callable,
    *args: Any,
    timeout: float = 120.0,
    pg_timeout: float = 60.0,
    allow_exit: tuple[int, ...] = (),
    store_on_rank0: bool = False,
    require_clean_exit: bool = False,
) -> list:
    """Run ``fn(ProcessGroupInfo, *args)`` on ``world_size`` gloo ranks; return the results in rank order.

    Raises ``RuntimeError`` (with each failing rank's traceback) if any rank raised or died, ``TimeoutError`` if
    some rank did not finish within ``timeout`` seconds. ``pg_timeout`` is the gloo group's own timeout.
    ``allow_exit``: ranks expected to exit without a result (failure tests); their result is None.
    ``store_on_rank0``: rank 0 hosts the group's store instead of this process (tests of a store host that fails).
    ``require_clean_exit``: every rank that returned must also exit with code 0 within 5 s (not hang at exit).
    """
    import torch.distributed as dist

    ctx = _context()
    results = ctx.Queue()
    # the parent hosts the ranks' store on a port the OS picked and that stays bound (no pick-close-rebind race)
    store = (
        None
        if store_on_rank0
        else dist.TCPStore(
            "127.0.0.1",
            0,
            world_size,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
    )
    port: Any = ctx.Queue() if store is None else store.port
    payload = _dumps(args)
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, payload, results, pg_timeout), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    done: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(done) < world_size and time.monotonic() < deadline:
            try:
                rank, ok, out = results.get(timeout=0.2)
                done[rank] = (ok, out)
            except queue.Empty:
                _drain(results, done)  # a rank may have reported just before exiting
                for r, p in enumerate(procs):  # a rank that died without reporting (segfault, os._exit)
                    if r not in done and p.exitcode is not None:
                        done[r] = (False, f"rank {r} exited with code {p.exitcode} without a result")
    finally:
        unclean = {}
        for r, p in enumerate(procs):
            p.join(timeout=5.0 if len(done) == world_size else 0.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
                unclean[r] = "still running 5 s after its result (hung at exit)"
            elif p.exitcode != 0:
                unclean[r] = f"exit code {p.exitcode}"
        results.close()
        del store
    for r in allow_exit:
        if r in done and not done[r][0] and "without a result" in done[r][1]:
            done[r] = (True, None)
    failures = {r: out for r, (ok, out) in sorted(done.items()) if not ok}
    if failures:
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in failures.items())
        raise RuntimeError(f"{len(failures)} of {world_size} ranks failed:\n{text}")
    if require_clean_exit and (bad := {r: why for r, why in unclean.items() if r not in allow_exit}):
        raise RuntimeError(f"ranks did not exit cleanly: {bad}")
    if len(done) < world_size:
        stuck = [r for r in range(world_size) if r not in done]
        raise TimeoutError(f"ranks {stuck} did not finish within {timeout:.0f}s (deadlock?)")
    return [None if done[r][1] is None else _loads(done[r][1]) for r in range(world_size)]


def leave_together(store: Any, rank: int, num_survivors: int) -> None:
    """Survivors leave together: each counts itself under ``test/left`` in ``store``; rank 0 (the store's host)
    leaves last, once all ``num_survivors`` have, after setting ``test/done`` (which releases a hanging victim)."""
    store.add("test/left", 1)
    while rank == 0 and int(store.add("test/left", 0)) < num_survivors:
        time.sleep(0.01)
    if rank == 0:
        store.set("test/done", "1")


def stop_victim(store: Any, how: str) -> None:
    """The victim of a failure test: exit at once (``how="exit"``), or hang (stop calling) until the survivors
    are done (``test/done`` in ``store``), then exit."""
    try:
        while how == "hang" and not store.check(["test/done"]):
            time.sleep(0.05)
    finally:
        os._exit(0)


def survivor_failure(store: Any, rank: int, num_survivors: int, call: Callable[[], object]) -> tuple | None:
    """A survivor of a failure test: ``call()``, then :func:`leave_together`; ``(missing ranks, seconds until the
    EPRankFailure)``, or None when ``call()`` returned."""
    from deep_ep_npu import EPRankFailure

    t0, out = time.monotonic(), None
    try:
        call()
    except EPRankFailure as err:
        out = (err.missing_ranks, time.monotonic() - t0)
    leave_together(store, rank, num_survivors)
    return out


def op_error(fn: Callable[[], object]) -> tuple[int, str, str] | None:
    """``(code, param, message)`` of the ``MoeDistributeError`` that ``fn()`` raises, or None if it returns."""
    from deep_ep_npu.ops import MoeDistributeError

    try:
        fn()
    except MoeDistributeError as err:
        return err.code, err.param, str(err)
    return None


def error_mismatches(rank: int, errors: dict[str, tuple[int, str, str] | None], expect: dict) -> list[str]:
    """A line per case of ``expect`` that this ``rank`` did not get as expected (``errors``: each case's
    :func:`op_error`; ``expect``: case -> ``(code, param, text in the message)``, None for no error, or a list of
    those per rank)."""
    bad = []
    for name, want in expect.items():
        want = want[rank] if isinstance(want, list) else want
        got = errors[name]
        ok = got is None if want is None else got is not None and got[:2] == want[:2] and want[2] in got[2]
        if not ok:
            bad.append(f"rank {rank} {name}: expected {want}, got {got}")
    return bad


def assert_named(
    errors: dict[str, tuple[int, str, str] | None], expected: dict[str, str], rank: int, one_rank_param: str
) -> None:
    """Each case of ``expected`` (case -> parameter) raised on this ``rank`` naming its parameter (``errors``: the
    case's :func:`op_error`), and case ``"one_rank"`` (rank 1's bad ``one_rank_param`` alone) raised on every rank:
    on rank 1 naming the parameter, on rank 0 naming rank 1."""
    for name, param in expected.items():
        assert errors[name] is not None and errors[name][1] == param, (rank, name, errors[name])
    one = errors["one_rank"]
    assert one is not None and (one[1] == one_rank_param if rank else "rejected on rank 1" in one[2]), (rank, one)


def lockstep(max_examples: int) -> Callable[[Callable], Callable]:
    """Hypothesis settings for a property every rank runs at once on the same draws: derandomized, no database and
    no shrinking (a failure stops every rank at once; shrinking on one rank would desync the others)."""
    from hypothesis import HealthCheck, Phase, settings

    return settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        derandomize=True,
        phases=(Phase.generate,),
        suppress_health_check=list(HealthCheck),
    )
