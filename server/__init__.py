"""The serving layer: EP decode runtime, offline ``LLM`` API and the OpenAI-compatible HTTP server."""

from typing import Any

from .engine_api import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":  # imported lazily: `import server` stays free of torch
        from .runtime.llm import LLM

        return LLM
    raise AttributeError(f"module 'server' has no attribute {name!r}")
