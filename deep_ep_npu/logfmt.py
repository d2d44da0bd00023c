"""DeepEP's LogFMT-10 combine format (``low_latency_combine(..., use_logfmt=True)``): bf16 rows travel as 10-bit
logarithmic codes per 128-channel group when the group's range allows it, else as bf16.

Per group of 128 channels, with ``amax`` / ``amin`` the largest / smallest magnitude (bf16 values, sent as two
bf16): ``log_amax = log2(amax)``, ``log_amin = max(log2(amin), log_amax - 32)``. The group is cast only when
``log_amax < 0`` (every magnitude below 1) and ``log_amin < log_amax``; the receiver takes the same decision from
the two values. A cast element is a sign bit and a 9-bit code ``c``: with ``step = (log_amax - log_amin) / 510``,
``c = floor(max(log2|x| / step + 2 - log2((1 + 2^step) / 2) / step - log_amin / step, 0))`` (the nearest of the
representable magnitudes in linear terms), and it decodes to 0 for ``c = 0``, else ``±2^((c - 1) * step +
log_amin)``, in fp32 (accumulated without a bf16 rounding). DeepEP's kernels use the GPU's approximate log2 / exp2;
these use exact ones, so a code can differ in rare ties. A row here is ``[amax, amin bf16 per group][group bytes]``,
each group 256 bytes (its 128 codes packed 4 per 5 bytes fill 160 of them), the size of DeepEP's combine slot.
"""

from __future__ import annotations

import torch

GROUP = 128
NUM_CODES = 1 << 9  # 9 magnitude bits + 1 sign bit
MIN_CLIP = 32.0  # log_amin >= log_amax - 32
CODE_BYTES = GROUP // 4 * 5  # a group's 128 codes, 4 per 5 bytes


def row_bytes(hidden: int) -> int:
    """Bytes of one encoded row of ``hidden`` channels (``hidden % 128 == 0``)."""
    return 4 * (hidden // GROUP) + 2 * hidden


def _logs(amax: torch.Tensor, amin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log_amin, step, cast) per group from fp32 ``amax`` / ``amin``."""
    log_amax = torch.log2(amax)
    log_amin = torch.maximum(torch.log2(amin), log_amax - MIN_CLIP)
    return log_amin, (log_amax - log_amin) / (NUM_CODES - 2), (log_amax < 0) & (log_amin < log_amax)


def encode(rows: torch.Tensor) -> torch.Tensor:
    """`[n, hidden]` `torch.bfloat16` -> `[n, row_bytes(hidden)]` `torch.uint8`."""
    n, hidden = rows.shape
    groups = hidden // GROUP
    x = rows.view(n, groups, GROUP)
    mag = x.abs().float()
    amax, amin = mag.amax(dim=2), mag.amin(dim=2)
    log_amin, step, cast = _logs(amax, amin)
    step_inv = 1.0 / step
    fused = 2.0 - torch.log2((1.0 + torch.exp2(step)) * 0.5) * step_inv - log_amin * step_inv
    code = torch.floor(torch.clamp(torch.log2(mag) * step_inv.unsqueeze(2) + fused.unsqueeze(2), min=0))
    code = torch.nan_to_num(code, nan=0.0).clamp(max=NUM_CODES - 1).to(torch.int64)
    value = code | (torch.signbit(x).to(torch.int64) << 9)  # [n, G, 128] 10-bit values
    quads = value.view(n, groups, GROUP // 4, 4)
    packed40 = quads[..., 0] | quads[..., 1] << 10 | quads[..., 2] << 20 | quads[..., 3] << 30  # 40 bits
    packed = torch.stack([(packed40 >> (8 * b)) & 0xFF for b in range(5)], dim=-1).to(torch.uint8)
    body = x.contiguous().view(torch.uint8).view(n, groups, 2 * GROUP).clone()
    body[..., :CODE_BYTES] = torch.where(cast.view(n, groups, 1), packed.view(n, groups, -1), body[..., :CODE_BYTES])
    meta = torch.stack([amax, amin], dim=2).to(torch.bfloat16).view(torch.uint8).view(n, 4 * groups)
    return torch.cat([meta, body.view(n, 2 * hidden)], dim=1)


def decode(packed: torch.Tensor, hidden: int) -> torch.Tensor:
    """`[n, row_bytes(hidden)]` `torch.uint8` -> `[n, hidden]` `torch.float32` (a fresh tensor)."""
    n, groups = packed.shape[0], hidden // GROUP
    meta = packed[:, : 4 * groups].contiguous().view(torch.bfloat16).view(n, groups, 2).float()
    amax, amin = meta[..., 0], meta[..., 1]
    log_amin, step, cast = _logs(amax, amin)
    body = packed[:, 4 * groups :].contiguous().view(n, groups, 2 * GROUP)
    raw = body.view(torch.bfloat16).float()  # groups that were not cast
    b = body[..., :CODE_BYTES].view(n, groups, GROUP // 4, 5).to(torch.int64)
    packed40 = b[..., 0] | b[..., 1] << 8 | b[..., 2] << 16 | b[..., 3] << 24 | b[..., 4] << 32
    value = torch.stack([(packed40 >> (10 * k)) & 0x3FF for k in range(4)], dim=-1).view(n, groups, GROUP)
    code, negative = value & (NUM_CODES - 1), (value >> 9).bool()
    mag = torch.exp2((code - 1).float() * step.unsqueeze(2) + log_amin.unsqueeze(2))
    decoded = torch.where(code == 0, 0.0, torch.where(negative, -mag, mag))
    return torch.where(cast.unsqueeze(2), decoded, raw).view(n, hidden)
