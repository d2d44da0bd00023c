"""Build a :class:`~server.models.model.MoECausalLM` on one EP rank from an HF checkpoint or from a seed.

Checkpoints are HF directories: ``config.json`` (+ optional ``generation_config.json``) and either
``model.safetensors`` or shards listed in ``model.safetensors.index.json`` (:mod:`server.checkpoint`). Tensors are
read one at a time and only those this rank needs: every shared weight, and of the routed experts only
``comm.local_expert_ids``, so a rank's peak memory holds its own experts only. Quantized weights are dequantized as
their format says (:mod:`server.checkpoint.formats`). The model is built uninitialised and materialised directly in
the target dtype (no random init, no second copy).

Faults of a checkpoint stop start-up with one line naming the file and the tensor (:class:`CheckpointError`):
:func:`read_config` checks, from the file headers only, that every tensor the model reads exists with the shape
the config needs (and its scales, when quantized) and that no file is truncated; :meth:`CheckpointTensors.get`
refuses a tensor holding NaN or Inf as it is loaded.

Without a checkpoint the random model of :mod:`server.random_model` is built.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .checkpoint import CheckpointError, CheckpointFiles, WeightFormat, detect_format
from .checkpoint.formats import AUX_SUFFIXES
from .checkpoint.reads import Read, checkpoint_reads
from .models.config import ModelConfig
from .models.ep_comm import ExpertComm, LocalComm
from .models.model import MoECausalLM
from .models.moe import Router
from .random_model import RandomTensors, random_hf_config

logger = logging.getLogger("server.loader")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot be read as JSON ({type(e).__name__}: {e})") from None


def read_hf_config(model_path: str) -> tuple[dict[str, Any], ModelConfig]:
    """``config.json`` of an HF checkpoint directory, as parsed JSON and as a :class:`ModelConfig` (EOS ids from
    ``generation_config.json`` too)."""
    path = os.path.join(model_path, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"model={model_path!r} has no config.json (expected an HF checkpoint directory)")
    cfg = _read_json(path)
    gen_path = os.path.join(model_path, "generation_config.json")
    gen = _read_json(gen_path) if os.path.isfile(gen_path) else None
    return cfg, ModelConfig.from_hf(cfg, gen)


def read_config(model_path: str) -> ModelConfig:
    """The :class:`ModelConfig` of the checkpoint in ``model_path``, after checking (headers only) that the
    checkpoint can fill that model: raises :class:`CheckpointError` naming the file and tensor otherwise."""
    hf_cfg, cfg = read_hf_config(model_path)
    tensors = CheckpointTensors(model_path, hf_cfg)
    with torch.device("meta"):
        model = MoECausalLM(cfg, LocalComm(cfg.num_experts, 1))
    names = set()
    for _, read in checkpoint_reads(model):
        tensors.check(read, f"config.json needs it with shape {read.shape}")
        names.add(read.name)
    unused = [n for n in tensors.files.weight_map if n not in names and not _ignorable(n, cfg.num_hidden_layers)]
    if unused:
        logger.warning(
            "checkpoint %s: %d tensor(s) that the model does not read (transformers ignores them too), e.g. %s",
            model_path,
            len(unused),
            ", ".join(unused[:3]),
        )
    return cfg


def _ignorable(name: str, num_layers: int) -> bool:
    """A tensor no model of ours reads, by design: quantization scales (read through their weight), MTP layers
    past ``num_hidden_layers`` (DeepSeek-V3, GLM-4.5), stored rotary frequencies."""
    layer = re.match(r"model\.layers\.(\d+)\.", name)
    return (
        name.endswith(AUX_SUFFIXES)
        or name.endswith("rotary_emb.inv_freq")
        or (layer is not None and int(layer.group(1)) >= num_layers)
    )


class CheckpointTensors:
    """The float tensors of one checkpoint directory by name: stored ones as they are, quantized ones dequantized
    by the checkpoint's format."""

    def __init__(self, model_path: str, hf_config: dict[str, Any]) -> None:
        self.files = CheckpointFiles(model_path)
        self.format: WeightFormat = detect_format(model_path, hf_config)

    def check(self, read: Read, needed_by: str) -> None:
        """Raise :class:`CheckpointError` unless :meth:`get` can give ``read`` (headers only)."""
        self.format.check(self.files, read.name, read.shape, needed_by)

    def get(self, read: Read) -> torch.Tensor:
        """The float tensor ``read`` names (its rows, in its layout); one holding NaN or Inf is a
        :class:`CheckpointError`."""
        self.check(read, "the model reads it")
        t = self.format.load(self.files, read.name, read.shape, read.rows)
        bad = int((~torch.isfinite(t)).sum()) if t.is_floating_point() else 0
        if bad:
            where = self.files.path(read.name) if read.name in self.files else self.files.source
            raise CheckpointError(
                f"checkpoint file {where}: tensor {read.name!r} holds {bad} non-finite value(s) "
                f"(NaN or Inf) of {t.numel()}; the checkpoint is corrupt"
            )
        return t if read.layout is None else read.layout(t)


@contextlib.contextmanager
def _no_init(dtype: torch.dtype) -> Iterator[None]:
    """Build with uninitialised parameters of ``dtype``: ``reset_parameters`` of torch layers is skipped (every
    value is loaded right after, so there is no random init and no second copy for a dtype cast)."""
    saved = [(cls, cls.reset_parameters) for cls in (nn.Linear, nn.Embedding)]
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    for cls, _ in saved:
        cls.reset_parameters = lambda self: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.set_default_dtype(default_dtype)
        for cls, fn in saved:
            cls.reset_parameters = fn  # type: ignore[method-assign]


def build_model(
    cfg: ModelConfig,
    comm: ExpertComm,
    dtype: torch.dtype,
    tensors: CheckpointTensors | RandomTensors,
    device: torch.device | str = "cpu",
) -> MoECausalLM:
    """Create the rank's model on ``device`` and fill every parameter and buffer from ``tensors`` (routers stay
    fp32; each tensor is read on the CPU and copied to ``device``)."""
    with _no_init(dtype), torch.device(device):
        model = MoECausalLM(cfg, comm)
    for m in model.modules():
        if isinstance(m, Router):
            m.float()
    for dest, read in checkpoint_reads(model):
        dest.copy_(tensors.get(read))
        if dest.is_floating_point() and not bool(torch.isfinite(dest).all()):
            raise CheckpointError(
                f"checkpoint tensor {read.name!r} overflows {dtype} (its values beyond that range "
                "become Inf); serve this checkpoint with --dtype bfloat16 or float32"
            )
    for moe in model.moe_layers():
        if moe.fused:
            moe.prepare_fused()
    model.fuse_weights()
    model.eval()
    return model


def load_model(
    model_path: str | None,
    comm_factory: Callable[[ModelConfig], ExpertComm],
    dtype: str = "float32",
    seed: int = 0,
    random_model: dict[str, Any] | None = None,
    device: torch.device | str = "cpu",
) -> MoECausalLM:
    """The rank's model from ``model_path`` (HF checkpoint dir) or, if None, the random model ``random_model``,
    on ``device``."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; use one of {sorted(DTYPES)}")
    if model_path is None:
        cfg = ModelConfig.from_hf(random_hf_config(random_model))
        tensors: CheckpointTensors | RandomTensors = RandomTensors(seed)
    else:
        hf_cfg, cfg = read_hf_config(model_path)
        tensors = CheckpointTensors(model_path, hf_cfg)
    return build_model(cfg, comm_factory(cfg), DTYPES[dtype], tensors, device)
