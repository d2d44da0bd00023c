"""The safetensors files of one HF checkpoint directory, read lazily, with every expected fault named.

A checkpoint is ``model.safetensors`` or the shards listed in ``model.safetensors.index.json`` (its ``weight_map``;
shard names are never derived). Each file is ``[8-byte little-endian header length n][n bytes of JSON header][data]``;
the headers are read and checked when the checkpoint is opened (a missing shard, an unreadable or truncated file, a
header that is not safetensors', a tensor the index lists but its shard lacks), so these faults stop start-up before
any tensor is read. :class:`CheckpointError` is a ``ValueError`` whose message is one line naming the file and the
tensor.
"""

from __future__ import annotations

import json
import math
import os
import struct
from typing import Any

import torch

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_MAX_HEADER = 100 << 20  # safetensors' own limit on the header size
_ITEM_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "U16": 2,
    "U32": 4,
    "U64": 8,
}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


class CheckpointError(ValueError):
    """A checkpoint that cannot be served as it is; the message (one line) names the file and the tensor."""


def _read_header(path: str) -> dict[str, Any]:
    """The header of one safetensors file (tensor name -> dtype, shape, data_offsets), checked against the file."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"checkpoint file {path}: truncated ({size} bytes, not even a header length)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise CheckpointError(
                    f"checkpoint file {path}: truncated or not a safetensors file (header length "
                    f"{n}, file size {size} bytes)"
                )
            header = json.loads(f.read(n))
    except OSError as e:
        raise CheckpointError(f"checkpoint file {path}: cannot be read ({e.strerror or e})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint file {path}: its safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"checkpoint file {path}: its safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    for tensor, info in header.items():
        try:
            begin, end = info["data_offsets"]
            numel = math.prod(info["shape"])
            item = _ITEM_BYTES[info["dtype"]]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(
                f"checkpoint file {path}: tensor {tensor!r} has a malformed header entry {info!r}"
            ) from None
        if end - begin != numel * item:
            raise CheckpointError(
                f"checkpoint file {path}: tensor {tensor!r} spans {end - begin} bytes, its dtype "
                f"{info['dtype']} and shape {info['shape']} need {numel * item}"
            )
        if 8 + n + end > size:
            raise CheckpointError(
                f"checkpoint file {path} is truncated: {size} bytes, but tensor {tensor!r} ends at byte {8 + n + end}"
            )
    return header


class CheckpointFiles:
    """Every tensor of the checkpoint in ``model_path``: its file, dtype and shape (from the headers), and its data
    on request (:meth:`read`, through ``safetensors.safe_open``)."""

    def __init__(self, model_path: str) -> None:
        self.model_path = model_path
        index = os.path.join(model_path, INDEX)
        if os.path.isfile(index):
            self.source = index
            try:
                with open(index, encoding="utf-8") as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise CheckpointError(
                    f"checkpoint index {index}: cannot be read as a safetensors index with a "
                    f"weight_map ({type(e).__name__}: {e})"
                ) from None
        else:
            self.source = os.path.join(model_path, SINGLE)
            if not os.path.isfile(self.source):
                raise CheckpointError(f"checkpoint {model_path}: has neither {SINGLE} nor {INDEX}")
            weight_map = None
        files = sorted(set(weight_map.values())) if weight_map is not None else [SINGLE]
        self.headers: dict[str, dict[str, Any]] = {}
        for file in files:
            path = os.path.join(model_path, file)
            if not os.path.isfile(path):
                tensor = next(t for t, f in (weight_map or {}).items() if f == file)
                raise CheckpointError(f"checkpoint file {path}: missing (the index puts tensor {tensor!r} in it)")
            self.headers[file] = _read_header(path)
        if weight_map is None:
            weight_map = dict.fromkeys(self.headers[SINGLE], SINGLE)
        for tensor, file in weight_map.items():
            if tensor not in self.headers[file]:
                raise CheckpointError(
                    f"checkpoint file {os.path.join(model_path, file)}: has no tensor {tensor!r}, "
                    f"which {INDEX} puts in it"
                )
        self.weight_map: dict[str, str] = weight_map
        self._open: dict[str, Any] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def path(self, name: str) -> str:
        """The file holding tensor ``name`` (which must exist)."""
        return os.path.join(self.model_path, self.weight_map[name])

    def dtype(self, name: str) -> str:
        """Tensor ``name``'s safetensors dtype code (``BF16``, ``F8_E4M3``, ``I8``, ...)."""
        return self.headers[self.weight_map[name]][name]["dtype"]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.headers[self.weight_map[name]][name]["shape"])

    def require(self, name: str, needed_by: str) -> None:
        """Raise :class:`CheckpointError` unless tensor ``name`` exists (``needed_by`` says what needs it)."""
        if name not in self.weight_map:
            raise CheckpointError(f"checkpoint {self.source}: tensor {name!r} is missing ({needed_by})")

    def read(self, name: str, rows: range | None = None) -> torch.Tensor:
        """Tensor ``name`` as stored (dtype and shape of its header), on the CPU; only ``rows`` of its first dim when
        given (a fused expert tensor: a rank reads its own experts' rows only)."""
        self.require(name, "read")
        file = self.weight_map[name]
        if file not in self._open:
            from safetensors import safe_open

            self._open[file] = safe_open(os.path.join(self.model_path, file), "pt")
        if rows is None:
            return self._open[file].get_tensor(name)
        return self._open[file].get_slice(name)[rows.start : rows.stop]
