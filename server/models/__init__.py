"""MoE model code (plain torch): Qwen3-MoE, DeepSeek-V3 and Mixtral over one decoder stack, EP-aware MoE layer."""

from .attention import ForwardBatch
from .config import ModelConfig
from .ep_comm import ExpertComm, LocalComm
from .model import KVCache, MoECausalLM

__all__ = ["ExpertComm", "ForwardBatch", "KVCache", "LocalComm", "ModelConfig", "MoECausalLM"]
