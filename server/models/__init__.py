"""MoE model code (plain torch): Qwen3-MoE, DeepSeek-V3 and Mixtral over one decoder stack, EP-aware MoE layer."""

from .config import ModelConfig
from .ep_comm import ExpertComm, LocalComm
from .forward_batch import ForwardBatch, SeqInput
from .kv_cache import PagedKVCache
from .model import MoECausalLM

__all__ = ["ExpertComm", "ForwardBatch", "LocalComm", "ModelConfig", "MoECausalLM", "PagedKVCache", "SeqInput"]
