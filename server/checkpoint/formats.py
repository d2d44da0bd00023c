"""Quantized checkpoint formats: how a stored weight becomes the float weight the model runs
(DeepSeek-V3's ``README_WEIGHTS.md``, https://github.com/vllm-project/compressed-tensors, vllm-ascend's msmodelslim
loader, transformers' ``integrations/mxfp4.py``).

The rule is per tensor: a float tensor (F32 / F16 / BF16) is used as stored; a 1-byte one (F8_E4M3, F8_E5M2, I8) is
a quantized weight, which the checkpoint's declared format dequantizes **on load, exactly** (in fp32, then cast to
the model dtype) from its scales; a quantized tensor the format cannot place (no format declared, a missing scale,
a scale of the wrong shape) stops start-up naming the tensor. Nothing is ever cast without its scales. Formats
(:mod:`.detect` picks one; Ascend msmodelslim in :mod:`.msmodelslim`, gpt-oss' MXFP4 in :mod:`.mxfp4`):

- ``fp8`` (``quantization_config.quant_method``; DeepSeek-V3 / R1, Kimi-K2, Qwen3-FP8): ``W = fp8(W_q) * S`` with
  ``S = <name>_scale_inv`` on the ``weight_block_size`` grid (ceil-div, cropped at the edges), or one scale for the
  whole tensor; E8M0-byte scales are ``2^(b - 127)``.
- ``compressed-tensors`` (llm-compressor; formats ``int-quantized`` / ``float-quantized`` / ``naive-quantized``,
  8-bit int or fp8 weights): ``W = (W_q - weight_zero_point) * weight_scale`` per tensor, channel, group (with
  ``weight_g_idx`` when act-ordered) or block.

Activations then run in the model dtype: what the formats' dynamic activation quantization would round is not
rounded. Refused by name at start-up: compressed-tensors' packed / 4-bit / nvfp4 / mxfp4 formats (and, in
:mod:`.detect`, any other ``quant_method``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .files import FLOAT_DTYPES, CheckpointError, CheckpointFiles

CT_FORMATS = ("int-quantized", "float-quantized", "naive-quantized", "dense")
CT_STRATEGIES = ("tensor", "channel", "group", "block")
QUANT_DTYPES = ("F8_E4M3", "F8_E5M2", "I8")
# Tensors the formats store next to a quantized weight (scales, offsets, activation scales, KV-cache scales).
AUX_SUFFIXES = (
    "_scale_inv",
    "_scale",
    "_zero_point",
    "_g_idx",
    "_offset",
    "quant_bias",
    "deq_scale",
    "_blocks",
    "_scales",
)

Reader = Callable[[], torch.Tensor]  # a quantized weight's float32 value, read when called


def sibling(name: str, suffix: str) -> str:
    """``a.b.weight`` -> ``a.b.<suffix>``."""
    return name.removesuffix("weight") + suffix


def expand(scale: torch.Tensor, shape: tuple[int, ...], block: tuple[int, int]) -> torch.Tensor:
    """``scale`` `[ceil(N / bn), ceil(K / bk)]` -> `[N, K]` (each block's scale on its elements, edges cropped)."""
    return scale.repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)[: shape[0], : shape[1]]


def as_float(t: torch.Tensor, dtype: str) -> torch.Tensor:
    """A stored scale as fp32 multipliers (``U8`` / ``F8_E8M0``: E8M0 exponent bytes, ``2^(b - 127)``)."""
    if dtype in ("U8", "F8_E8M0"):
        return torch.exp2(t.view(torch.uint8).float() - 127)
    return t.float()


def need(files: CheckpointFiles, name: str, of: str, dtypes: tuple[str, ...], shapes: list[tuple[int, ...]]) -> str:
    """Check tensor ``name`` (the ``of`` of a quantized weight) exists with one of ``dtypes`` and ``shapes``; returns
    its dtype."""
    files.require(name, of)
    dtype, shape = files.dtype(name), files.shape(name)
    if dtype not in dtypes or shape not in shapes:
        raise CheckpointError(
            f"checkpoint file {files.path(name)}: tensor {name!r} ({of}) is {dtype} {shape}; "
            f"expected a dtype in {list(dtypes)} and a shape in {shapes}"
        )
    return dtype


class WeightFormat:
    """How one checkpoint stores its weights: :meth:`check` (headers only) and :meth:`load` (the data) for each
    tensor the model reads. This base class is the unquantized format: every tensor as stored, a quantized one
    refused."""

    name = "unquantized"

    def check(self, files: CheckpointFiles, name: str, shape: tuple[int, ...], needed_by: str) -> None:
        """Raise :class:`CheckpointError` unless tensor ``name`` (with its scales) gives a float tensor of ``shape``
        (``needed_by`` says what the model needs it for)."""
        files.require(name, needed_by)
        stored, dtype = files.shape(name), files.dtype(name)
        if stored != tuple(shape):
            raise CheckpointError(
                f"checkpoint file {files.path(name)}: tensor {name!r} has shape {stored}, "
                f"config.json needs {tuple(shape)}"
            )
        if dtype in FLOAT_DTYPES:
            return
        if dtype not in QUANT_DTYPES or not name.endswith(".weight"):
            raise CheckpointError(
                f"checkpoint file {files.path(name)}: tensor {name!r} is stored as {dtype}, "
                "neither a float dtype nor a quantized weight's"
            )
        self.dequantizer(files, name, tuple(shape))

    def load(
        self, files: CheckpointFiles, name: str, shape: tuple[int, ...], rows: range | None = None
    ) -> torch.Tensor:
        """Tensor ``name`` as a float tensor of ``shape`` (a quantized weight dequantized, in fp32); only ``rows`` of
        its first dim when given (fused expert tensors, stored as float)."""
        if files.dtype(name) in FLOAT_DTYPES:
            return files.read(name, rows)
        assert rows is None, f"{self.name} has no fused quantized tensors"  # checkpoint_reads asks rows of fused ones
        return self.dequantizer(files, name, tuple(shape))()

    def dequantizer(self, files: CheckpointFiles, name: str, shape: tuple[int, ...]) -> Reader:
        """Check (headers only) that quantized weight ``name`` `[N, K]` can be dequantized; return its reader."""
        raise CheckpointError(
            f"checkpoint file {files.path(name)}: tensor {name!r} is stored as "
            f"{files.dtype(name)} (quantized), but config.json declares no quantization_config: "
            "its scales are unknown, so it is not loaded (a cast would drop them)"
        )


