"""Prefill/decode disaggregation (``--disaggregation-mode prefill|decode``).

A prefill instance computes a request's prompt and first token, then keeps the request's KV-cache blocks held and
registered with the transfer engine until the decode instance has pulled them (:mod:`.bootstrap`: the prefill
side's bootstrap server, where decode instances learn where the blocks are; :mod:`.fetch`: the decode side). The
decode instance allocates blocks in its own paged cache, and its worker reads the prompt's KV straight into them
(:mod:`.transfer`: the transfer engine, Mooncake's by default; :mod:`.layout`: which bytes move). The two halves of
a request meet by its bootstrap room, as SGLang's do; ``python -m server.router`` sends each request to both.
"""

from .layout import KVLayout, LayoutMismatch
from .transfer import TRANSFER_BACKENDS, KVPull, TransferBackend, make_backend

__all__ = ["TRANSFER_BACKENDS", "KVLayout", "KVPull", "LayoutMismatch", "TransferBackend", "make_backend"]
