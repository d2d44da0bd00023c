"""``python -m server.router``: the OpenAI-compatible front of a disaggregated deployment. Each completion or chat
request goes to one prefill instance and one decode instance (round-robin or least-loaded) with the same body plus
a fresh bootstrap room (SGLang's ``bootstrap_host`` / ``bootstrap_port`` / ``bootstrap_room``); the client gets the
decode instance's answer, streamed or not (:mod:`.app`; the instances: :mod:`.pool`)."""

from .app import create_router_app
from .pool import Instance, Pool

__all__ = ["Instance", "Pool", "create_router_app"]
