"""gpt-oss' MXFP4 routed experts (``quant_method: mxfp4``), dequantized on load as transformers' converter does
(https://github.com/huggingface/transformers/blob/v5.24.0/src/transformers/integrations/mxfp4.py)."""

from __future__ import annotations

import torch

from .files import CheckpointError, CheckpointFiles
from .formats import WeightFormat, need

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # E2M1 codes


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 to fp32: ``blocks`` `[..., G, 16]` `torch.uint8` (two E2M1 codes a byte, the low nibble first) and
    ``scales`` `[..., G]` `torch.uint8` (E8M0: each group of 32 values times ``2^(s - 127)``) -> `[..., G * 32]`."""
    lut = torch.tensor(FP4_VALUES)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2).long()  # [..., G, 32]
    return (lut[codes] * torch.exp2(scales.float() - 127)[..., None]).flatten(-2)


class MXFP4(WeightFormat):
    """``quant_method: mxfp4`` (gpt-oss): the routed experts of each layer as ``<name>_blocks`` `[E, out, in / 32,
    16]` and ``<name>_scales`` `[E, out, in / 32]` (both ``U8``), read as the float `[E, in, out]` tensor ``<name>``
    of the unquantized checkpoints (``x @ W``); every other tensor unquantized."""

    name = "mxfp4"

    def check(self, files: CheckpointFiles, name: str, shape: tuple[int, ...], needed_by: str) -> None:
        if name in files or len(shape) != 3:
            return super().check(files, name, shape, needed_by)
        e, k, n = shape
        if k % 32:
            raise CheckpointError(f"{name}: MXFP4 needs the input size {k} to be a multiple of 32")
        need(files, name + "_blocks", f"the MXFP4 blocks of {name!r}", ("U8",), [(e, n, k // 32, 16)])
        need(files, name + "_scales", f"the MXFP4 scales of {name!r}", ("U8",), [(e, n, k // 32)])

    def load(
        self, files: CheckpointFiles, name: str, shape: tuple[int, ...], rows: range | None = None
    ) -> torch.Tensor:
        if name in files:
            return super().load(files, name, shape, rows)
        blocks, scales = files.read(name + "_blocks", rows), files.read(name + "_scales", rows)
        return dequantize_mxfp4(blocks.view(torch.uint8), scales.view(torch.uint8)).transpose(1, 2)