class FP8(WeightFormat):
    """``quant_method: fp8``: ``weight_scale_inv`` per ``weight_block_size`` block, or one per tensor."""

    name = "fp8"

    def __init__(self, qc: dict[str, Any]) -> None:
        block = qc.get("weight_block_size")
        if block is not None and (not isinstance(block, list) or len(block) != 2 or min(block) < 1):
            raise CheckpointError(f"config.json quantization_config.weight_block_size={block!r} must be [rows, cols]")
        self.block = None if block is None else (int(block[0]), int(block[1]))

    def dequantizer(self, files: CheckpointFiles, name: str, shape: tuple[int, ...]) -> Reader:
        need(files, name, "an fp8 weight", ("F8_E4M3", "F8_E5M2"), [shape])
        scale = sibling(name, "weight_scale_inv")
        grid: list[tuple[int, ...]] = [(), (1,)]  # per tensor
        if self.block:
            grid = [(-(-shape[0] // self.block[0]), -(-shape[1] // self.block[1]))]
        dtype = need(files, scale, f"the scale of fp8 weight {name!r}", (*FLOAT_DTYPES, "U8", "F8_E8M0"), grid)

        def read() -> torch.Tensor:
            s = as_float(files.read(scale), dtype)
            return files.read(name).float() * (expand(s, shape, self.block) if self.block else s.reshape(()))

        return read


class CompressedTensors(WeightFormat):
    """``quant_method: compressed-tensors`` with 8-bit int or fp8 weights (``config_groups``' weight schemes)."""

    name = "compressed-tensors"

    def __init__(self, qc: dict[str, Any]) -> None:
        self.schemes: list[dict[str, Any]] = []
        for group_name, group in (qc.get("config_groups") or {}).items():
            fmt = group.get("format") or qc.get("format")
            where = f"config.json quantization_config.config_groups.{group_name}"
            if fmt not in CT_FORMATS:
                raise CheckpointError(
                    f"{where}: compressed-tensors format={fmt!r} is not supported; supported: "
                    f"{list(CT_FORMATS)} (8-bit weights)"
                )
            w = group.get("weights")
            if fmt == "dense" or w is None:
                continue
            bits, kind, strategy = w.get("num_bits"), w.get("type"), w.get("strategy")
            if bits != 8 or kind not in ("int", "float") or strategy not in CT_STRATEGIES:
                raise CheckpointError(
                    f"{where}.weights: num_bits={bits!r} type={kind!r} strategy={strategy!r} is "
                    f"not supported; supported: 8-bit int or float, strategy in "
                    f"{list(CT_STRATEGIES)}"
                )
            self.schemes.append(w)

    def _scale_shape(self, w: dict[str, Any], shape: tuple[int, ...]) -> list[tuple[int, ...]]:
        n, k = shape
        if w["strategy"] == "tensor":
            return [(), (1,)]
        if w["strategy"] == "channel":
            return [(n, 1)]
        if w["strategy"] == "group":
            return [(n, -(-k // int(w["group_size"])))]
        bn, bk = w["block_structure"]
        return [(-(-n // bn), -(-k // bk))]

    def dequantizer(self, files: CheckpointFiles, name: str, shape: tuple[int, ...]) -> Reader:
        kind = "int" if need(files, name, "a quantized weight", QUANT_DTYPES, [shape]) == "I8" else "float"
        scale, zero = sibling(name, "weight_scale"), sibling(name, "weight_zero_point")
        files.require(scale, f"the scale of quantized weight {name!r}")
        schemes = [w for w in self.schemes if w["type"] == kind and files.shape(scale) in self._scale_shape(w, shape)]
        if not schemes:
            raise CheckpointError(
                f"checkpoint file {files.path(scale)}: scale {scale!r} has shape "
                f"{files.shape(scale)}, which no {kind} weight scheme of config.json's "
                f"config_groups gives for a {shape} weight"
            )
        w = schemes[0]
        expected = self._scale_shape(w, shape)
        need(files, scale, f"the scale of {name!r}", FLOAT_DTYPES, expected)
        if zero in files:
            need(files, zero, f"the zero point of {name!r}", ("I8", "I32", *FLOAT_DTYPES), expected)
        g_idx = sibling(name, "weight_g_idx")

        def full(t: torch.Tensor) -> torch.Tensor:
            """A scale-shaped tensor, broadcastable onto the `[N, K]` weight."""
            if w["strategy"] == "group" and g_idx in files:  # act-ordered groups: column c is in group g_idx[c]
                return t[:, files.read(g_idx).long()]
            if w["strategy"] == "group":
                return t.repeat_interleave(int(w["group_size"]), dim=1)[:, : shape[1]]
            if w["strategy"] == "block":
                bn, bk = w["block_structure"]
                return expand(t, shape, (int(bn), int(bk)))
            return t if w["strategy"] == "channel" else t.reshape(())

        def read() -> torch.Tensor:
            q = files.read(name).float()
            if zero in files:
                q = q - full(files.read(zero).float())
            return q * full(files.read(scale).float())

        return read
