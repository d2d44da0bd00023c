"""The extension's bindings check their arguments: a wrong call (count, type, a tensor too small for what the loop
touches, an index past its tensor, a non-contiguous or non-CPU tensor) raises before any loop runs, and writes
nothing."""

from __future__ import annotations

import pytest
import torch

from deep_ep_npu import kernels

pytestmark = pytest.mark.skipif(kernels.unavailable() == "DEEP_EP_NPU_CPU_KERNELS=0", reason="kernels turned off")


@pytest.fixture
def lib():
    lib = kernels.library()
    assert lib is not None, kernels.unavailable()
    return lib


def _i64(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def test_count_and_types(lib):
    x, out = torch.ones(4), torch.zeros(4, dtype=torch.uint8)
    with pytest.raises(TypeError, match=r"to_e4m3\(\) takes 3 arguments \(2 given\)"):
        lib.to_e4m3(x, 4)
    with pytest.raises(TypeError, match=r"to_e4m3\(\): x must be a tensor, not list"):
        lib.to_e4m3([1.0] * 4, 4, out)
    with pytest.raises(TypeError, match=r"to_e4m3\(\): n must be an int, not float"):
        lib.to_e4m3(x, 4.0, out)
    with pytest.raises(OverflowError):
        lib.to_e4m3(x, 2**64, out)
    with pytest.raises(ValueError, match=r"to_e4m3\(\): x must be contiguous"):
        lib.to_e4m3(torch.ones(4, 2).t(), 4, out)
    with pytest.raises(ValueError, match=r"to_e4m3\(\): x must be a CPU tensor"):
        lib.to_e4m3(torch.ones(4, device="meta"), 4, out)
    with pytest.raises(TypeError, match=r"rows must be a list of \(x, index\) pairs"):
        lib.accumulate_rows(torch.zeros(2, 4), 2, 4, 0, [x], _i64(0), _i64(0), torch.ones(1), 1)
    assert not out.any()


def test_sizes(lib):
    out = torch.zeros(4, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"to_e4m3\(\): out holds 4 bytes, the kernel touches 5"):
        lib.to_e4m3(torch.ones(5), 5, out)
    with pytest.raises(ValueError, match=r"to_e4m3\(\): the sizes given for x are negative or overflow"):
        lib.to_e4m3(torch.ones(4), -1, out)
    with pytest.raises(ValueError, match=r"to_e4m3\(\): the sizes given for x are negative or overflow"):
        lib.to_e4m3(torch.ones(4), 2**62, out)
    assert not out.any()
    acc = torch.zeros(3, 8)
    with pytest.raises(ValueError, match=r"accumulate\(\): x's rows are narrower than hidden"):
        lib.accumulate(acc, 3, 8, torch.ones(5, 16)[:, :4], 0, None, _i64(0), torch.ones(1), 1, 0)
    with pytest.raises(ValueError, match=r"accumulate\(\): weight holds 4 bytes, the kernel touches 8"):
        lib.accumulate(acc, 3, 8, torch.ones(5, 8), 0, None, _i64(0, 1), torch.ones(1), 2, 0)
    with pytest.raises(ValueError, match=r"accumulate\(\): dtype code 7 is not in this build"):
        lib.accumulate(acc, 3, 8, torch.ones(5, 8), 7, None, _i64(0), torch.ones(1), 1, 0)
    assert not acc.any()


def test_row_fields_and_layout(lib):
    """The masked placement: row fields past the row, a layout too small for cap, a negative position."""
    rows, recv = torch.zeros(2, 24, dtype=torch.uint8), torch.zeros(2, 4, 16, dtype=torch.uint8)
    src_info, pos, counts = torch.zeros(2, 4, dtype=torch.int32), _i64(0, 0), torch.zeros(2, 2, dtype=torch.int64)
    pairs = torch.zeros(2, 4, dtype=torch.int64)
    args = [rows, 2, 24, 16, 16, 20, 1, 2, 4, 2, 1, recv, src_info, pos, counts, pairs]
    lib.place(*args)  # (valid: every slot -1 but expert 0 at byte 20 of the zero rows)
    assert counts.tolist() == [[0, 2], [0, 0]] and pos.tolist() == [2, 0]
    pos.zero_(), counts.zero_()
    for i, bad, match in [
        (5, 21, r"the slots \(4 bytes at 21\) is outside a row of 24 bytes"),
        (3, 25, r"the data \(25 bytes at 0\) is outside a row of 24 bytes"),
        (8, 5, r"recv holds 128 bytes, the kernel touches 160"),
        (10, 2, r"source 2 is outside \[0, 2\)"),
        (13, _i64(-1, 0), r"pos holds a row outside \[0, 4\]"),
        (15, torch.zeros(2, 1, dtype=torch.int64), r"pairs has room for 1 pairs"),
    ]:
        with pytest.raises(ValueError, match=rf"place\(\): {match}"):
            lib.place(*args[:i], bad, *args[i + 1 :])
    assert not recv.any() and not src_info.any() and not counts.any()


def test_indexes_past_their_tensor(lib):
    x, out = torch.arange(12, dtype=torch.float32).view(6, 2), torch.zeros(2, 2)
    with pytest.raises(IndexError, match=r"gather: a row index is outside \[0, 6\)"):
        lib.gather(x, 6, 8, _i64(0, 6), 2, out)
    with pytest.raises(IndexError, match=r"gather: a row index is outside \[0, 6\)"):
        lib.gather(x, 6, 8, _i64(-1, 0), 2, out)
    assert not out.any()
    acc = torch.zeros(2, 2)
    with pytest.raises(IndexError, match=r"accumulate: row index past the 6 rows of x"):
        lib.accumulate(acc, 2, 2, x, 0, _i64(6), _i64(0), torch.ones(1), 1, 0)
    with pytest.raises(IndexError, match=r"accumulate: a token index is outside \[0, 2\)"):
        lib.accumulate(acc, 2, 2, x, 0, _i64(5), _i64(2), torch.ones(1), 1, 0)
    with pytest.raises(IndexError, match=r"accumulate_rows: an order index is outside \[0, 3\)"):
        lib.accumulate_rows(acc, 2, 2, 0, [(x, _i64(0, 1)), (x[:1], None)], _i64(3), _i64(0), torch.ones(1), 1)
    assert not acc.any()
    with pytest.raises(ValueError, match=r"plan\(\): id 4 is not below R \* L = 4"):
        lib.plan(
            _i64(0, 4).view(1, 2),
            1,
            2,
            2,
            2,
            0,
            torch.zeros(2, dtype=torch.uint8),
            0,
            torch.empty(64, dtype=torch.int64),
            None,
        )


def test_flat_blocks(lib):
    counts, assist = torch.zeros(2, 2, dtype=torch.int64), torch.zeros(12, dtype=torch.int32)
    expand_x = torch.zeros(4, 8, dtype=torch.uint8)
    fields = [16, 8, 8, 0, 8, 12, 1, -1, 2, 2, 4, expand_x, None, assist, None, counts]
    with pytest.raises(ValueError, match=r"a block's rows are not whole rows of 16 bytes"):
        lib.place_flat([(0, torch.zeros(20, dtype=torch.uint8))], *fields)
    with pytest.raises(TypeError, match=r"blocks must be a list of \(source, rows\) pairs"):
        lib.place_flat([torch.zeros(16, dtype=torch.uint8)], *fields)
    with pytest.raises(ValueError, match=r"assist holds 44 bytes, the kernel touches 48"):
        lib.place_flat([], *fields[:13], assist[:11], *fields[14:])
    assert not counts.any() and not expand_x.any()
