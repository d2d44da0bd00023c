"""What the agreement step tells a rank (:class:`Agreement`), and what a transport's ``send`` takes: the rows' writer
(:data:`Write`) and the check every rank runs on the agreement before a row is read (:data:`Check`). The agreement
step itself: :meth:`.collective.EPGroup.start_agree` (the collective transport, the ops, the TP stage) or the window's
headers (:mod:`.window`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

STATUS_OK = 0  # an agreement row's status when the rank accepted its input (else the aclnn code it raised)


@dataclasses.dataclass
class Agreement:
    """What every source rank announced to this rank in one agreement step (lists indexed by source rank): its status
    (0, or the aclnn code of its rejected input), its words for this rank, its shared words, and the wait (µs)."""

    status: list[int]
    counts: list[list[int]]
    shared: list[tuple[int, ...]]
    wait_us: int
    op: str


Write = Callable[[int, torch.Tensor], None]  # write(d, out): the rows for rank d into out [rows, row_bytes]
Check = Callable[[Agreement], None]
