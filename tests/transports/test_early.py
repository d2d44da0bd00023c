"""The collective transport's early payload (``deep_ep_npu.transports.early``), straight on the transport: a rank
that knows what it receives starts its rows before the agreement. Whatever the peers send (more rows than this rank
expects: on gloo a longer message than the posted receive would abort the receiving process), no process dies, only
the rows a peer announced are read, and the group stays usable; a rank whose rows exceed the bound, or ranks that
disagree on starting early while their check passes, make every rank raise."""

from __future__ import annotations

import pytest
import torch

from deep_ep_npu import MoeDistributeError
from deep_ep_npu.transports.agreement import STATUS_OK, Agreement, Send, TransportError
from deep_ep_npu.transports.group import EPGroup
from deep_ep_npu.transports.staged import Staged
from tests.support.distributed import parallel_launch

ROW = 16  # bytes per row


def _rows(src: int, dest: int, n: int) -> torch.Tensor:
    """The `[n, ROW]` uint8 rows ``src`` sends ``dest`` (distinct per pair and row)."""
    return (torch.arange(n * ROW, dtype=torch.int64) + 64 * src + 8 * dest).remainder(251).to(torch.uint8).view(n, ROW)


def _exchange(transport: Staged, sends: list[int], expects: list[int] | None, strict: bool):
    """One call: this rank sends ``sends[d]`` rows to rank d, expects ``expects[s]`` from rank s (None: not known);
    ``strict``: the check raises on a nonzero status or a count this rank did not expect."""
    me, r = transport.ep.rank, transport.ep.num_ranks
    counts = [[n, -1 if expects is None else expects[d]] for d, n in enumerate(sends)]

    def check(agreement: Agreement) -> None:
        if strict and any(s != STATUS_OK for s in agreement.status):
            raise MoeDistributeError(agreement.status[0] or agreement.status[1], "inputs", "status")
        if strict and expects is not None and any(agreement.counts[s][0] != expects[s] for s in range(r) if s != me):
            raise MoeDistributeError(1, "counts", f"rank {me} expected {expects}")

    write = lambda d, out: out.copy_(_rows(me, d, out.shape[0]))  # noqa: E731
    received = transport.send(Send("early test", counts, [ROW], write, check)).receive()
    return {s: rows.clone() for s, rows in received.parts}


def _outcome(fn) -> str:
    try:
        fn()
    except (MoeDistributeError, TransportError) as err:
        return str(err)
    return "ok"


def _good(transport: Staged) -> bool:
    me, r = transport.ep.rank, transport.ep.num_ranks
    got = _exchange(transport, [2 + d for d in range(r)], [2 + me] * r, True)
    return all(torch.equal(got[s], _rows(s, me, 2 + me)) for s in range(r) if s != me)


def _cases(info, case: str):
    ep = EPGroup(info.group, timeout=20.0)
    transport, me = Staged(ep), info.rank
    if case == "longer":  # rank 1 sends rank 0 five rows, rank 0 expects two: nobody dies, rank 0's check raises
        sends, expects = ([0, 3], [0, 2]) if me == 0 else ([5, 0], [3, 0])
        out = _outcome(lambda: _exchange(transport, sends, expects, True))
        assert ("expected" in out) == (me == 0) and (out == "ok") == (me == 1), out
        got_ok = _good(transport)
        loose = _exchange(transport, sends, expects, False)
        return out, got_ok and torch.equal(loose[1 - me], _rows(1 - me, me, 5 if me == 0 else 3))  # announced rows
    if case == "mixed":  # rank 0 knows what it receives, rank 1 does not; the check passes: both raise
        out = _outcome(lambda: _exchange(transport, [2, 2], [2, 2] if me == 0 else None, True))
        return out, _good(transport)
    # over: the bound is 40 bytes; rank 1's three rows for rank 0 exceed it: every rank raises (status)
    bound, transport.early_bytes = transport.early_bytes, 40
    out = _outcome(lambda: _exchange(transport, [0, 2] if me == 0 else [3, 0], [0, 3] if me == 0 else [2, 0], True))
    transport.early_bytes = bound
    return out, _good(transport)


@pytest.mark.parametrize("case", ["longer", "mixed", "over"])
def test_early_payload_never_kills_a_rank(case):
    results = parallel_launch(2, _cases, case, timeout=90)
    assert all(good for _, good in results), results  # the group is in step after it
    if case == "mixed":
        assert all("ranks [0] knew the rows" in out and "ranks [1] did not" in out for out, _ in results), results
    if case == "over":
        assert all("[aclnn 561002] inputs: status" in out for out, _ in results), results
