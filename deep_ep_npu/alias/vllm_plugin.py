"""vLLM's out-of-tree plugin (entry point group ``vllm.general_plugins``, name ``deep_ep_npu``): vLLM loads it in
every process it starts, before a model or communicator is built; it calls :func:`deep_ep_npu.alias.install`, so
``--all2all-backend deepep_low_latency`` / ``deepep_high_throughput`` find ``deep_ep`` (vLLM checks
``importlib.util.find_spec("deep_ep")``) and build their managers on ``deep_ep_npu.Buffer``, unless a real DeepEP is
installed (it is then used, untouched). ``VLLM_PLUGINS`` (vLLM's) can leave it out."""

from __future__ import annotations

from . import install


def register() -> None:
    """vLLM's plugin hook."""
    install()
