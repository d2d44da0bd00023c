"""``import deep_ep`` for engines written against DeepEP, opt in and never over a real DeepEP: :func:`install` adds an
import hook at the *end* of ``sys.meta_path``, so Python's own path finder (which finds an installed DeepEP) always
goes first; only when no ``deep_ep`` is installed does ``import deep_ep`` give :mod:`deep_ep_npu.alias.deep_ep`
(DeepEP's public names: ``Buffer``, ``Config``, ``ElasticBuffer``, ``EPHandle``, ``EventOverlap``, ``EventHandle``,
``topk_idx_t``; ``deep_ep.utils.event``).

Why not a ``deep_ep`` package of ours on ``sys.path``: it would shadow (or be shadowed by) a real DeepEP depending on
install order. The hook never can. Engines whose worker processes start fresh interpreters get it by one of:

- vLLM: nothing to do, the ``vllm.general_plugins`` entry point (:mod:`.vllm_plugin`) calls :func:`install` in
  every process vLLM starts;
- any engine (SGLang): ``export PYTHONPATH=$(python -m deep_ep_npu.alias)`` puts a ``deep_ep`` on the path
  (inherited by every child process) that loads an installed DeepEP when there is one and this library otherwise."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType

NAME = "deep_ep"
_TARGETS = {
    NAME: "deep_ep_npu.alias.deep_ep",
    f"{NAME}.utils": "deep_ep_npu.alias.utils",
    f"{NAME}.utils.event": "deep_ep_npu.alias.utils",
}


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.target)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing: the module is ours, already executed."""


class AliasFinder(importlib.abc.MetaPathFinder):
    """Resolves ``deep_ep`` (and ``deep_ep.utils[.event]``) to this library's modules; last on ``sys.meta_path``."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _TARGETS:
            return None
        package = fullname != f"{NAME}.utils.event"
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(_TARGETS[fullname]), is_package=package)


def real_deep_ep() -> str | None:
    """Where an installed DeepEP is (its origin), or None."""
    for finder in sys.meta_path:
        if isinstance(finder, AliasFinder) or not hasattr(finder, "find_spec"):
            continue
        spec = finder.find_spec(NAME, None)
        if spec is not None:
            return str(spec.origin or spec.submodule_search_locations)
    return None


def install() -> bool:
    """Let ``import deep_ep`` give this library when no DeepEP is installed; True when it will (or already does),
    False when a real DeepEP is installed (it stays what ``import deep_ep`` gives). Idempotent."""
    if not any(isinstance(f, AliasFinder) for f in sys.meta_path):
        sys.meta_path.append(AliasFinder())
    loaded = sys.modules.get(NAME)
    if loaded is not None:
        return loaded.__name__ == "deep_ep_npu.alias.deep_ep" or getattr(loaded, "__spec__", None) is None
    return real_deep_ep() is None
