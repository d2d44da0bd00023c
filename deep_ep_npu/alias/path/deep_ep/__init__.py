"""``deep_ep`` for processes started with this folder's parent on ``PYTHONPATH`` (``python -m deep_ep_npu.alias``
prints it): an installed DeepEP found further along ``sys.path`` is loaded in this module's place; only without one
does ``deep_ep`` give deep_ep_npu's names (:mod:`deep_ep_npu.alias.deep_ep`)."""

import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_REST = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
_REAL = importlib.machinery.PathFinder.find_spec(__name__, _REST)
if _REAL is not None and _REAL.loader is not None:  # a real DeepEP: it, not us
    _module = importlib.util.module_from_spec(_REAL)
    sys.modules[__name__] = _module
    _REAL.loader.exec_module(_module)
else:
    from deep_ep_npu.alias.deep_ep import *  # noqa: F403
    from deep_ep_npu.alias.deep_ep import __all__, __version__  # noqa: F401
