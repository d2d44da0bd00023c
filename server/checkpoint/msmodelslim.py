"""Ascend msmodelslim checkpoints (``quant_model_description.json``; vllm-ascend's
https://github.com/vllm-project/vllm-ascend/tree/182b75e/vllm_ascend/quantization reads them).

The description maps every tensor to its scheme: ``W8A8_DYNAMIC`` weights are dequantized on load, ``W = (W_q -
weight_offset) * weight_scale`` per output channel (vllm-ascend runs them with per-token dynamic int8 activations,
which is that float layer up to the activations' rounding); ``FLOAT`` tensors are used as stored. Every other scheme
is refused by name: static ``W8A8`` folds its float bias into ``quant_bias`` / ``deq_scale``, which cannot be turned
back into the float layer exactly; ``W4A8_DYNAMIC``, ``W8A16``, ... are not implemented.
"""

from __future__ import annotations

from typing import Any

import torch

from .files import FLOAT_DTYPES, CheckpointError, CheckpointFiles
from .formats import Reader, WeightFormat, need, sibling

MSMODELSLIM_DESCRIPTION = "quant_model_description.json"
MSMODELSLIM_TYPES = ("FLOAT", "W8A8_DYNAMIC")


class MsModelSlim(WeightFormat):
    """Ascend msmodelslim: ``quant_model_description.json`` maps each tensor to its scheme."""

    name = "msmodelslim"

    def __init__(self, description: dict[str, Any], path: str) -> None:
        self.types = {k: v for k, v in description.items() if isinstance(v, str)}
        for key, kind in self.types.items():
            if key.endswith(".weight") and kind not in MSMODELSLIM_TYPES:
                raise CheckpointError(
                    f"{path}: {key} is quantized as {kind!r}, which is not supported; supported: "
                    f"{list(MSMODELSLIM_TYPES)} (static W8A8 folds its float bias into "
                    "quant_bias / deq_scale: no exact float layer)"
                )

    def dequantizer(self, files: CheckpointFiles, name: str, shape: tuple[int, ...]) -> Reader:
        kind = self.types.get(name)
        if kind != "W8A8_DYNAMIC":
            raise CheckpointError(
                f"checkpoint file {files.path(name)}: tensor {name!r} is {files.dtype(name)}, "
                f"but {MSMODELSLIM_DESCRIPTION} says {kind!r}"
            )
        need(files, name, "a W8A8_DYNAMIC weight", ("I8",), [shape])
        scale, offset = sibling(name, "weight_scale"), sibling(name, "weight_offset")
        per_row = [(shape[0], 1), (shape[0],)]
        need(files, scale, f"the scale of {name!r}", FLOAT_DTYPES, per_row)
        need(files, offset, f"the offset of {name!r}", (*FLOAT_DTYPES, "I8", "I32"), per_row)

        def read() -> torch.Tensor:
            off = files.read(offset).float().reshape(-1, 1)
            return (files.read(name).float() - off) * files.read(scale).float().reshape(-1, 1)

        return read
