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
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .checkpoint import CheckpointError, CheckpointFiles, WeightFormat, detect_format
from .models.config import ModelConfig
from .models.ep_comm import ExpertComm, LocalComm
from .models.model import MoECausalLM
from .models.moe import Router
from .random_model import RandomTensors, random_hf_config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_EXPERT_PARAM = re.compile(r"model\.layers\.(\d+)\.\w+\.experts\.(w13|w2)$")


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
    for dest, name in checkpoint_reads(model):
        tensors.check(name, dest.shape, f"config.json needs it with shape {tuple(dest.shape)}")
    return cfg


class CheckpointTensors:
    """The float tensors of one checkpoint directory by name: stored ones as they are, quantized ones dequantized
    by the checkpoint's format."""

    def __init__(self, model_path: str, hf_config: dict[str, Any]) -> None:
        self.files = CheckpointFiles(model_path)
        self.format: WeightFormat = detect_format(model_path, hf_config)

    def check(self, name: str, shape: torch.Size, needed_by: str) -> None:
        """Raise :class:`CheckpointError` unless :meth:`get` can give ``name`` with ``shape`` (headers only)."""
        self.format.check(self.files, name, tuple(shape), needed_by)

    def get(self, name: str, shape: torch.Size) -> torch.Tensor:
        """Tensor ``name`` as a float tensor of ``shape``; one holding NaN or Inf is a :class:`CheckpointError`."""
        self.check(name, shape, "the model reads it")
        t = self.format.load(self.files, name, tuple(shape))
        bad = int((~torch.isfinite(t)).sum()) if t.is_floating_point() else 0
        if bad:
            raise CheckpointError(f"checkpoint file {self.files.path(name)}: tensor {name!r} holds {bad} non-finite "
                                  f"value(s) (NaN or Inf) of {t.numel()}; the checkpoint is corrupt")  # fmt: skip
        return t


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


def checkpoint_reads(model: MoECausalLM) -> Iterator[tuple[torch.Tensor, str]]:
    """Every value ``model`` is filled with: ``(destination, checkpoint tensor name)``, the destination a parameter
    or buffer or a slice of one, whose shape the checkpoint tensor must have (a tied ``lm_head`` reads the
    embedding, as transformers ties it)."""
    cfg = model.cfg
    for name, t in model.state_dict(keep_vars=True).items():
        match = _EXPERT_PARAM.match(name)
        if match is None:
            tied = name == "lm_head.weight" and cfg.tie_word_embeddings
            yield t.data, "model.embed_tokens.weight" if tied else name
            continue
        layer, which = int(match.group(1)), match.group(2)
        inter = cfg.moe_intermediate_size
        for j, e in enumerate(model.comm.local_expert_ids):
            gate, up, down = model.expert_checkpoint_keys(layer, e)
            if which == "w13":
                yield t.data[j, :inter], gate
                yield t.data[j, inter:], up
            else:
                yield t.data[j], down


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
    for dest, name in checkpoint_reads(model):
        dest.copy_(tensors.get(name, dest.shape))
        if dest.is_floating_point() and not bool(torch.isfinite(dest).all()):
            raise CheckpointError(f"checkpoint tensor {name!r} overflows {dtype} (its values beyond that range "
                                  "become Inf); serve this checkpoint with --dtype bfloat16 or float32")  # fmt: skip
    for moe in model.moe_layers():
        if moe.fused:
            moe.prepare_fused()
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
