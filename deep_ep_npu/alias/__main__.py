"""``python -m deep_ep_npu.alias``: print the folder to put on ``PYTHONPATH`` so that ``import deep_ep`` in every
process started from this shell gives deep_ep_npu (unless a real DeepEP is installed: it is then loaded instead)::

    export PYTHONPATH=$(python -m deep_ep_npu.alias)${PYTHONPATH:+:$PYTHONPATH}
"""

from __future__ import annotations

import os

print(os.path.join(os.path.dirname(os.path.abspath(__file__)), "path"))
