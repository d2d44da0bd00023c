"""Which weight format a checkpoint uses (its ``quantization_config.quant_method``, or msmodelslim's
``quant_model_description.json``), or why it cannot be served."""

from __future__ import annotations

import json
import os
from typing import Any

from .files import CheckpointError
from .formats import FP8, CompressedTensors, WeightFormat
from .msmodelslim import MSMODELSLIM_DESCRIPTION, MsModelSlim
from .mxfp4 import MXFP4

SUPPORTED = (
    "fp8 (block or per-tensor weight_scale_inv), compressed-tensors (8-bit int / fp8: int-quantized, "
    "float-quantized, naive-quantized), mxfp4 (gpt-oss experts), Ascend msmodelslim W8A8_DYNAMIC "
    "(quant_model_description.json)"
)


def detect_format(model_path: str, cfg: dict[str, Any]) -> WeightFormat:
    """The weight format of the checkpoint in ``model_path`` with ``config.json`` ``cfg``: msmodelslim when
    ``quant_model_description.json`` exists (as vllm-ascend decides), else ``quantization_config``'s, else
    unquantized. Raises :class:`CheckpointError` naming a format that is not supported."""
    description = os.path.join(model_path, MSMODELSLIM_DESCRIPTION)
    if os.path.isfile(description):
        with open(description, encoding="utf-8") as f:
            return MsModelSlim(json.load(f), description)
    qc = cfg.get("quantization_config")
    if not qc:
        return WeightFormat()
    method = qc.get("quant_method")
    if method == "fp8":
        return FP8(qc)
    if method == "compressed-tensors":
        return CompressedTensors(qc)
    if method == "mxfp4":
        return MXFP4()
    raise CheckpointError(
        f"config.json quantization_config.quant_method={method!r} is not supported; supported: {SUPPORTED}"
    )
