"""What other DeepEP ports add to ``Buffer``, on :class:`deep_ep_npu.Buffer`: DeepEP-Ascend's low-latency keywords
(sgl-kernel-npu's ``deep_ep``: ``topk_weights``, ``quant_mode``, ``use_mxfp4``; SGLang's NPU branch passes them) and
DeepEP's ``get_local_buffer_tensor`` (vLLM's fault-tolerance path zeroes it). A mixin of :class:`deep_ep_npu.Buffer`.

DeepEP-Ascend's ``quant_mode`` values (https://github.com/sgl-project/sgl-kernel-npu,
``python/deep_ep/deep_ep/buffer.py``): None (its ``use_fp8`` / ``use_ue8m0`` / ``use_mxfp4`` decide), ``"int8"``
(per-token dynamic int8: here ``quant_format="int8_per_token"``); its MX / per-token fp8 / fp4 modes are not
implemented here and raise, naming what is."""

from __future__ import annotations

import torch

from .errors import invalid

ASCEND_QUANT_MODES = (None, "int8")
ASCEND_UNSUPPORTED = ("mx_fp8_e4m3", "mx_fp8_e5m2", "pertoken_fp8_e4m3", "mx_fp4_e2m1")


def ascend_quant(
    use_fp8: bool, use_mxfp4: object, quant_mode: object, quant_format: str | None
) -> tuple[bool, str | None]:
    """DeepEP-Ascend's ``use_mxfp4`` / ``quant_mode`` as this Buffer's ``(use_fp8, quant_format)``."""
    if not isinstance(use_mxfp4, bool):
        raise invalid("use_mxfp4", f"must be a bool, got {type(use_mxfp4).__name__} {use_mxfp4!r}")
    if use_mxfp4 and quant_mode is None:
        quant_mode = "mx_fp4_e2m1"
    if quant_mode is None:
        return use_fp8, quant_format
    if quant_mode not in ASCEND_QUANT_MODES:
        known = "not implemented here" if quant_mode in ASCEND_UNSUPPORTED else "not a DeepEP-Ascend quant_mode"
        raise invalid("quant_mode", f"got {quant_mode!r} ({known}); allowed {list(ASCEND_QUANT_MODES)}")
    if quant_format not in (None, "int8_per_token"):
        raise invalid("quant_format", f"is {quant_format!r} but quant_mode='int8' means 'int8_per_token'; pass one")
    return True, "int8_per_token"


class CompatMethods:
    """``get_local_buffer_tensor`` of :class:`deep_ep_npu.Buffer`."""

    num_nvl_bytes: int
    num_rdma_bytes: int
    _local: dict[bool, torch.Tensor]

    def get_local_buffer_tensor(
        self, dtype: torch.dtype, size: torch.Size | None = None, offset: int = 0, use_rdma_buffer: bool = False
    ) -> torch.Tensor:
        """DeepEP's raw local buffer as a tensor: this Buffer's own ``num_rdma_bytes`` (``use_rdma_buffer``) or
        ``num_nvl_bytes`` bytes (zeroed at first use, kept for the Buffer's life; the rows of dispatch / combine never
        live there, so writing it changes no result), viewed as ``dtype`` from byte ``offset``: `[(bytes - offset) //
        itemsize]`, or its first ``size.numel()`` elements shaped ``size``."""
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype: must be a torch.dtype, got {type(dtype).__name__}")
        nbytes = self.num_rdma_bytes if use_rdma_buffer else self.num_nvl_bytes
        if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset <= nbytes:
            raise ValueError(f"offset: must be an int byte offset in [0, {nbytes}], got {offset!r}")
        if offset % dtype.itemsize:
            raise ValueError(f"offset: {offset} is not a multiple of {dtype}'s {dtype.itemsize} bytes")
        if not hasattr(self, "_local"):
            self._local = {}
        raw = self._local.setdefault(bool(use_rdma_buffer), torch.zeros((nbytes,), dtype=torch.uint8))
        usable = (nbytes - offset) // dtype.itemsize
        tensor = raw[offset : offset + usable * dtype.itemsize].view(dtype)
        if size is None:
            return tensor
        if tensor.numel() < (want := torch.Size(size).numel()):
            raise ValueError(
                f"size: {tuple(size)} needs {want} elements, the buffer holds {tensor.numel()} from offset"
            )
        return tensor[:want].view(size)
